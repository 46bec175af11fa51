"""The first-order head: a head trained with exact gradients (AdamW) inside the zeroth-order forward passes.

The head is taken out of the ZO parameter set; its gradients come from the two ZO forward passes themselves (autograd
is switched on at the head's input and the input is detached), so the only extra memory is the head's activations,
gradients and AdamW moments.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping

import torch
from torch import nn

from ..parallel.mesh import ZOMesh
from .gradients import Gradients, MicroBatch, sum_in_single_process_order

__all__ = ["FirstOrderHead", "schedule_scale"]


class FirstOrderHead:
    """Trains `heads` with exact gradients inside the zeroth-order forward passes.

    While :meth:`capture` is active, autograd is switched on at each head's input (which is detached), so the loss
    of a forward pass carries a graph through the heads only; :meth:`backward` accumulates their gradients and
    :meth:`step` applies the mean gradient with AdamW. The body runs without autograd as before.

    The gradients are summed per micro-batch (:meth:`end_micro_batch`; kept per forward under perturbation
    parallelism, where a micro-batch's forwards run on several ranks), and :meth:`step` adds them in the order one
    process accumulating the step's micro-batches adds them, gathering every rank's on a mesh
    (:func:`~hf_zo.heads.gradients.sum_in_single_process_order`), so data parallelism, perturbation
    parallelism and both train heads bit-identical to one process's.

    Args:
        heads (`Mapping[str, nn.Module]`): the head modules.
        params (`list[torch.Tensor]`): their trainable parameters.
        lr (`float`): AdamW learning rate at a schedule factor of 1 (see :meth:`step`).
        weight_decay (`float`, defaults to 0.0): AdamW weight decay.
        mesh (`ZOMesh`, *optional*): this rank's place in a DistZO2 layout; defaults to a single process.
    """

    def __init__(
        self,
        heads: Mapping[str, nn.Module],
        params: list[torch.Tensor],
        lr: float,
        weight_decay: float = 0.0,
        mesh: ZOMesh | None = None,
    ):
        if not params:
            raise ValueError(f"The heads {list(heads)} have no trainable parameters to train first-order.")
        self.params = params
        self.lr = lr
        self.mesh = mesh if mesh is not None else ZOMesh()
        self.optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
        self._num_forwards = 0  # this rank's forwards with a graph in the current step
        self._forwards: MicroBatch = []  # the current micro-batch's gradients (see `backward`)
        self._micro_batches: list[MicroBatch] = []  # the step's finished micro-batches
        self._active = 0  # captures in progress (the dual engine runs both forwards' closures concurrently)
        self._handles = [h.register_forward_pre_hook(self._enter_head) for h in heads.values()]

    def _enter_head(self, module, args):
        if not self._active:
            return None
        torch.set_grad_enabled(True)
        return tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in args)

    @contextlib.contextmanager
    def capture(self) -> Iterator[None]:
        """Context of one ZO forward pass: gradients flow from the loss into the heads, never into the body."""
        previous = torch.is_grad_enabled()
        self._active += 1
        try:
            yield
        finally:
            self._active -= 1
            torch.set_grad_enabled(previous)

    def backward(self, loss: torch.Tensor) -> torch.Tensor:
        """Accumulate the heads' gradients of `loss` (if it has a graph) and return it detached.

        A rank that runs every forward of its micro-batches (no perturbation parallelism) lets autograd add them up
        in ``.grad``, as one process does; under perturbation parallelism each forward's gradients are kept apart,
        to be interleaved with the other ranks' forwards at :meth:`step`.
        """
        if isinstance(loss, torch.Tensor) and loss.requires_grad:
            loss.backward()
            self._num_forwards += 1
            if self.mesh.pertp_size > 1:
                self._forwards.append(self._take_gradients())
            return loss.detach()
        return loss

    def end_micro_batch(self) -> None:
        """Close the current micro-batch (if it ran a forward with a graph)."""
        if self.mesh.pertp_size == 1 and any(p.grad is not None for p in self.params):
            self._forwards.append(self._take_gradients())
        if not self._forwards:
            return
        if self.mesh.world_size == 1:  # nothing to interleave: keep one running sum
            total, _ = sum_in_single_process_order([*self._micro_batches, self._forwards], 0, self.params, self.mesh)
            self._micro_batches = [[total]]
        else:
            self._micro_batches.append(self._forwards)
        self._forwards = []

    def step(self, lr_scale: float = 1.0) -> None:
        """Apply the mean of the step's gradients (over every forward pass of every rank) and clear them.

        Args:
            lr_scale (`float`, defaults to 1.0): the factor the trainer's learning-rate schedule applies at this
                step; the head's AdamW steps at ``lr * lr_scale``, so it warms up and decays with the ZO weights.
        """
        for group in self.optimizer.param_groups:
            group["lr"] = self.lr * lr_scale
        self.end_micro_batch()
        sums, count = sum_in_single_process_order(self._micro_batches, self._num_forwards, self.params, self.mesh)
        if count:
            for p, total in zip(self.params, sums):
                p.grad = None if total is None else total / count
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self._micro_batches = []
        self._num_forwards = 0

    def discard_step(self) -> None:
        """Drop the gradients gathered since the last :meth:`step` (an accumulation cut short)."""
        self.optimizer.zero_grad(set_to_none=True)
        self._forwards, self._micro_batches, self._num_forwards = [], [], 0

    def _take_gradients(self) -> Gradients:
        gradients = [p.grad for p in self.params]
        for p in self.params:
            p.grad = None
        return gradients

    def close(self) -> None:
        """Remove the hooks from the heads."""
        for handle in self._handles:
            handle.remove()
        self._handles = []


def schedule_scale(lr_scheduler, optimizer, base_lr: float) -> float:
    """The factor by which the trainer's schedule multiplies the learning rate at the current optimizer step.

    Exact for the schedules `transformers` builds (`LambdaLR`s: their factor is read from the schedule, so it is
    defined even at a learning rate of 0); for any other scheduler, the optimizer's current learning rate over
    `base_lr` (1.0 when `base_lr` is 0 or there is no scheduler).
    """
    scheduler = getattr(lr_scheduler, "scheduler", lr_scheduler)  # unwrap accelerate's AcceleratedScheduler
    if isinstance(scheduler, torch.optim.lr_scheduler.LambdaLR):
        return float(scheduler.lr_lambdas[0](scheduler.last_epoch))
    if scheduler is None or optimizer is None or not base_lr > 0:
        return 1.0
    return optimizer.param_groups[0]["lr"] / base_lr
