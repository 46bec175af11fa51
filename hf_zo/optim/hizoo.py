"""HiZOO: zeroth-order SGD with a Hessian-informed diagonal preconditioner (Zhao et al., ICLR 2025, arXiv 2402.15173).

Each trainable tensor keeps a diagonal curvature estimate ``H`` (fp32, same shape, initialised to ones). The
perturbation of an estimate with seed ``s`` is ``u = z(s) / sqrt(H)``: small along the directions the loss curves
most. Each estimate runs three forwards on one batch, the loss at ``theta`` first (``L0``), then ``L+`` and ``L-`` at
``theta +- eps * u``; its record carries ``g = (L+ - L-) / (2 eps)`` and the curvature
``c = |L+ + L- - 2 L0| / (2 eps^2)`` along ``u``. A step over the records ``i = 1..n`` then does, element-wise::

    theta <- (1 - lr * wd) * theta - lr * mean_i(g_i * u_i)
    H     <- max(H * (1 - alpha + alpha * mean_i(c_i * z_i ** 2)), HESSIAN_FLOOR)

with ``alpha`` the smoothing `hessian_smooth`. This is the reference code's
``H <- (1 - alpha) * H + alpha * c * H * z ** 2``, averaged over the step's records like MeZO's update.

One deviation from the reference code: there the parameter update divides ``z`` by the square root of the *updated*
``H``; here it uses ``u_i``, the perturbation the losses were measured along, i.e. the ``H`` from before this step's
update. That keeps ``g_i * u_i`` the estimate it is (the directional derivative times its direction), and the restore
after the two perturbed forwards exact (it subtracts the very ``u_i`` that was added).

``u`` is still a pure function of the seed, the parameter's index and the state ``H``, so resume (``H`` is in the
optimizer state) and replay (a trajectory records each estimate's curvature, from which replay rebuilds ``H``) stay
bitwise. ``H`` changes at every step, so the update cannot wait in the pending move: it is applied in one sweep per
step, like ZO-Adam's. Cost: three forwards per estimate (1.5x MeZO's) and one fp32 tensor of state per trainable
tensor.
"""

from __future__ import annotations

import torch

from ..estimator import ZORecord
from ..noise import Noise
from .base import mean_projected_grads
from .chunkwise import ChunkwiseZOOptimizer

DEFAULT_HESSIAN_SMOOTH = 1e-6
"""Default smoothing `alpha` of the curvature estimate (see :class:`HiZOO`)."""

HESSIAN_FLOOR = 1e-8
"""Lower bound of ``H``, so that ``1 / sqrt(H)`` stays finite when the measured curvature is zero for a long time
(``H`` then shrinks by ``1 - alpha`` per step)."""


class PreconditionedNoise(Noise):
    """Noise whose value on parameter `index` is ``z / sqrt(H)``, with ``H`` the parameter's entry in `hessians`.

    Generation only: sweeps, chunking and caching are those of :class:`~hf_zo.noise.Noise` (a parameter without an
    entry gets plain ``z``). Call :meth:`forget_cached` whenever ``H`` changes, so that no sweep reuses noise scaled by
    an older ``H``.

    Args:
        **kwargs: the :class:`~hf_zo.noise.Noise` arguments (`distribution` is `"gaussian"` or `"rademacher"`).
    """

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        if self.distribution == "table":
            raise ValueError(
                "HiZOO scales the noise element by element through Noise.fill_, which zo_noise='table' bypasses (it "
                "serves views of one shared table). Use zo_noise='gaussian' or 'rademacher' with zo_optimizer='hizoo'."
            )
        self.hessians: dict[int, torch.Tensor] = {}

    def fill_(self, out: torch.Tensor, seed: int, index: int, start: int) -> torch.Tensor:
        """Write ``u[start : start + out.numel()] = z / sqrt(H)`` of parameter `index` (flattened) into `out`."""
        super().fill_(out, seed, index, start)
        hessian = self.hessians.get(index)
        if hessian is not None:
            out.div_(hessian[start : start + out.numel()].sqrt())
        return out

    def forget_cached(self) -> None:
        """Drop the cached noise (computed with the ``H`` of its time)."""
        self._cache.clear()


