"""Two-point (SPSA) zeroth-order gradient estimates over a set of parameters and a loss closure.

The parameters are moved lazily: every move is composed into a pending :class:`~hf_zo.noise.NoiseUpdate` and only
applied by the next sweep, so that the restore after the second forward, the optimizer's update and the next
perturbation all share one pass over memory.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor

from .noise import Noise, NoiseUpdate

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ZORecord:
    """One two-point estimate: the update direction is ``z(seed)`` scaled by `projected_grad`.

    Attributes:
        seed (`int`): seed of the perturbation noise.
        projected_grad (`float`): ``(loss_plus - loss_minus) / (2 * eps)``, the directional derivative along ``z``.
        loss_plus (`float`): loss at ``theta + eps * z``.
        loss_minus (`float`): loss at ``theta - eps * z``.
        curvature (`float`, *optional*):
            ``|loss_plus + loss_minus - 2 * loss_center| / (2 * eps**2)``, the (absolute, halved) second directional
            derivative along ``z``, when the loss at ``theta`` itself was measured (HiZOO); else `None`.
    """

    seed: int
    projected_grad: float
    loss_plus: float
    loss_minus: float
    curvature: float | None = None

    @property
    def loss(self) -> float:
        """Mean of the two perturbed losses: the loss that is logged."""
        return 0.5 * (self.loss_plus + self.loss_minus)


def _drop_stale_casts() -> None:
    """Forget autocast's cached low-precision copies of the weights after moving them in place.

    Inside one `torch.autocast` region (a loop that wraps `optimizer.step` in it) autocast casts each trainable
    weight once and reuses the cast until the region ends, so a forward after a sweep would read the weights as they
    were before it: the ``-eps`` forward would see the ``+eps`` weights.
    """
    torch.clear_autocast_cache()


class LazyParameters:
    """Trainable tensors, each with its stable noise index, and the update still pending on them.

    Sharded tensors (`DTensor`s, FSDP2's parameters) are swept differently. The processes of an FSDP2 run take turns
    at the forwards of their own micro-batches, each at its own point of the step's sequence of sweeps, while a
    forward gathers every process's shard: so a sweep is held back (:attr:`held_back`) instead of applied, each
    gathered tensor is brought to this process's point just before its forward (:meth:`replay_onto`), and the
    shards take the held-back sweeps at the next point where every process has made them all (:meth:`commit`).

    Args:
        tensors (`Sequence[tuple[int, torch.Tensor]]`): ``(index, tensor)`` pairs; indices must be unique.
        noise (`Noise`): the noise that sweeps use.

    Attributes:
        sharded (`bool`): whether some tensor is a `DTensor`, so sweeps are held back.
        held_back (`list[list[NoiseUpdate]]`): the sweeps made since the last :meth:`commit`, in order, one
            update per tensor each (only while :attr:`sharded`).
    """

    def __init__(self, tensors: Sequence[tuple[int, torch.Tensor]], noise: Noise):
        indices = [index for index, _ in tensors]
        if len(set(indices)) != len(indices):
            raise ValueError(f"Parameter noise indices must be unique, got {indices}.")
        self.tensors = list(tensors)
        self.noise = noise
        self.pending = [NoiseUpdate() for _ in self.tensors]
        self.sharded = any(isinstance(tensor, DTensor) for _, tensor in self.tensors)
        self.held_back: list[list[NoiseUpdate]] = []

    def __len__(self) -> int:
        return len(self.tensors)

    def scale(self, factors: Sequence[float]) -> None:
        """Compose ``p <- factor * p`` (one factor per tensor) into the pending update."""
        for update, factor in zip(self.pending, factors):
            update.scale(factor)

    def add(self, seed: int, coeffs: float | Sequence[float]) -> None:
        """Compose ``p <- p + coeff * z(seed)`` (a scalar or one coefficient per tensor) into the pending update."""
        if isinstance(coeffs, (int, float)):
            coeffs = [coeffs] * len(self.pending)
        for update, coeff in zip(self.pending, coeffs):
            update.add(seed, coeff)

    def take_pending(self) -> list[NoiseUpdate]:
        """Return the pending updates and forget them (the caller applies them)."""
        pending, self.pending = self.pending, [NoiseUpdate() for _ in self.tensors]
        return pending

    def has_pending(self) -> bool:
        """Whether any tensor has an update that has not been applied yet."""
        return any(not u.is_identity() for u in self.pending)

    @torch.no_grad()
    def flush(self) -> None:
        """Apply everything pending, so the tensors hold their true values (before eval, save, or end); sharded
        tensors hold it back until :meth:`commit`, and their forwards see it (:meth:`replay_onto`)."""
        pending = self.take_pending()
        if not self.sharded:
            self.noise.apply_(self.tensors, pending)
        elif any(not update.is_identity() for update in pending):
            self.held_back.append(pending)
        _drop_stale_casts()

    @torch.no_grad()
    def commit(self) -> None:
        """Apply the held-back sweeps to this process's shards, in order: the bits one process gives those elements.

        Call it only where every process has made the same sweeps (the end of a micro-batch's estimates on every
        rank, an optimizer flush), since the next forward gathers every shard.
        """
        held_back, self.held_back = self.held_back, []
        for updates in held_back:
            self.noise.apply_(self.tensors, updates)

    @torch.no_grad()
    def replay_onto(self, position: int, tensor: torch.Tensor) -> None:
        """Apply the held-back sweeps of tensor `position` to `tensor`, its whole value as the shards hold it (FSDP2
        gathers it for a forward), so the forward sees this process's point of the step."""
        index = self.tensors[position][0]
        for updates in self.held_back:
            if not updates[position].is_identity():
                self.noise.apply_([(index, tensor)], [updates[position]])

    def discard_pending(self) -> None:
        """Forget the pending update (after the tensors were overwritten, e.g. by loading a checkpoint)."""
        self.pending = [NoiseUpdate() for _ in self.tensors]
        self.held_back = []


class SPSAEstimator:
    """Simultaneous-perturbation estimator (MeZO's estimate): the sequential implementation of the estimator slot.

    The estimator slot is what a `ZOOptimizer` runs its estimates through: :meth:`center_forward` (the loss at
    ``theta``), :meth:`signed_forwards` (the sweeps and forwards of one estimate at ``theta +- eps z(seed)``) and
    :meth:`flush`. This class runs them on the whole model; `hf_zo.engine.DualEngine` wraps an instance and runs the
    same sweeps block by block; `hf_zo.parallel.ParallelEstimation` decides which of the forwards a process runs.

    For a seed ``s`` a two-point estimate evaluates the loss at ``theta + eps * z(s)`` and ``theta - eps * z(s)``;
    the projected gradient is ``(L+ - L-) / (2 * eps)``. The restore to ``theta`` is left pending so that it fuses
    with whatever moves the parameters next.

    In bf16/fp16 ``(theta + eps z) - 2 eps z + eps z`` is not ``theta``: each step's rounding drifts the weights.
    With `exact_restore`, the parameters are copied before the perturbation and copied back after the last forward
    (memory: one copy of the perturbed tensors; one extra pass).

    Args:
        params (`LazyParameters`): the parameters to perturb.
        eps (`float`): perturbation scale, > 0.
        exact_restore (`bool`, defaults to `False`): restore from a copy instead of subtracting the noise.
        center_loss (`bool`, defaults to `False`):
            :meth:`estimate` also evaluates the loss at ``theta`` (first, on the restored weights) and puts the
            curvature along ``z`` in the record: three forwards per estimate instead of two (HiZOO's estimate).
    """

    def __init__(self, params: LazyParameters, eps: float, exact_restore: bool = False, center_loss: bool = False):
        if not eps > 0:
            raise ValueError(f"eps must be > 0, got {eps}.")
        self.params = params
        self.eps = eps
        self.exact_restore = exact_restore
        self.center_loss = center_loss

    @torch.no_grad()
    def estimate(self, closure: Callable[[], torch.Tensor | float], seed: int) -> ZORecord | None:
        """Two forwards around the current parameters (three with `center_loss`); `None` (with a warning) if a
        loss is not finite.

        Either way the parameters are (pending) restored to where they were; a dropped record is never applied. If
        the closure raises (an error, an out-of-memory, a `KeyboardInterrupt`), the parameters are restored the same
        way before the exception propagates (see :meth:`signed_forwards`).
        """
        loss_center = self.center_forward(closure) if self.center_loss else None
        loss_plus, loss_minus = self.signed_forwards(closure, seed)
        return make_record(seed, loss_plus, loss_minus, self.eps, loss_center)

    @torch.no_grad()
    def center_forward(self, closure: Callable[[], torch.Tensor | float] | None) -> float:
        """The loss at ``theta`` itself: the pending move is applied first, so the forward sees the true weights.

        With `closure` `None` (a process that leaves this forward to another) only the pending move is applied, as
        the process running the forward applies it, and the loss is NaN.
        """
        self.flush()
        return math.nan if closure is None else loss_value(closure())

    @torch.no_grad()
    def signed_forwards(
        self,
        closure: Callable[[], torch.Tensor | float] | None,
        seed: int,
        signs: tuple[int, ...] = (+1, -1),
        points: tuple[int, ...] = (+1, -1),
    ) -> tuple[float, float]:
        """The sweeps of one estimate: the parameters visit ``theta + sign * eps z(seed)`` for each sign of `points`
        in order (``(+1, -1)``: a two-point estimate; ``(+1,)``: a one-sided one, one sweep), and the forward runs at
        the points whose sign is also in `signs`.

        The parameters go through the same sweeps whichever forwards run (with `signs` empty, `closure` is not
        called), so ranks that share out an estimate's forwards keep bitwise the same parameters. Afterwards they
        are restored: from the copy with `exact_restore`, else by a pending move that the next sweep applies.

        If anything raises in between (the closure, a `KeyboardInterrupt`, an out-of-memory error), the parameters
        are restored the same way, undoing only the part of the perturbation already made, and the exception
        propagates: after :meth:`flush` they hold what they would have held without this estimate, up to the
        rounding of the normal restore (exactly, with `exact_restore`).

        Returns:
            `tuple[float, float]`: the losses at ``theta + eps z`` and ``theta - eps z``; NaN for a forward not run.
        """
        snapshot = None
        if self.exact_restore:
            self.params.flush()
            snapshot = [tensor.detach().clone() for _, tensor in self.params.tensors]
        losses = {+1: math.nan, -1: math.nan}
        offset = 0.0  # the multiple of z(seed) this estimate has added so far, applied or pending
        try:
            for sign in points:
                target = sign * self.eps
                self.params.add(seed, target - offset)  # eps, then -2 eps
                offset = target
                self.params.flush()
                if sign in signs:
                    losses[sign] = loss_value(closure())
        finally:
            self._restore(seed, offset, snapshot)
        return losses[+1], losses[-1]

    def flush(self) -> None:
        """Apply the pending move, so the parameters hold their true values."""
        self.params.flush()

    def _restore(self, seed: int, offset: float, snapshot: list[torch.Tensor] | None) -> None:
        """Undo a perturbation of ``offset * z(seed)``: composed into the pending move, or copied from `snapshot`."""
        if snapshot is None:
            if offset:
                self.params.add(seed, -offset)
            return
        # The snapshot was taken after a flush, so whatever is pending now is this estimate's own move.
        self.params.discard_pending()
        for (_, tensor), saved in zip(self.params.tensors, snapshot):
            tensor.data.copy_(saved)
        _drop_stale_casts()


@dataclass(frozen=True)
class EstimateLosses:
    """The losses one process measured for one estimate, before they become a record.

    Attributes:
        seed (`int`): seed of the perturbation noise.
        loss_plus (`float`): loss at ``theta + eps * z``; NaN if this process did not run that forward.
        loss_minus (`float`): loss at ``theta - eps * z``; NaN if not run (always, for a one-sided estimate).
        loss_center (`float`, *optional*): loss at ``theta``, for an optimizer that measures it; else `None`.
    """

    seed: int
    loss_plus: float
    loss_minus: float
    loss_center: float | None = None


def make_record(
    seed: int, loss_plus: float, loss_minus: float, eps: float, loss_center: float | None = None
) -> ZORecord | None:
    """Build the record of a two-point estimate (with its curvature when `loss_center`, the loss at ``theta``, is
    given), or `None` with a warning if a loss is not finite."""
    losses = (loss_plus, loss_minus) if loss_center is None else (loss_plus, loss_minus, loss_center)
    if not all(math.isfinite(loss) for loss in losses):
        center = "" if loss_center is None else f", loss at theta={loss_center}"
        logger.warning(
            "Non-finite loss in a ZO estimate (loss+=%s, loss-=%s%s, seed=%d): the parameters are restored and this "
            "estimate is skipped.",
            loss_plus,
            loss_minus,
            center,
            seed,
        )
        return None
    curvature = None if loss_center is None else abs(loss_plus + loss_minus - 2.0 * loss_center) / (2.0 * eps * eps)
    return ZORecord(seed, (loss_plus - loss_minus) / (2.0 * eps), loss_plus, loss_minus, curvature)


def loss_value(loss: torch.Tensor | float) -> float:
    """The float value of what a loss closure returned: a one-element tensor or a number (else a clear error)."""
    if isinstance(loss, torch.Tensor):
        if loss.numel() != 1:
            raise ValueError(f"The loss closure must return a scalar, got a tensor of shape {tuple(loss.shape)}.")
        return float(loss.detach().item())
    if not isinstance(loss, (int, float)):
        hint = " (a model output: return its .loss)" if hasattr(loss, "logits") or hasattr(loss, "loss") else ""
        raise TypeError(f"The loss closure must return a scalar tensor or a number, got {type(loss).__name__}{hint}.")
    return float(loss)
