"""The Philox-4x32-10 + Box-Muller noise in torch operations, on any device.

This computes, operation for operation, what ``philox.cpp`` computes, so the two agree bit for bit: it is the test
reference of the compiled kernel, and the implementation used on devices other than the CPU (and on the CPU when the
kernel cannot be built). Integers are held in int64 tensors (32-bit words, products split so that nothing
overflows); floats are float32 and every operation rounds once to the nearest float, as IEEE add, multiply and sqrt do.

The layout of the noise of one parameter: Philox block ``b`` (counter ``(b mod 2^32, b >> 32, index mod 2^32,
index >> 32)``, key ``(seed mod 2^32, seed >> 32)``) gives four words; the blocks come in tiles of
:data:`TILE_BLOCKS`, and word ``k`` of block ``TILE_BLOCKS * t + i`` gives element ``TILE_NUMEL * t + TILE_BLOCKS * k +
i``. Gaussian: words 0 and 1 are one Box-Muller pair (elements ``k = 0, 1``: ``r cos``, ``r sin``), words 2 and 3
another; Rademacher: the sign bit of each word.
"""

from __future__ import annotations

import math

import torch

TILE_BLOCKS = 256
"""Philox blocks per tile of the element layout (fixed: changing it changes every ``z``)."""

TILE_NUMEL = 4 * TILE_BLOCKS
"""Noise elements per tile."""

ROUNDS = 10
_MUL = (0xD2511F53, 0xCD9E8D57)
_WEYL = (0x9E3779B9, 0xBB67AE85)
_MASK32 = 0xFFFFFFFF

# Cephes' single-precision logf and sinf/cosf coefficients (rounded from double to float, as the C++ does).
_LOG_POLY = (
    7.0376836292e-2,
    -1.1514610310e-1,
    1.1676998740e-1,
    -1.2420140846e-1,
    1.4249322787e-1,
    -1.6668057665e-1,
    2.0000714765e-1,
    -2.4999993993e-1,
    3.3333331174e-1,
)
_LN2_LOW, _LN2_HIGH = -2.12194440e-4, 0.693359375
_SQRT_HALF = 0.70710678118654752440
_SIN_POLY = (-1.9515295891e-4, 8.3321608736e-3, -1.6666654611e-1)
_COS_POLY = (2.443315711809948e-5, -1.388731625493765e-3, 4.166664568298827e-2)
_ANGLE_STEP = 2 * math.pi / 2**24


