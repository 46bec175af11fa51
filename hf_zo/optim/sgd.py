"""ZO-SGD (MeZO) and its momentum, sign and conservative variants."""

from __future__ import annotations

import torch

from ..estimator import ZORecord
from .base import ZOOptimizer, mean_projected_grads
from .chunkwise import ChunkwiseZOOptimizer


class ZOSGD(ZOOptimizer, name="zo_sgd"):
    """ZO-SGD, the MeZO update: ``p <- (1 - lr * wd) * p - lr * mean_i(g_i * z_i)``.

    Stateless: the update is a sum of regenerable noise terms, so it is not applied now but composed into the
    pending move and fused with the next perturbation sweep (or applied by :meth:`flush`). Its only state is the
    step counter. Arguments are those of :class:`ZOOptimizer`.
    """

    stateless = True
    supports_offload = True
    supports_fsdp = True

    def _apply_records(self, records: list[ZORecord]) -> None:
        lrs, wds = self.group_values("lr"), self.group_values("weight_decay")
        self.params.scale([1.0 - lr * wd for lr, wd in zip(lrs, wds)])
        for seed, weight in mean_projected_grads(records):
            self.params.add(seed, [-lr * weight for lr in lrs])


class ZOSGDMomentum(ChunkwiseZOOptimizer, name="zo_sgd_momentum"):
    """ZO-SGD with heavy-ball momentum: ``m <- beta * m + g``, ``p <- (1 - lr * wd) * p - lr * m``.

    State: one momentum buffer per parameter. Args as :class:`ZOOptimizer`, plus `momentum` (default 0.9).
    """

    state_keys = ("momentum_buffer",)
    group_hyperparameters = ("momentum",)

    @classmethod
    def config_kwargs(cls, args) -> dict:
        """`momentum` from `zo_momentum`."""
        return {"momentum": args.zo_momentum}

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


class ZOSGDSign(ChunkwiseZOOptimizer, name="zo_sgd_sign"):
    """ZO-SignSGD: ``p <- (1 - lr * wd) * p - lr * sign(g)``. Stateless apart from the step counter."""

    stateless = True

    def _update_chunk(self, chunk, grad, state, group):
        if group["weight_decay"]:
            chunk.mul_(1.0 - group["lr"] * group["weight_decay"])
        chunk.add_(grad.sign_().to(chunk.dtype), alpha=-group["lr"])


class ZOSGDConservative(ZOOptimizer, name="zo_sgd_cons"):
    """Conservative ZO-SGD: of the candidates ``theta``, ``theta - lr g z`` and ``theta + lr g z`` keep the one with
    the lowest loss on the step's last batch (three extra forwards per step, no state).

    Under gradient accumulation the last micro-batch's closure judges the candidates. If a candidate's forward
    raises (an error, an out-of-memory, a `KeyboardInterrupt`), the step is abandoned: the parameters are put back
    at ``theta`` (pending, as the "keep ``theta``" choice would leave them) and the exception propagates.
    """

    supports_data_parallel = False
    replayable = False
    limitations = {
        "data_parallel": "zo_sgd_cons chooses its update from the loss on each rank's own last batch",
        "replay": "picks each update by comparing the training loss at three candidate weights, and a trajectory "
        "does not record which one won; train with zo_sgd for a replayable run",
    }

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