class HiZOO(ChunkwiseZOOptimizer, name="hizoo"):
    """HiZOO: MeZO's update along perturbations preconditioned by a diagonal curvature estimate ``H`` (see the module
    docstring for the exact update).

    State: ``H`` (`"hessian"`, fp32) per parameter. Three forwards per estimate. Args as
    :class:`~hf_zo.optim.ZOOptimizer` (`noise` is `"gaussian"` or `"rademacher"`), plus:

    Args:
        hessian_smooth (`float`, defaults to `DEFAULT_HESSIAN_SMOOTH`):
            Smoothing `alpha` in ``[0, 1)`` of the curvature estimate; 0 keeps ``H = 1`` (MeZO's update with a third
            forward). The paper tunes it per task between 1e-9 and 1e-6.
    """

    needs_center_loss = True
    supports_dual_engine = False
    supports_perturbation_parallel = False
    supported_noise = ("gaussian", "rademacher")
    limitations = {
        "dual_engine": "needs three forwards on the same weights per estimate (the loss at theta, then at "
        "theta +- eps * u)",
        "perturbation_parallel": "HiZOO measures the loss at the unperturbed weights before each two-point estimate",
        "noise": "scales the noise element by element",
    }
    state_keys = ("hessian",)
    group_hyperparameters = ("hessian_smooth",)

    @classmethod
    def config_kwargs(cls, args) -> dict:
        """`hessian_smooth` from `zo_hizoo_smooth`."""
        return {"hessian_smooth": args.zo_hizoo_smooth}

    def __init__(self, params, lr: float, hessian_smooth: float = DEFAULT_HESSIAN_SMOOTH, noise="gaussian", **kwargs):
        if not (isinstance(hessian_smooth, (int, float)) and 0.0 <= hessian_smooth < 1.0):
            raise ValueError(f"hessian_smooth must be in [0, 1), got {hessian_smooth!r}; the paper uses 1e-9 to 1e-6.")
        if not isinstance(noise, Noise):
            noise = Noise(noise)
        preconditioned = PreconditionedNoise.like(noise)
        super().__init__(params, lr, noise=preconditioned, hessian_smooth=float(hessian_smooth), **kwargs)

    def _build_parameters(self) -> None:
        super()._build_parameters()
        self._bind_hessians()

    def _bind_hessians(self) -> None:
        """Point the noise at the current ``H`` tensors (created as ones if missing)."""
        self.noise.hessians = {index: self._state_tensors(p)[0] for index, p in self.params.tensors}
        self.noise.forget_cached()

    def _state_tensors(self, param: torch.Tensor) -> list[torch.Tensor]:
        state = self.state[param]
        if "hessian" not in state:
            state["hessian"] = torch.ones_like(param, dtype=torch.float32, memory_format=torch.contiguous_format)
        return [state["hessian"].view(-1)]

    def _apply_records(self, records: list[ZORecord]) -> None:
        missing = [r.seed for r in records if r.curvature is None]
        if missing:
            raise ValueError(
                f"HiZOO updates H from each record's curvature, but {len(missing)} of the step's records have none "
                "(they were built without the loss at theta); estimate with this optimizer's estimate() or step()."
            )
        pending = self.params.take_pending()
        weights = mean_projected_grads(records)
        curvatures = [(r.seed, r.curvature / len(records)) for r in records]
        tensors = self.params.tensors
        hessians = [self._state_tensors(p)[0] for _, p in tensors]
        noise = self.noise

        def visit(position, start, chunk, scratch):
            z, grad, curvature = scratch
            index = tensors[position][0]
            self._restore_and_average(chunk, z, grad, index, start, pending[position], weights)
            hessian = hessians[position][start : start + chunk.numel()]
            # mean_i(c_i z_i^2) = H * mean_i(c_i u_i^2), from the u_i the restore and the average just used: read
            # from the noise cache when it is on (LoRA-sized sets), regenerated once more per chunk when it is off.
            curvature.zero_()
            for seed, weight in curvatures:
                u = noise.chunk(z, seed, index, start)
                curvature.addcmul_(u, u, value=weight)
            curvature.mul_(hessian)
            group = self.param_groups[self._group_of[position]]
            self._update_chunk(chunk, grad, [hessian], group)
            smooth = group["hessian_smooth"]
            hessian.mul_(curvature.mul_(smooth).add_(1.0 - smooth)).clamp_min_(HESSIAN_FLOOR)

        noise.map_chunks(tensors, visit, num_scratch=3)
        noise.forget_cached()

    def _update_chunk(self, chunk, grad, state, group):
        """``theta <- (1 - lr * wd) * theta - lr * g`` with ``g = mean_i(g_i u_i)`` (``H`` is updated after)."""
        if group["weight_decay"]:
            chunk.mul_(1.0 - group["lr"] * group["weight_decay"])
        chunk.add_(grad.to(chunk.dtype), alpha=-group["lr"])

    def load_state_dict(self, state_dict: dict) -> None:
        """Restore a state saved by :meth:`state_dict`, keeping ``H`` in fp32 (`torch.optim` would cast it to the
        parameters' dtype)."""
        super().load_state_dict(state_dict)
        saved_ids = [i for group in state_dict["param_groups"] for i in group["params"]]
        params = [p for group in self.param_groups for p in group["params"]]
        for saved_id, param in zip(saved_ids, params):
            saved = state_dict["state"].get(saved_id, {}).get("hessian")
            if saved is not None:
                self.state[param]["hessian"] = saved.to(device=param.device, dtype=torch.float32, copy=True)
        self._bind_hessians()
