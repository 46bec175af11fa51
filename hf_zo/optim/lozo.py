"""LOZO: zeroth-order SGD with low-rank perturbations (Chen et al., 2024, arXiv 2410.07698).

The perturbation of a weight matrix ``W`` of shape ``(m, n)`` is ``Z = U V^T / sqrt(r)`` with ``U`` of shape
``(m, r)`` and ``V`` of shape ``(n, r)`` drawn from the noise distribution; ``V`` is kept for `subspace_steps`
consecutive steps (LOZO's lazy sampling), so the updates of those steps stay in one column space, the way a
LoRA adapter's do. Vectors (biases, norm weights) keep the full-rank noise. The ``1 / sqrt(r)`` keeps every element
at unit variance, so eps and learning rate mean what they mean for MeZO, and ``E[z z^T] = I`` over ``U`` and ``V``.

Why LOZO and not Sparse MeZO: a low-rank ``Z`` is still a pure function of ``(seed, parameter index)``, so it is
counter-based noise, and the update is still ``sum_i coeff_i * z(seed_i)``. Everything that relies on that (fused
sweeps, replay of a trajectory, exact resume, scalar-only distributed traffic, offload) works unchanged. Sparse
MeZO's mask is chosen from the current weights' magnitudes, so its noise depends on the weights and every one of
those mechanisms would need the mask too.
"""

from __future__ import annotations

import math

import torch

from ..noise import Noise, mix_seed
from .sgd import ZOSGD

SUBSPACE_SHIFT = 32
"""A LOZO seed is ``(subspace seed << SUBSPACE_SHIFT) | step seed``: the seed of ``V`` travels inside every seed."""

_U_STREAM, _V_STREAM = 0x55, 0x56  # distinct streams of one parameter's noise for U and V


class LowRankNoise(Noise):
    """Noise whose value on a matrix parameter is ``U V^T / sqrt(rank)`` (see the module docstring).

    Generation only: sweeps, caching and chunking are those of :class:`~hf_zo.noise.Noise`. ``U`` is keyed by the
    whole seed and ``V`` by its high bits (the subspace seed), both through :meth:`Noise.fill_`, so they follow the
    base noise's distribution and its counter-based keying.

    Args:
        rank (`int`): rank `r` of the matrix perturbations.
        shapes (`dict[int, tuple[int, ...]]`): shape of each parameter, by noise index (set by the optimizer).
        **kwargs: the :class:`~hf_zo.noise.Noise` arguments (`distribution` is `"gaussian"` or `"rademacher"`).
    """

    def __init__(self, rank: int, shapes: dict[int, tuple[int, ...]] | None = None, **kwargs):
        super().__init__(**kwargs)
        if self.distribution == "table":
            raise ValueError(
                "LOZO draws its factors U and V per parameter; zo_noise='table' serves fixed-size slices of one table "
                "instead. Use zo_noise='gaussian' or 'rademacher' with zo_optimizer='lozo'."
            )
        self.rank = rank
        self.shapes = dict(shapes or {})

    def fill_(self, out: torch.Tensor, seed: int, index: int, start: int) -> torch.Tensor:
        """Write ``z[start : start + out.numel()]`` of parameter `index` (flattened row-major) into `out`."""
        shape = self.shapes.get(index)
        if shape is None or len(shape) < 2 or min(shape[0], math.prod(shape[1:])) <= self.rank:
            return super().fill_(out, seed, index, start)
        rows, cols = shape[0], math.prod(shape[1:])
        first, last = start // cols, (start + out.numel() - 1) // cols
        factor_u = torch.empty(rows * self.rank, dtype=torch.float32, device=out.device)
        factor_v = torch.empty(cols * self.rank, dtype=torch.float32, device=out.device)
        super().fill_(factor_u, mix_seed(seed, _U_STREAM), index, 0)
        super().fill_(factor_v, mix_seed(seed >> SUBSPACE_SHIFT, _V_STREAM), index, 0)
        block = factor_u.view(rows, self.rank)[first : last + 1] @ factor_v.view(cols, self.rank).T
        offset = start - first * cols
        out.copy_(block.view(-1)[offset : offset + out.numel()]).mul_(1.0 / math.sqrt(self.rank))
        return out


class LOZO(ZOSGD, name="lozo"):
    """ZO-SGD (MeZO's update) with LOZO's low-rank perturbations: ``p <- (1 - lr * wd) * p - lr * mean_i(g_i z_i)``
    where every matrix's ``z_i`` has rank `rank` and shares its right factor with the steps of its subspace period.

    Stateless like :class:`~hf_zo.optim.ZOSGD` (its update is fused into the next sweep); its noise is a
    :class:`LowRankNoise`. Args as :class:`~hf_zo.optim.ZOOptimizer`, plus:

    Args:
        rank (`int`, defaults to 2): rank of each matrix perturbation (LOZO uses 2 for OPT models).
        subspace_steps (`int`, defaults to 50): steps that share the right factor ``V`` (LOZO's `nu`).
    """

    group_hyperparameters = ("rank", "subspace_steps")
    supports_offload = False  # only ZO-SGD's plain noise is run with offloaded blocks
    supports_fsdp = False  # its noise is shaped by the whole weight matrix, not by element ranges
    supported_noise = ("gaussian", "rademacher")
    limitations = {"noise": "draws low-rank factors per weight matrix"}

    @classmethod
    def config_kwargs(cls, args) -> dict:
        """`rank` from `zo_lozo_rank`, `subspace_steps` from `zo_lozo_subspace_steps`."""
        return {"rank": args.zo_lozo_rank, "subspace_steps": args.zo_lozo_subspace_steps}

    def __init__(self, params, lr: float, rank: int = 2, subspace_steps: int = 50, noise="gaussian", **kwargs):
        if not isinstance(rank, int) or rank < 1:
            raise ValueError(f"rank must be an integer >= 1, got {rank!r}.")
        if not isinstance(subspace_steps, int) or subspace_steps < 1:
            raise ValueError(f"subspace_steps must be an integer >= 1, got {subspace_steps!r}.")
        if not isinstance(noise, Noise):
            noise = Noise(noise)
        low_rank = LowRankNoise.like(noise, rank)
        super().__init__(params, lr, noise=low_rank, rank=rank, subspace_steps=subspace_steps, **kwargs)

    def _build_parameters(self) -> None:
        super()._build_parameters()
        self.noise.shapes = {index: tuple(tensor.shape) for index, tensor in self.params.tensors}

    def perturbation_seed(self, step: int, k: int) -> int:
        """The seed of MeZO's perturbation `k` of `step`, with the seed of the step's subspace in its high bits."""
        subspace = mix_seed(self.seed, step // self.defaults["subspace_steps"]) & ((1 << (63 - SUBSPACE_SHIFT)) - 1)
        return subspace << SUBSPACE_SHIFT | mix_seed(self.seed, step, k) & ((1 << SUBSPACE_SHIFT) - 1)
