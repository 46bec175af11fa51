"""ZO-SGD (MeZO) and its momentum, sign and conservative variants."""

from __future__ import annotations

from abc import abstractmethod

import torch

from ..estimator import ZORecord
from ..noise import NoiseUpdate
from .base import ZOOptimizer, mean_projected_grads


class ZOSGD(ZOOptimizer):
    """ZO-SGD, the MeZO update: ``p <- (1 - lr * wd) * p - lr * mean_i(g_i * z_i)``.

    Stateless: the update is a sum of regenerable noise terms, so it is not applied now but composed into the
    pending move and fused with the next perturbation sweep (or applied by :meth:`flush`). Its only state is the
    step counter. Arguments are those of :class:`ZOOptimizer`.
    """

    def _apply_records(self, records: list[ZORecord]) -> None:
        lrs, wds = self.group_values("lr"), self.group_values("weight_decay")
        self.params.scale([1.0 - lr * wd for lr, wd in zip(lrs, wds)])
        for seed, weight in mean_projected_grads(records):
            self.params.add(seed, [-lr * weight for lr in lrs])


class _ChunkwiseZOOptimizer(ZOOptimizer):
    """A ZO optimizer with per-element state: one sweep that restores, regenerates ``g = mean_i(g_i z_i)`` chunk by
    chunk, and updates the state and the parameters."""

    state_keys: tuple[str, ...] = ()

    def _state_tensors(self, param: torch.Tensor) -> list[torch.Tensor]:
        state = self.state[param]
        for key in self.state_keys:
            if key not in state:
                state[key] = torch.zeros_like(param, memory_format=torch.contiguous_format)
        return [state[key].view(-1) for key in self.state_keys]

    def _begin_step(self) -> None:
        """Hook run once per step before the sweep (e.g. to advance bias-correction counters)."""

    @abstractmethod
    def _update_chunk(self, chunk: torch.Tensor, grad: torch.Tensor, state: list[torch.Tensor], group: dict) -> None:
        """Update one chunk of a parameter in place from its gradient chunk and its state chunks."""

    def _apply_records(self, records: list[ZORecord]) -> None:
        self._begin_step()
        pending = self.params.take_pending()
        weights = mean_projected_grads(records)
        tensors = self.params.tensors
        states = [self._state_tensors(p) for _, p in tensors]

        def visit(position, start, chunk, scratch):
            z, grad = scratch
            self._restore_and_average(chunk, z, grad, tensors[position][0], start, pending[position], weights)
            stop = start + chunk.numel()
            group = self.param_groups[self._group_of[position]]
            self._update_chunk(chunk, grad, [s[start:stop] for s in states[position]], group)

        self.noise.map_chunks(tensors, visit, num_scratch=2)

    def _restore_and_average(
        self,
        chunk: torch.Tensor,
        z: torch.Tensor,
        grad: torch.Tensor,
        index: int,
        start: int,
        update: NoiseUpdate,
        weights: list[tuple[int, float]],
    ) -> None:
        """Apply the pending `update` to `chunk` and write ``g = sum_i w_i z_i`` of the same elements into `grad`
        (`z` is scratch for the noise), for ``(seed_i, w_i)`` in `weights`."""
        self.noise.update_chunk_(chunk, z, index, start, update.decay, list(update.terms.items()))
        grad.zero_()
        self.noise.update_chunk_(grad, z, index, start, 1.0, weights)


class ZOSGDMomentum(_ChunkwiseZOOptimizer):
    """ZO-SGD with heavy-ball momentum: ``m <- beta * m + g``, ``p <- (1 - lr * wd) * p - lr * m``.

    State: one momentum buffer per parameter. Args as :class:`ZOOptimizer`, plus `momentum` (default 0.9).
    """

    state_keys = ("momentum_buffer",)
    group_hyperparameters = ("momentum",)

    def __init__(self, params, lr: float, momentum: float = 0.9, **kwargs):
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"momentum must be in [0, 1), got {momentum}.")
        super().__init__(params, lr, momentum=momentum, **kwargs)

    def _update_chunk(self, chunk, grad, state, group):
        (buffer,) = state
        buffer.mul_(group["momentum"]).add_(grad)
        if group["weight_decay"]:
            chunk.mul_(1.0 - group["lr"] * group["weight_decay"])
        chunk.add_(buffer.to(chunk.dtype), alpha=-group["lr"])


class ZOSGDSign(_ChunkwiseZOOptimizer):
    """ZO-SignSGD: ``p <- (1 - lr * wd) * p - lr * sign(g)``. Stateless apart from the step counter."""

    def _update_chunk(self, chunk, grad, state, group):
        if group["weight_decay"]:
            chunk.mul_(1.0 - group["lr"] * group["weight_decay"])
        chunk.add_(grad.sign_().to(chunk.dtype), alpha=-group["lr"])


class ZOSGDConservative(ZOOptimizer):
    """Conservative ZO-SGD: of the candidates ``theta``, ``theta - lr g z`` and ``theta + lr g z`` keep the one with
    the lowest loss on the step's last batch (three extra forwards per step, no state).

    Under gradient accumulation the last micro-batch's closure judges the candidates. If a candidate's forward
    raises (an error, an out-of-memory, a `KeyboardInterrupt`), the step is abandoned: the parameters are put back
    at ``theta`` (pending, as the "keep ``theta``" choice would leave them) and the exception propagates.
    """

    def _apply_records(self, records: list[ZORecord]) -> None:
        closure = self._last_closure
        lrs, wds = self.group_values("lr"), self.group_values("weight_decay")
        decays = [1.0 - lr * wd for lr, wd in zip(lrs, wds)]
        weights = mean_projected_grads(records)
        self.params.flush()
        loss_here = _loss(closure)
        side = 0.0  # where the parameters are: decay * theta + side * lr g z (theta itself while 0)
        try:
            self.params.scale(decays)
            self._add_direction(weights, lrs, -1.0)
            side = -1.0
            self.params.flush()
            loss_descent = _loss(closure)
            self._add_direction(weights, lrs, 2.0)
            side = 1.0
            self.params.flush()
            loss_ascent = _loss(closure)
        except BaseException:
            if side:
                self._back_to_theta(weights, lrs, decays, side)
            raise
        best = min(loss_here, loss_descent, loss_ascent)
        if best == loss_ascent:
            return
        if best == loss_descent:
            self._add_direction(weights, lrs, -2.0)
            return
        self._back_to_theta(weights, lrs, decays, side)

    def _back_to_theta(self, weights, lrs, decays, side: float) -> None:
        """Compose the move from ``decay * theta + side * lr g z`` back to ``theta`` into the pending update."""
        self._add_direction(weights, lrs, -side)
        self.params.scale([1.0 / d for d in decays])

    def _add_direction(self, weights, lrs, sign: float) -> None:
        for seed, weight in weights:
            self.params.add(seed, [sign * lr * weight for lr in lrs])


def _loss(closure) -> float:
    loss = closure()
    loss = float(loss.item()) if isinstance(loss, torch.Tensor) else float(loss)
    return loss if loss == loss else float("inf")
