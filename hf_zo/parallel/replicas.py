"""Replica agreement: every process holds rank 0's tensors when training starts, and keeps holding the same bits.

`DistributedDataParallel` broadcasts rank 0's parameters and buffers when it wraps a model; hf_zo never wraps the model
(replicas exchange scalars only), so it does the equivalent here, cheaply: each rank computes one checksum per tensor,
the checksums are all-gathered (8 bytes per tensor), and only the tensors that differ somewhere are broadcast from
rank 0. A randomly initialised head or LoRA matrix is typically all that moves. During training, the replicas
compare one checksum of their trainable parameters now and then (:class:`ReplicaCallback`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist
from transformers import TrainerCallback
from transformers.utils import logging

from .collectives import ScalarCollectives

logger = logging.get_logger(__name__)

_INTEGER_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}

NamedTensors = Callable[[], Iterable[tuple[str, torch.Tensor]]]


def parameter_checksum(tensors: Iterable[torch.Tensor], chunk_numel: int = 1 << 22) -> int:
    """A position-sensitive checksum of the exact bits of `tensors` (equal bits give equal checksums).

    Computed where the tensors live, a chunk at a time, so it costs one read of the parameters and no transfer.
    """
    checksum = None
    for position, tensor in enumerate(tensors):
        bits = tensor.detach().contiguous().view(-1).view(_INTEGER_OF_SIZE[tensor.element_size()])
        for start in range(0, bits.numel(), chunk_numel):
            part = bits[start : start + chunk_numel].to(torch.int64)
            weights = torch.arange(start, start + part.numel(), device=part.device) % 65521 + 1 + position
            term = (part * weights).sum()
            checksum = term if checksum is None else checksum + term
    return 0 if checksum is None else int(checksum)


@torch.no_grad()
def sync_replicas(named_tensors: Iterable[tuple[str, torch.Tensor]], collectives: ScalarCollectives) -> list[str]:
    """Make every process hold rank 0's value of each tensor, moving only the tensors that differ.

    Collective: every rank must call it with the same tensors in the same order (e.g. a model's `named_parameters()`
    on replicas of one model).

    Args:
        named_tensors (`Iterable[tuple[str, torch.Tensor]]`): the tensors to agree on, with their names.
        collectives (`ScalarCollectives`): gathers the checksums and knows the backend's device (tensors that differ
            are broadcast through a copy on it, so CPU tensors work with NCCL too).

    Returns:
        `list[str]`: the names of the tensors that were broadcast from rank 0 (the same list on every rank).
    """
    named = [(name, tensor) for name, tensor in named_tensors]
    if not named:
        return []
    local = torch.tensor([parameter_checksum([tensor]) for _, tensor in named], dtype=torch.int64)
    checksums = collectives.all_gather(local, dist.group.WORLD)
    differing = (checksums != checksums[0]).any(dim=0).nonzero().flatten().tolist()
    is_source = dist.get_rank() == 0
    for index in differing:
        tensor = named[index][1]
        buffer = tensor.detach().to(collectives.device).contiguous()
        dist.broadcast(buffer, src=0)
        if not is_source:
            tensor.copy_(buffer)
    return [named[index][0] for index in differing]


class ReplicaCallback(TrainerCallback):
    """Keeps the replicas of a multi-process run bit-identical, and stops training with a clear error if they are not.

    - When training starts (after a checkpoint or a linear-probe head was loaded), the trainable parameters and the
      buffers are made equal to rank 0's with :func:`sync_replicas`.
    - After the first optimizer step, every `every_steps` steps and when training ends, each rank flushes its
      pending update, computes :func:`parameter_checksum` of its trainable parameters and all-gathers it (8 bytes
      per rank); different checksums stop training with an error naming the step.

    The bytes it moves are counted in its own :attr:`collectives` (not in the per-step ZO statistics of the plugin).

    Args:
        every_steps (`int`): check interval in optimizer steps (`zo_verify_replicas_steps`); 0 only synchronises at
            the start and never checks.
        collectives (`ScalarCollectives`): collectives for the checksums (on the backend's device).
        named_tensors: a function returning the `(name, tensor)` pairs to keep equal (trainable parameters, buffers).
        flush: a function that applies the optimizer's pending update, so that the checked tensors are current.
    """

    def __init__(self, every_steps: int, collectives: ScalarCollectives, named_tensors: NamedTensors, flush=None):
        if every_steps < 0:
            raise ValueError(f"every_steps must be >= 0 (0: never check), got {every_steps}.")
        self.every_steps = every_steps
        self.collectives = collectives
        self.named_tensors = named_tensors
        self.flush = flush
        self._first_step = None

    def on_train_begin(self, args, state, control, **kwargs):
        self._first_step = state.global_step + 1
        names = sync_replicas(self.named_tensors(), self.collectives)
        if names:
            logger.warning(
                "hf_zo: %d tensors differed between the processes when training started and now hold rank 0's "
                "values: %s.",
                len(names),
                ", ".join(names[:8]) + (", ..." if len(names) > 8 else ""),
            )

    def on_step_end(self, args, state, control, **kwargs):
        if not self.every_steps:
            return
        if state.global_step == self._first_step or state.global_step % self.every_steps == 0:
            self.check(state.global_step)

    def on_train_end(self, args, state, control, **kwargs):
        if self.every_steps and state.global_step % self.every_steps and state.global_step != self._first_step:
            self.check(state.global_step)

    def check(self, step: int) -> int:
        """Compare the replicas' checksums now; raise `RuntimeError` naming `step` if they differ.

        Returns:
            `int`: the common checksum.
        """
        if self.flush is not None:
            self.flush()
        local = parameter_checksum(tensor for _, tensor in self.named_tensors())
        gathered = self.collectives.all_gather(torch.tensor([local], dtype=torch.int64), dist.group.WORLD)
        checksums = gathered.flatten().tolist()
        if len(set(checksums)) > 1:
            by_rank = ", ".join(f"rank {rank}: {value:#x}" for rank, value in enumerate(checksums))
            raise RuntimeError(
                f"hf_zo: the replicas' trainable parameters differ after step {step} ({by_rank}). "
                "Replicas stay identical only when every process runs the same torch build, hardware type and "
                "thread count (OMP_NUM_THREADS) and nothing outside the ZO optimizer changes the weights; resume "
                "from the last checkpoint after fixing the difference."
            )
        logger.info("hf_zo: replicas identical after step %d (checksum %#x on %d ranks).", step, local, len(checksums))
        return local
