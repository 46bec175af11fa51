"""Handing the memory that Python's allocator keeps after frees back to the operating system."""

from __future__ import annotations

import ctypes
import logging
import sys

logger = logging.getLogger(__name__)

__all__ = ["return_freed_memory"]


def return_freed_memory() -> None:
    """Return the heap's free memory to the operating system (glibc's `malloc_trim`), so that resident memory
    measures live tensors rather than the allocator's cache. Elsewhere (another C library, another system) the
    freed memory stays with the allocator, which only affects what resident memory shows."""
    if not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        logger.debug("malloc_trim is unavailable; freed memory stays with the allocator.")
