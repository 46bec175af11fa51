"""Philox-4x32-10 + Box-Muller counter-based noise: a compiled CPU kernel and the same algorithm in torch operations.

`hf_zo.noise` uses it for ``algorithm="philox"``: :func:`load_kernel` gives the compiled kernel (or `None` when it
cannot be built), :func:`philox_noise` the torch implementation, bit-identical, used on other devices and as the
fallback.
"""

from .extension import build, kernel_error, load_kernel
from .reference import philox4x32_10, philox_noise

__all__ = ["build", "kernel_error", "load_kernel", "philox4x32_10", "philox_noise"]
