"""Taking a tensor's memory-mapped pages out of this process's resident set, without changing its values.

A tensor backed by a memory-mapped file keeps every page it has been read or written through in the process's
resident set for as long as the mapping lives, however long ago that was. For offloaded blocks (the disk tier) and
for a model `from_pretrained` mapped from its safetensors files, that is the whole model after one pass over it:
memory bounded by a few blocks needs the pages of the blocks that are done to be handed back.

- A *shared* file mapping (the disk tier's block files): ``madvise(MADV_DONTNEED)`` drops the pages from the process;
  the file keeps every write (dirty pages stay in the page cache until the kernel writes them back).
- A *private* file mapping (what `from_pretrained` maps): ``madvise(MADV_PAGEOUT)`` reclaims the pages that are
  still the file's and keeps those a write has copied (they exist nowhere else), so nothing is lost either.
- Anonymous memory (tensors torch allocated) is left alone.

Both calls are advice: where the kernel refuses (not Linux, an old kernel), pages simply stay resident.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import sys
from collections.abc import Iterable

import torch
from transformers.utils import logging

logger = logging.get_logger(__name__)

__all__ = ["MappedPages"]

_MADV_DONTNEED = 4
_MADV_PAGEOUT = 21
_PAGE = mmap.PAGESIZE


def _madvise():
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return None
    function = libc.madvise
    function.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    function.restype = ctypes.c_int
    return function


_MADVISE = _madvise()


def _advise(start: int, stop: int, advice: int) -> None:
    """``madvise`` over the pages that cover ``[start, stop)``."""
    first = start - start % _PAGE
    last = -(-stop // _PAGE) * _PAGE
    if _MADVISE is not None and last > first and _MADVISE(first, last - first, advice) != 0:
        logger.debug("madvise(%d) of %d bytes failed (errno %d)", advice, last - first, ctypes.get_errno())


def _file_mappings() -> list[tuple[int, int, bool]]:
    """``(start, stop, shared)`` of every file-backed mapping of this process, from `/proc/self/maps`."""
    mappings = []
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                fields = line.split(maxsplit=5)
                if len(fields) < 6 or not fields[5].startswith("/"):
                    continue  # anonymous memory, the heap, the stack
                start, stop = (int(x, 16) for x in fields[0].split("-"))
                mappings.append((start, stop, fields[1][3] == "s"))
    except OSError:
        return []
    return mappings


class MappedPages:
    """Hands back the resident pages of memory-mapped tensors once they have been used.

    The process's file mappings are read once, at construction: build one per pass over a set of tensors (a
    checksum, a comparison with a checkpoint) and call :meth:`release` on each tensor after reading it.

    Args:
        private (`bool`, defaults to `False`):
            Also reclaim the unchanged pages of private file mappings (a model `from_pretrained` mapped): worth it
            when the tensors will not be read again (their values moved elsewhere); otherwise the next read would
            fetch them from disk again, so by default only shared mappings (the disk tier) are released.
    """

    def __init__(self, private: bool = False):
        self.private = private
        self._mappings = _file_mappings() if _MADVISE is not None else []

    def release(self, tensors: torch.Tensor | Iterable[torch.Tensor]) -> None:
        """Take the pages of `tensors` that lie in file mappings out of the resident set (see the module docstring).

        Tensors on another device than the CPU and tensors in anonymous memory are left alone.
        """
        if not self._mappings:
            return
        for tensor in [tensors] if isinstance(tensors, torch.Tensor) else tensors:
            mapping = self._mapping(tensor)
            if mapping is not None and (mapping[2] or self.private):
                release_mapped(tensor, mapping[2])

    def release_mappings(self, tensors: Iterable[torch.Tensor]) -> int:
        """Take every page of the file mappings that hold `tensors` out of the resident set (private mappings only
        when `private`), not only the tensors' own pages.

        After `from_pretrained` has quantized a checkpoint it mapped, the mapping's pages of the weights it quantized
        belong to no tensor, yet stay resident for as long as the weights left unquantized (views of the same
        mapping) keep it alive; releasing the whole mapping hands them back, and the unquantized weights' pages come
        back from the file when next read.

        Returns:
            `int`: the bytes of the mappings released.
        """
        released = 0
        for start, stop, shared in {self._mapping(tensor) for tensor in tensors} - {None}:
            if shared or self.private:
                _advise(start, stop, _MADV_DONTNEED if shared else _MADV_PAGEOUT)
                released += stop - start
        return released

    def _mapping(self, tensor: torch.Tensor) -> tuple[int, int, bool] | None:
        """The file mapping `(start, stop, shared)` that holds `tensor`'s storage; `None` for a tensor on another
        device or in anonymous memory (torch's own allocations)."""
        if tensor.device.type != "cpu" or tensor.untyped_storage().resizable():
            return None
        address = tensor.untyped_storage().data_ptr()
        for mapping in self._mappings:
            if mapping[0] <= address < mapping[1]:
                return mapping
        return None


def release_mapped(tensor: torch.Tensor, shared: bool | None) -> None:
    """Take the pages of `tensor`'s storage out of the resident set: `shared` says whether it lies in a shared file
    mapping (dropped), a private one (reclaimed where unchanged), or neither (`None`: left alone)."""
    if shared is None or tensor.device.type != "cpu":
        return
    storage = tensor.untyped_storage()
    start = storage.data_ptr()
    _advise(start, start + storage.nbytes(), _MADV_DONTNEED if shared else _MADV_PAGEOUT)
