"""The head options (`zo_head_*`) of a ZO trainer: a linear probe fitted before training, a head trained first-order
beside the ZO body, as `hf_zo.heads` builds them, set up at the start of each `train()` call."""

from __future__ import annotations

from ..heads import ZOHeads, prepare_zo_heads
from .checks import check_optimizer_leaves_out_heads

__all__ = ["ZOHeadsMixin"]


class ZOHeadsMixin:
    """The `Trainer` hooks that prepare the heads of a ZO run.

    Mixed into `ZOTrainerMixin`, ahead of a `transformers.Trainer`. Its state: `zo_heads` (the :class:`ZOHeads`
    callback of the current `train()` call) and the model whose head was fitted, set by :meth:`_init_zo_heads`.
    """

    def _init_zo_heads(self) -> None:
        """No heads until the first `train()` call sets them up."""
        self.zo_heads = ZOHeads()
        self._zo_probed_model = None  # the model whose head `train()` has fitted (see `zo_head_init`)

    def _setup_zo_heads(self, resume_from_checkpoint: str | bool | None) -> None:
        """Replace the last `train()` call's heads by this call's (restored from `resume_from_checkpoint` if
        given), and check that the ZO optimizer leaves out what they train."""
        self.zo_heads.close()
        if self.zo_heads in self.callback_handler.callbacks:
            self.remove_callback(self.zo_heads)
        # A head is fitted once per model: a later train() call goes on from the head trained so far (refitting it
        # would also move weights outside the trajectory that the run records across calls).
        fit_probe = self._zo_probed_model is not self.model
        self.zo_heads = prepare_zo_heads(
            self.model,
            self.args,
            self.zo_plugin.setup(),
            train_dataset=self.train_dataset,
            probe_dataloader=self._zo_probe_dataloader,
            gather=self.accelerator.gather_for_metrics if self.args.world_size > 1 else None,
            show_progress=not self.args.disable_tqdm and self.is_local_process_zero(),
            resume_from_checkpoint=resume_from_checkpoint,
            fit_probe=fit_probe,
        )
        self._zo_probed_model = self.model
        try:
            excluded, head_training = self.zo_heads.zo_excluded, self.args.zo_head_training
            check_optimizer_leaves_out_heads(self.zo_optimizer, self.model, excluded, head_training)
        except ValueError:
            self.zo_heads.close()
            self.zo_heads = ZOHeads()
            raise
        self.add_callback(self.zo_heads)

    def _zo_probe_dataloader(self, examples):
        """The linear probe's batches: sharded over the processes like evaluation, in the order the probe gave its
        examples (the same in every layout), and not cached (`get_eval_dataloader` would store this loader as the
        one `evaluate()` reuses when `dataloader_persistent_workers` is set)."""
        with self.zo_in_dataset_order():
            return self.get_test_dataloader(examples)
