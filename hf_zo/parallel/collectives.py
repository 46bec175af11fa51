"""Scalar collectives: the only per-step communication of ZO replicas, with a count of the bytes they move."""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist


@dataclass
class CommStats:
    """Running totals of the collectives issued by one rank.

    Attributes:
        calls (`int`): collectives issued.
        bytes_sent (`int`): payload bytes this rank sent to its peers: for an all-gather of an `n`-byte buffer over
            a group of `g` ranks, ``n * (g - 1)`` (what every rank must deliver to the others, whatever the algorithm).
        bytes_received (`int`): payload bytes this rank received from its peers.
    """

    calls: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0

    def reset(self) -> None:
        """Set every total back to zero."""
        self.calls = self.bytes_sent = self.bytes_received = 0

    def as_dict(self) -> dict[str, int]:
        """The totals as a plain dictionary (for logs and JSON)."""
        return asdict(self)


class ScalarCollectives:
    """All-gathers of small tensors over a process group, counted in :attr:`stats`.

    Args:
        device (`torch.device`): where the buffers live for the backend (CPU for gloo, the rank's GPU for NCCL).
        timeout_seconds (`float`, *optional*): the groups' timeout, quoted in the error raised when a peer is lost.
    """

    def __init__(self, device: torch.device | str = "cpu", timeout_seconds: float | None = None):
        self.device = torch.device(device)
        self.timeout_seconds = timeout_seconds
        self.stats = CommStats()

    def all_gather(self, values: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        """Gather `values` (same shape and dtype on every rank of `group`) from every rank of `group`.

        Args:
            values (`torch.Tensor`): this rank's contribution.
            group (`torch.distributed.ProcessGroup`): the ranks to gather from.

        Returns:
            `torch.Tensor`: on CPU, of shape ``(group_size, *values.shape)``, row `i` from the group's `i`-th rank.
        """
        size = dist.get_world_size(group)
        local = values.to(self.device).contiguous()
        out = torch.empty((size, *local.shape), dtype=local.dtype, device=self.device)
        try:
            dist.all_gather(list(out.unbind(0)), local, group=group)
        except RuntimeError as error:  # gloo/NCCL report a lost peer as a timeout or a closed connection
            ranks = dist.get_process_group_ranks(group)
            waited = f"within {self.timeout_seconds:g} s " if self.timeout_seconds else ""
            raise RuntimeError(
                f"hf_zo: rank {dist.get_rank()} exchanged its ZO scalars with ranks {ranks} but a peer did not answer "
                f"{waited}({error}). Another process died or hung: its own log names the cause. The bound is "
                "ddp_timeout (ZOConfig) or HF_ZO_TIMEOUT."
            ) from error
        payload = local.numel() * local.element_size()
        self.stats.calls += 1
        self.stats.bytes_sent += payload * (size - 1)
        self.stats.bytes_received += payload * (size - 1)
        return out.cpu()
