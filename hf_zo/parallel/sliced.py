"""Sliced upload (DistZO2's hardware-aware communication): the ranks of a PertP group share the upload of a block.

The `p` ranks of a perturbation-parallel group hold the same blocks (bit-identical replicas) and need the same block
at the same time. Instead of each rank moving the whole block from its storage tier, each moves ``1/p`` of the
block's bytes and the group all-gathers the rest over the device interconnect (NVLink with NCCL; gloo on CPU, where
only correctness is of interest). Host-to-device traffic per rank drops ``p``-fold, for ``(p - 1) / p`` of a block
per rank over the interconnect.

`SlicedTransport` has the interface of the offload transports (`hf_zo.offload.transport`), so `BlockOffloader`
schedules it unchanged: ``load`` starts the slice copy and the all-gather, ``wait`` hands over the block's working
tensors, ``unload`` writes the changed tensors back into this rank's own storage (every replica keeps a complete,
current copy, so saving and evaluation read it as usual). Its all-gathers run on a process group of their own,
in the deterministic order of the schedule (the same on every rank of the group), so they never interleave with
the scalar collectives of the estimate.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import timedelta

import torch
import torch.distributed as dist

from .collectives import CommStats
from .mesh import ZOMesh

# `all_gather_single` replaces `all_gather_into_tensor` (deprecated) in recent torch releases.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_ALIGN = 64  # bytes: every tensor starts aligned in the gathered buffer, so it can be viewed in its dtype


def build_slice_group(mesh: ZOMesh, backend: str, timeout: timedelta) -> dist.ProcessGroup:
    """A process group over this rank's PertP group, reserved for the sliced all-gathers of block uploads.

    Every rank must call it (at the same point), since `torch.distributed.new_group` is collective.
    """
    layout = torch.arange(mesh.world_size).view(mesh.dp_size, mesh.pertp_size)
    mine = None
    for ranks in layout.tolist():
        group = dist.new_group(ranks=ranks, backend=backend, timeout=timeout, group_desc="hf_zo_sliced_upload")
        if mesh.rank in ranks:
            mine = group
    return mine


class SlicedTransport:
    """Uploads 1/p of each block from this rank's storage and all-gathers the rest from the ranks of `group`.

    Args:
        device (`torch.device` or `str`): the working device (a GPU with NCCL; the CPU with gloo).
        group (`torch.distributed.ProcessGroup`): the ranks that share the upload (this rank's PertP group), used
            for nothing else (see `build_slice_group`).
        stats (`CommStats`, *optional*): where the all-gathers' bytes are counted (kept apart from the scalar
            collectives of the estimate).

    Attributes:
        stats (`CommStats`): the bytes and calls of the block all-gathers so far.
    """

    def __init__(self, device: torch.device | str, group: dist.ProcessGroup, stats: CommStats | None = None):
        self.device = torch.device(device)
        self.group = group
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.stats = stats if stats is not None else CommStats()
        self._cuda = self.device.type == "cuda"
        self._stream = torch.cuda.Stream(device=self.device) if self._cuda else None
        self._pool = None if self._cuda else ThreadPoolExecutor(max_workers=1, thread_name_prefix="hf_zo_sliced")
        self._last: Future | None = None
        self._buffers: dict[int, torch.Tensor] = {}
        self._free: dict[int, list[torch.Tensor]] = {}
        self._after: list[Callable[[], None]] = []

    # ------------------------------------------------------------------ layout of a block in the gathered buffer

    def _layout(self, sources: Sequence[torch.Tensor]) -> tuple[list[int], int]:
        """Byte offset of each tensor in the block's buffer and the buffer's size (a multiple of ``p * align``)."""
        offsets, end = [], 0
        for source in sources:
            offsets.append(end)
            end += -(-source.numel() * source.element_size() // _ALIGN) * _ALIGN
        quantum = self.size * _ALIGN
        return offsets, max(quantum, -(-end // quantum) * quantum)

    def _gather(
        self, sources: Sequence[torch.Tensor], dtypes: Sequence[torch.dtype]
    ) -> tuple[list[torch.Tensor], torch.Tensor]:
        """Copy this rank's slice of the block from storage, all-gather the block and view it tensor by tensor.

        Returns the working tensors and the gathered buffer they view.
        """
        offsets, total = self._layout(sources)
        flat = self._buffer(total)
        chunk = total // self.size
        low, high = self.rank * chunk, (self.rank + 1) * chunk
        for source, offset in zip(sources, offsets):
            size = source.numel() * source.element_size()
            start, stop = max(low, offset), min(high, offset + size)
            if start < stop:
                data = source.detach().reshape(-1).view(torch.uint8)[start - offset : stop - offset]
                flat[start:stop].copy_(data, non_blocking=self._cuda)
        _all_gather_single(flat, flat[low:high], group=self.group)
        self.stats.calls += 1
        self.stats.bytes_sent += chunk * (self.size - 1)
        self.stats.bytes_received += chunk * (self.size - 1)
        tensors = []
        for source, offset, dtype in zip(sources, offsets, dtypes):
            size = source.numel() * source.element_size()
            tensor = flat[offset : offset + size].view(source.dtype).view(source.shape)
            tensors.append(tensor if dtype == source.dtype else tensor.to(dtype))
        return tensors, flat

    def _buffer(self, nbytes: int) -> torch.Tensor:
        recycled = self._free.get(nbytes)
        if recycled:
            return recycled.pop()
        return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    # ------------------------------------------------------------------ transport interface

    def load(self, sources: Sequence[torch.Tensor], dtypes: Sequence[torch.dtype]):
        """Start assembling a block from `sources` (this rank's storage views) in `dtypes`; returns a handle."""
        if self._cuda:
            with torch.cuda.stream(self._stream):
                gathered = self._gather(sources, dtypes)
                event = torch.cuda.Event()
                event.record(self._stream)
            return gathered, event
        self._last = self._pool.submit(self._gather, sources, dtypes)
        return self._last

    def wait(self, handle) -> list[torch.Tensor]:
        """The working tensors of a :meth:`load`, once the all-gather is done."""
        if self._cuda:
            (tensors, flat), event = handle
            torch.cuda.current_stream(self.device).wait_event(event)
        else:
            tensors, flat = handle.result()
        self._buffers[id(tensors)] = flat
        return tensors

    def unload(
        self,
        working: Sequence[torch.Tensor],
        pairs: Sequence[tuple[torch.Tensor, torch.Tensor]],
        then: Callable[[], None] | None = None,
    ) -> None:
        """Write each ``(view, tensor)`` of `pairs` back to this rank's storage and recycle the block's buffer;
        `then` runs after the copies (on a GPU, once :meth:`synchronize` has waited for them)."""
        flat = self._buffers.pop(id(working), None)

        def copy():
            for view, tensor in pairs:
                view.copy_(tensor, non_blocking=self._cuda)
            if flat is not None and not self._cuda:
                self._free.setdefault(flat.numel(), []).append(flat)
            if then is not None and not self._cuda:
                then()

        if self._cuda:  # after every use of the block on the compute stream; memory is reused in stream order
            self._stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self._stream):
                copy()
            if then is not None:
                self._after.append(then)
        else:
            self._last = self._pool.submit(copy)

    def synchronize(self) -> None:
        """Wait until every queued copy and all-gather is done.

        Blocks loaded but never unloaded (prefetches that `BlockOffloader.synchronize` drops) are forgotten here, so
        their buffers are freed instead of recycled.
        """
        if self._cuda:
            self._stream.synchronize()
        elif self._last is not None:
            self._last.result()
            self._last = None
        self._buffers.clear()
        while self._after:
            self._after.pop(0)()

    def close(self) -> None:
        """Finish the queued work and free the recycled buffers."""
        self.synchronize()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        self._free.clear()
