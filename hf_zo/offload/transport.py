"""Transports: how a block's tensors move between their storage tier and the working device, asynchronously.

Both transports keep the operations of one queue in order (a write-back issued before a load of the same block
finishes before that load reads), so the schedule in :mod:`hf_zo.offload.schedule` is the same code for both.

- `ThreadTransport`: the working device is the CPU; one background thread pages the next blocks of the mapped files
  in while the current one computes (reading from disk overlaps with compute), and the blocks compute in place on
  the mapped pages, which the kernel writes back; only tensors stored in another dtype are copied.
- `CudaTransport`: the working device is a GPU; copies run on a dedicated CUDA stream from pinned host memory, and
  events order them against the compute stream.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import torch


class ThreadTransport:
    """Moves tensors between storage and the CPU as the working device, on one background thread.

    A tensor stored in its working dtype is used in place: its load pages it in on the background thread (reading
    one element per page of the mapped file), the block computes on the mapped pages, and the kernel writes the
    changed pages back; nothing is copied and no anonymous memory is used. A tensor stored in another dtype (a
    frozen tensor with `offload_dtype`) is copied and cast into a working tensor, recycled once its block is
    released, so at most `prefetch + 1` blocks' worth of working tensors exist.
    """

    def __init__(self):
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hf_zo_offload")
        self._last: Future | None = None
        self._free: dict[tuple, list[torch.Tensor]] = {}
        self._owned: set[int] = set()
        self._lock = threading.Lock()

    def _working(self, source: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        if source.dtype == dtype:
            flat = source.view(-1)
            flat[:: max(1, 4096 // source.element_size())].clone()  # touch every page: map it before compute
            return source
        with self._lock:
            recycled = self._free.get((source.shape, dtype))
            tensor = recycled.pop() if recycled else torch.empty(source.shape, dtype=dtype)
            self._owned.add(id(tensor))
        return tensor.copy_(source)

    def _recycle(self, tensors: Sequence[torch.Tensor]) -> None:
        with self._lock:
            for tensor in tensors:
                if id(tensor) in self._owned:
                    self._free.setdefault((tensor.shape, tensor.dtype), []).append(tensor)

    def load(self, sources: Sequence[torch.Tensor], dtypes: Sequence[torch.dtype]) -> Future:
        """Start bringing `sources` to the CPU in `dtypes`; returns a handle for :meth:`wait`."""
        self._last = self._pool.submit(lambda: [self._working(s, d) for s, d in zip(sources, dtypes)])
        return self._last

    def wait(self, handle: Future) -> list[torch.Tensor]:
        """The working tensors of a :meth:`load`, once they are ready."""
        return handle.result()

    def unload(
        self,
        working: Sequence[torch.Tensor],
        pairs: Sequence[tuple[torch.Tensor, torch.Tensor]],
        then: Callable[[], None] | None = None,
    ) -> None:
        """Hand back a block's `working` tensors, first copying each ``(view, tensor)`` of `pairs` that is not the
        view itself into storage, and then call `then` (the storage releasing the block's pages). The copies run on
        the background thread, in order with the loads."""
        pairs = [(view, tensor) for view, tensor in pairs if view is not tensor]
        if not pairs:
            self._recycle(working)
            if then is not None:
                then()
            return

        def copy():
            for view, tensor in pairs:
                view.copy_(tensor)
            self._recycle(working)
            if then is not None:
                then()

        self._last = self._pool.submit(copy)

    def synchronize(self) -> None:
        """Wait until every queued copy is done (before storage is read or written directly)."""
        if self._last is not None:
            self._last.result()
            self._last = None

    def close(self) -> None:
        """Finish the queued copies, stop the thread and free the recycled tensors."""
        self._pool.shutdown(wait=True)
        self._free.clear()
        self._owned.clear()


class CudaTransport:
    """Moves tensors between pinned host storage and a GPU on a side stream, ordered by CUDA events.

    Args:
        device (`torch.device`): the GPU.
    """

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self._stream = torch.cuda.Stream(device=self.device)
        self._after: list[tuple[torch.cuda.Event, Callable[[], None]]] = []

    def load(self, sources: Sequence[torch.Tensor], dtypes: Sequence[torch.dtype]) -> tuple:
        """Start uploading `sources` (cast to `dtypes` on the GPU); returns a handle for :meth:`wait`."""
        with torch.cuda.stream(self._stream):
            tensors = [s.to(self.device, non_blocking=True).to(d) for s, d in zip(sources, dtypes)]
            event = torch.cuda.Event()
            event.record(self._stream)
        return tensors, event

    def wait(self, handle: tuple) -> list[torch.Tensor]:
        """Make the compute stream wait for an upload and hand over its tensors."""
        tensors, event = handle
        torch.cuda.current_stream(self.device).wait_event(event)
        return tensors

    def unload(
        self,
        working: Sequence[torch.Tensor],
        pairs: Sequence[tuple[torch.Tensor, torch.Tensor]],
        then: Callable[[], None] | None = None,
    ) -> None:
        """Hand back a block's `working` tensors, first downloading each ``(view, tensor)`` of `pairs` to storage;
        `then` runs once the downloads are done (checked at later calls, and by :meth:`synchronize`).

        The copy stream waits for the compute issued so far (every use of the block), so the working memory, which
        was allocated on the copy stream, is reused in stream order by the next upload: at most `prefetch + 1`
        blocks are ever allocated, with no `record_stream` on the compute stream holding freed blocks back.
        """
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._stream):
            for view, tensor in pairs:
                view.copy_(tensor, non_blocking=True)
            if then is not None:
                event = torch.cuda.Event()
                event.record(self._stream)
                self._after.append((event, then))
        self._run_finished()

    def _run_finished(self) -> None:
        while self._after and self._after[0][0].query():
            self._after.pop(0)[1]()

    def synchronize(self) -> None:
        """Wait until every queued copy is done."""
        self._stream.synchronize()
        self._run_finished()

    def close(self) -> None:
        """Finish the queued copies."""
        self.synchronize()