def _mul_hi_lo(multiplier: int, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """High and low 32-bit words of ``multiplier * x`` for 32-bit `x`, without int64 overflow."""
    low_part = x * (multiplier & 0xFFFF)  # < 2^48
    high_part = x * (multiplier >> 16)  # < 2^48, to be shifted left by 16
    total = low_part + ((high_part & 0xFFFF) << 16)
    return ((total >> 32) + (high_part >> 16)) & _MASK32, total & _MASK32


def philox4x32_10(counter: tuple[torch.Tensor, ...], key: tuple[int, int]) -> tuple[torch.Tensor, ...]:
    """Philox-4x32-10 (Salmon et al., SC'11) of the four counter words (int64 tensors of 32-bit values) under `key`.

    Returns:
        `tuple[torch.Tensor, ...]`: the four output words, int64 tensors of 32-bit values.
    """
    c0, c1, c2, c3 = counter
    k0, k1 = key
    for _ in range(ROUNDS):
        hi0, lo0 = _mul_hi_lo(_MUL[0], c0)
        hi1, lo1 = _mul_hi_lo(_MUL[1], c2)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
        k0, k1 = (k0 + _WEYL[0]) & _MASK32, (k1 + _WEYL[1]) & _MASK32
    return c0, c1, c2, c3


def _float(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.float32)


def box_muller_radius(word: torch.Tensor) -> torch.Tensor:
    """``sqrt(-2 log u)`` for ``u = ((word >> 8) + 1) / 2^24``: an exact frexp, then Cephes' logf polynomial."""
    u = _float((word >> 8) + 1) * 2.0**-24
    bits = u.view(torch.int32)
    exponent = (bits >> 23) - 126
    mantissa = ((bits & 0x007FFFFF) | 0x3F000000).view(torch.float32)
    low = (mantissa < _SQRT_HALF).to(torch.int32)
    exponent = exponent - low
    x = mantissa * _float(1 + low) - 1.0
    z = x * x
    y = torch.full_like(x, _LOG_POLY[0])
    for coefficient in _LOG_POLY[1:]:
        y = y * x + coefficient
    y = (y * x) * z
    e = _float(exponent)
    y = y + e * _LN2_LOW
    y = y - z * 0.5
    log_u = x + y
    log_u = log_u + e * _LN2_HIGH
    # In float64 and rounded once: the exact float sqrt (torch's float32 sqrt on the CPU is not correctly rounded).
    return torch.sqrt((log_u * -2.0).double()).float()


def box_muller_angle(word: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos, sin)`` of ``2 pi t / 2^24`` for ``t = word >> 8``: exact reduction to the nearest quarter turn, then
    Cephes' sinf/cosf polynomials."""
    t = word >> 8
    quarter = (t + (1 << 21)) >> 22
    theta = _float(t - (quarter << 22)) * _ANGLE_STEP
    z = theta * theta
    s = (((z * _SIN_POLY[0] + _SIN_POLY[1]) * z + _SIN_POLY[2]) * z) * theta + theta
    c = ((((z * _COS_POLY[0] + _COS_POLY[1]) * z + _COS_POLY[2]) * z) * z - z * 0.5) + 1.0
    q = quarter & 3
    swap = (q & 1).bool()
    cosine, sine = torch.where(swap, s, c), torch.where(swap, c, s)
    cosine = torch.where((q == 1) | (q == 2), -cosine, cosine)
    sine = torch.where(q >= 2, -sine, sine)
    return cosine, sine


def philox_noise(
    seed: int, index: int, start: int, numel: int, gaussian: bool = True, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """Elements ``[start, start + numel)`` of the noise of parameter `index` for `seed`, as a float32 vector.

    Args:
        seed (`int`): the perturbation seed (64 bits).
        index (`int`): the parameter's stable noise index.
        start (`int`): the first element.
        numel (`int`): how many elements.
        gaussian (`bool`, defaults to `True`): standard normal if `True`, else Rademacher (+1/-1).
        device (`torch.device` or `str`, defaults to `"cpu"`): where to compute.

    Returns:
        `torch.Tensor`: float32 vector of `numel` elements on `device`.
    """
    if numel == 0:
        return torch.empty(0, dtype=torch.float32, device=device)
    first_tile, last_tile = start // TILE_NUMEL, (start + numel - 1) // TILE_NUMEL
    blocks = torch.arange(first_tile * TILE_BLOCKS, (last_tile + 1) * TILE_BLOCKS, dtype=torch.int64, device=device)
    counter = (
        blocks & _MASK32,
        blocks >> 32,
        torch.full_like(blocks, index & _MASK32),
        torch.full_like(blocks, (index >> 32) & _MASK32),
    )
    words = philox4x32_10(counter, (seed & _MASK32, (seed >> 32) & _MASK32))
    if gaussian:
        r0, r1 = box_muller_radius(words[0]), box_muller_radius(words[2])
        cos0, sin0 = box_muller_angle(words[1])
        cos1, sin1 = box_muller_angle(words[3])
        outputs = (r0 * cos0, r0 * sin0, r1 * cos1, r1 * sin1)
    else:
        outputs = tuple(1.0 - _float(word >> 31) * 2.0 for word in words)
    tiles = torch.stack([o.view(-1, TILE_BLOCKS) for o in outputs], dim=1).view(-1)
    offset = start - first_tile * TILE_NUMEL
    return tiles[offset : offset + numel].contiguous()
