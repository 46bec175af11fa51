"""Build and load the compiled CPU kernel (``philox.cpp``) with `torch.utils.cpp_extension`.

The kernel is compiled once per machine and torch version, just in time, with the system's C++ compiler and ninja,
into torch's extension cache (``$TORCH_EXTENSIONS_DIR``, by default ``~/.cache/torch_extensions``); later processes
load the cached library in milliseconds. ``make install`` builds it (``python -m hf_zo.philox --build``), so that
training never waits for the compiler. If it cannot be built or loaded, :func:`load_kernel` logs one warning and
returns `None`; `hf_zo.noise` then warns once and falls back (see `resolve_noise_algorithm`).
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from types import ModuleType

KERNEL_NAME = "hf_zo_philox_v1"
"""Name of the compiled module (the version suffix changes whenever the noise it computes changes)."""

SOURCE = Path(__file__).with_name("philox.cpp")

COMPILE_FLAGS = ["-O3", "-ffp-contract=off", "-fno-math-errno"]
"""``-ffp-contract=off``: no fused multiply-add, so each float operation rounds once, as in the torch reference."""

GCC_SCHEDULING_FLAGS = ["-fschedule-insns", "-fsched-pressure"]
"""Added when the compiler is GCC: its pre-register-allocation scheduler, off by default on x86, interleaves the
independent dependency chains of Philox and Box-Muller (10-20% faster; it reorders instructions, never changes a
result). Clang runs its own scheduler before allocation by default and does not know these flags."""

_lock = threading.Lock()
_kernel: ModuleType | None = None
_error: str | None = None


def load_kernel() -> ModuleType | None:
    """The compiled kernel, built on first use; `None` if it cannot be built (:func:`kernel_error` says why).

    Returns:
        `ModuleType` or `None`: the module, with ``fill(out, seed, index, start, gaussian)``,
        ``apply(tensors, indices, decays, seeds, coeffs, gaussian)`` and ``simd()`` (``"avx512"``, ``"avx2"`` or
        ``"portable"``: which code runs on this CPU).
    """
    global _kernel, _error
    if _kernel is not None or _error is not None:
        return _kernel
    with _lock:
        if _kernel is None and _error is None:
            try:
                _kernel = _build(verbose=False)
            except Exception as error:  # any failure (no compiler, no ninja, bad headers) means: use the fallback
                lines = str(error).strip().splitlines()
                _error = f"{type(error).__name__}: {lines[-1] if lines else ''}"
    return _kernel


def kernel_error() -> str | None:
    """Why the compiled kernel is unavailable, or `None` if it loaded (or was not tried yet)."""
    return _error


def _build(verbose: bool) -> ModuleType:
    from torch.utils import cpp_extension

    _put_ninja_on_path()
    flags = list(COMPILE_FLAGS)
    if cpp_extension.check_compiler_is_gcc(cpp_extension.get_cxx_compiler()):
        flags += GCC_SCHEDULING_FLAGS
    return cpp_extension.load(
        name=KERNEL_NAME, sources=[str(SOURCE)], extra_cflags=flags, verbose=verbose, with_cuda=False
    )


def _put_ninja_on_path() -> None:
    """Let torch find the ninja of the `ninja` package, which lives next to the interpreter, not on ``PATH``."""
    try:
        import ninja
    except ImportError:
        return
    bin_dir = getattr(ninja, "BIN_DIR", None)
    if bin_dir and bin_dir not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = bin_dir + os.pathsep + os.environ.get("PATH", "")


def build(verbose: bool = True) -> float:
    """Build (or load from the cache) the compiled kernel now, raising on failure.

    Returns:
        `float`: seconds it took.
    """
    global _kernel, _error
    start = time.perf_counter()
    kernel = _build(verbose=verbose)
    with _lock:
        _kernel, _error = kernel, None
    return time.perf_counter() - start
