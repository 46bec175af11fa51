"""Pending ZO updates at the edges of training: the `ZOOptimizer` behind Accelerate's wrapper, and the callback that
applies its deferred update when training ends and discards a step that a stop cut short."""

from __future__ import annotations

from transformers import TrainerCallback
from transformers.utils import logging

from ..optim import ZOOptimizer

logger = logging.get_logger(__name__)

__all__ = ["ZOFlushCallback", "unwrap_zo_optimizer"]


def unwrap_zo_optimizer(optimizer) -> ZOOptimizer | None:
    """The `ZOOptimizer` inside `optimizer` (e.g. an Accelerate `AcceleratedOptimizer`), or `None`."""
    while optimizer is not None and not isinstance(optimizer, ZOOptimizer):
        optimizer = getattr(optimizer, "optimizer", None)
    return optimizer


class ZOFlushCallback(TrainerCallback):
    """Applies the pending update when training reaches its last step, before `Trainer` may reload the best model,
    and discards the step of a gradient accumulation that a callback's stop cut short (`ZOOptimizer.discard_step`)."""

    def on_step_end(self, args, state, control, optimizer=None, **kwargs):
        if state.global_step >= state.max_steps or control.should_training_stop:
            zo_optimizer = unwrap_zo_optimizer(optimizer)
            if zo_optimizer is not None:
                zo_optimizer.flush()

    def on_epoch_end(self, args, state, control, optimizer=None, **kwargs):
        # Trainer steps at an epoch's last micro-batch, so estimates left here come from `should_training_stop` or
        # `should_epoch_stop` set between two steps. Trainer leaves a first-order run's partial gradients unused
        # (or adds them to the next epoch's first step); the ZO step is discarded, so that the epoch's checkpoint
        # can be saved and holds the update of `global_step` steps, and the next step starts its accumulation anew.
        zo_optimizer = unwrap_zo_optimizer(optimizer)
        if zo_optimizer is not None and zo_optimizer.num_pending_estimates:
            estimates = zo_optimizer.num_pending_estimates
            zo_optimizer.discard_step()
            logger.warning(
                "Training stopped in the middle of a gradient accumulation, before optimizer step %d: the %d ZO "
                "estimates of that partial step are discarded, as Trainer discards partial gradients.",
                state.global_step + 1,
                estimates,
            )
