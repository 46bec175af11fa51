"""`ZOTrainer`: `transformers.Trainer` with zeroth-order (MeZO-style) optimization.

Only a few hooks are overridden: the optimizer is a :class:`~hf_zo.optim.ZOOptimizer`, a training step is a
two-point estimate instead of forward + backward, and pending (fused, deferred) updates are applied before the
model is evaluated, saved or handed back. Everything else (data loading and resume, LR schedules, logging,
evaluation, callbacks, checkpoints, model cards, `push_to_hub`) is `Trainer`'s own.

The ZO wiring is one mixin, :class:`ZOTrainerMixin`, so that it composes with any `Trainer` subclass:
`ZOTrainer` is `ZOTrainerMixin` over `transformers.Trainer`. Beside the hooks here, it brings crash-safe
checkpoints (`hf_zo.training.checkpointing`), the head options (`hf_zo.training.heads`), the order of the examples
(`hf_zo.training.sampling`) and the placement of model and data under the distributed layout
(`hf_zo.training.layout`); the optimizer is built from the `ZOConfig` by `hf_zo.training.optimizer.build_zo_optimizer`.
"""

from __future__ import annotations

import copy
import math

import torch
from transformers import Trainer, TrainingArguments

from .engine import DualEngine, FrozenPrefix
from .heads import first_order_parameter_names
from .models.quantized import release_loading_memory
from .optim import ZOExecution, ZOOptimizer
from .training import SamplerEpochCallback, ZOConfig, fill_method_defaults
from .training.arguments import prepare_zo_args
from .training.checkpointing import ZOCheckpointingMixin
from .training.checks import (
    check_output_dir_is_not_the_model,
    check_quantized_base,
    check_train_dataset,
    check_trainable,
)
from .training.defaults import log_zo_settings
from .training.heads import ZOHeadsMixin
from .training.layout import ZOLayoutMixin
from .training.optimizer import build_zo_optimizer
from .training.param_groups import zo_param_groups
from .training.pending_updates import ZOFlushCallback, unwrap_zo_optimizer
from .training.sampling import ZOSamplingMixin
from .trajectory import ZOTrajectory, ZOTrajectoryCallback

__all__ = ["ZOTrainer", "ZOTrainerMixin", "build_zo_optimizer"]


class ZOTrainerMixin(ZOCheckpointingMixin, ZOHeadsMixin, ZOSamplingMixin, ZOLayoutMixin):
    """The zeroth-order wiring of a `transformers.Trainer` subclass: put it first among the bases
    (`class ZOTrainer(ZOTrainerMixin, Trainer)`).

    It builds the ZO optimizer, runs each training step as ZO estimates, applies the head options (`zo_head_*`),
    records the trajectory and sets up the distributed layout (`zo_plugin`); through its bases it makes checkpoints
    crash-safe, orders the training examples and places model and data. `_zo_config_class` is the `ZOConfig` (sub)class
    that `args=None` and a plain `TrainingArguments` become.
    """

    _tag_names = ["zeroth-order", "hf-zo"]
    _zo_config_class: type[ZOConfig] = ZOConfig

    def __init__(
        self,
        model=None,
        args: ZOConfig | TrainingArguments | None = None,
        data_collator=None,
        train_dataset=None,
        eval_dataset=None,
        processing_class=None,
        **kwargs,
    ):
        args = prepare_zo_args(args, model, self._zo_config_class)
        self._setup_zo_layout(args)
        # Set up once `Trainer` has the final model (`create_accelerator_and_postprocess`); a model loaded to be
        # evaluated may be frozen.
        self._zo_model_pending, self._zo_training_in_view = True, train_dataset is not None
        self._init_zo_checkpointing()
        super().__init__(
            model=model,
            args=args,
            data_collator=data_collator,
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            processing_class=processing_class,
            **kwargs,
        )
        if self.optimizer is not None and unwrap_zo_optimizer(self.optimizer) is None:
            raise TypeError(
                f"ZOTrainer needs a ZOOptimizer, got {type(self.optimizer).__name__}; pass one of hf_zo.optim's "
                "optimizers in `optimizers=(...)` or leave it unset and choose `zo_optimizer` in ZOConfig."
            )
        if self.model is not None and self._zo_training_in_view:  # with model_init: in create_optimizer
            fill_method_defaults(self.args, self.model, self.compute_loss_func)
        self._check_zo_train_dataset()
        self.add_callback(ZOFlushCallback)
        self.zo_sampler_epoch = SamplerEpochCallback()
        self.add_callback(self.zo_sampler_epoch)
        self.zo_trajectory_callback = ZOTrajectoryCallback()
        self.add_callback(self.zo_trajectory_callback)
        self._add_zo_replica_check()
        if self.optimizer is not None:
            self.zo_optimizer.set_execution(self._zo_execution(self.zo_optimizer))
            self._zo_step_stamp.attach(self.zo_optimizer)
        if hasattr(self.model, "add_model_tags"):
            self.model.add_model_tags(self._tag_names)
        self._zo_log_grads: list[float] = []
        self._zo_log_skipped = 0
        self._init_zo_heads()
        self._zo_frozen_prefix: tuple[ZOOptimizer, FrozenPrefix] | None = None

    def create_accelerator_and_postprocess(self) -> None:
        """`Trainer.create_accelerator_and_postprocess`, then, the first time, the model made ready for ZO.

        `Trainer.__init__` calls it with its final model, before placing it on the device: a subclass such as TRL's
        `SFTTrainer` has by then loaded a model given by name and applied its `peft_config`. So the trainable
        parameters are checked, and replicas are synchronised and blocks offloaded on the model that trains (the unset
        learning rate and `zo_eps`, which depend on the loss too, are filled in at the end of `__init__`).
        """
        super().create_accelerator_and_postprocess()
        if not self._zo_model_pending:  # called again by a hyper-parameter search, whose models come from model_init
            return
        self._zo_model_pending = False
        if self.model is None:  # model_init: prepared in call_model_init, its defaults filled in create_optimizer
            return
        if self._zo_training_in_view:
            check_trainable(self.model)
            check_quantized_base(self.model, self.zo_plugin.offload)
        release_loading_memory(self.model)  # a quantized base's load leaves the full-precision pages resident
        self._prepare_zo_model(self.model, self.args.device)

    def _check_zo_train_dataset(self) -> None:
        """Fail at construction, not mid-training, when the training data cannot produce a loss."""
        if self.train_dataset is None or self.compute_loss_func is not None:
            return
        # A model whose forward takes no label argument computes its loss from the inputs, and an overridden
        # compute_loss may take it from anywhere: in both, a batch without labels can be right.
        needs_labels = bool(self.label_names) and type(self).compute_loss is Trainer.compute_loss
        if needs_labels and self.args.remove_unused_columns:
            self._set_signature_columns_if_needed()
        columns = self._signature_columns if self.args.remove_unused_columns else None
        check_train_dataset(self.train_dataset, self.data_collator, self.label_names if needs_labels else (), columns)

    # ------------------------------------------------------------------ optimizer

    @property
    def zo_optimizer(self) -> ZOOptimizer | None:
        """The `ZOOptimizer` driving training (unwrapped from Accelerate), once created."""
        return unwrap_zo_optimizer(self.optimizer)

    def create_optimizer(self, model=None) -> torch.optim.Optimizer:
        """Build the `ZOOptimizer` named by `args.zo_optimizer` over the trainable parameters.

        Each parameter's noise index is its position among the model's trainable parameters, and biases and norm
        weights get no weight decay (MeZO). A head that `zo_head_training` trains first-order is left out.
        """
        if self.optimizer is not None:
            return self.optimizer
        model = self.model if model is None else model
        excluded = first_order_parameter_names(model, self.args)
        decay_names = self.get_decay_parameter_names(model)
        param_groups = zo_param_groups(model, decay_names, excluded, self.args.weight_decay)
        fill_method_defaults(self.args, model, self.compute_loss_func)  # a model from `model_init`
        # Offloaded blocks rest on the CPU but are perturbed where they compute: the noise follows that device.
        working = self.zo_offloader.device.type if self.zo_offloader is not None else None
        self.optimizer = build_zo_optimizer(self.args, param_groups, working, self._zo_execution())
        self._zo_step_stamp.attach(self.optimizer)
        log_zo_settings(self.args)  # training starts: what it trains with, defaults filled in included
        return self.optimizer

    def _zo_execution(self, optimizer: ZOOptimizer | None = None) -> ZOExecution:
        """The engine (`zo_engine="dual"`: block by block, over the offloaded blocks if any) and the parallel layout
        (`zo_plugin`) the ZO optimizer runs with; a passed-in `optimizer` keeps what it has otherwise."""
        current = optimizer.execution if optimizer is not None else ZOExecution()
        engine = current.engine
        if self.args.zo_engine == "dual":
            # zo_exact_restore=None: the engine restores as the optimizer decided (on for small fp16/bf16 sets).
            engine = DualEngine(self.model, offloader=self.zo_offloader, exact_restore=self.args.zo_exact_restore)
        return ZOExecution(engine=engine, parallel=current.parallel or self.zo_plugin.layout())

    # ------------------------------------------------------------------ training step

    def training_step(self, model, inputs, num_items_in_batch=None) -> torch.Tensor:
        """One micro-batch: `zo_num_perturbations` two-point estimates; the update waits for `optimizer.step()`.

        Returns the mean perturbed loss, scaled for gradient accumulation like `Trainer.training_step`.
        """
        model.eval()
        inputs = self._prepare_inputs(inputs)

        def closure():
            # A copy per forward: `compute_loss` pops the labels when a label smoother, a `compute_loss_func` or an
            # override takes them out, and each estimate runs it at least twice on the same batch.
            with self.compute_loss_context_manager(), self.zo_heads.capture():
                return self.zo_heads.backward(self.compute_loss(model, copy.copy(inputs)))

        optimizer = self.zo_optimizer
        skipped_before = optimizer.num_skipped
        with self._zo_frozen_prefix_of(optimizer).shared():
            records = optimizer.estimate(closure)
        self.zo_heads.end_micro_batch()
        self._zo_log_skipped += optimizer.num_skipped - skipped_before
        self._zo_log_grads.extend(r.projected_grad for r in records)
        loss = sum(r.loss for r in records) / len(records) if records else math.nan
        return torch.tensor(loss / self.current_gradient_accumulation_steps, device=self.args.device)

    def _zo_frozen_prefix_of(self, optimizer: ZOOptimizer) -> FrozenPrefix:
        """The frozen blocks whose outputs the forwards of a micro-batch share (`zo_reuse_frozen_prefix`; none with
        the dual engine, which sweeps the blocks itself)."""
        if self._zo_frozen_prefix is None or self._zo_frozen_prefix[0] is not optimizer:
            reuse = self.args.zo_reuse_frozen_prefix and optimizer.engine is None
            perturbed = [tensor for _, tensor in optimizer.params.tensors] if reuse else []
            self._zo_frozen_prefix = (optimizer, FrozenPrefix(self.model, perturbed))
        return self._zo_frozen_prefix[1]

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """Add `projected_grad` (mean since the last log) and `zo_skipped` to the training logs."""
        if "loss" in logs:
            if self._zo_log_grads:
                logs["projected_grad"] = sum(self._zo_log_grads) / len(self._zo_log_grads)
            logs["zo_skipped"] = self._zo_log_skipped
            self._zo_log_grads, self._zo_log_skipped = [], 0
        super().log(logs, start_time)

    # ------------------------------------------------------------------ train, evaluate, predict

    def flush_pending_update(self) -> None:
        """Apply the deferred part of the last update so the model holds its true weights."""
        optimizer = self.zo_optimizer
        if optimizer is not None:
            optimizer.flush()

    def train(self, resume_from_checkpoint: str | bool | None = None, trial=None, **kwargs):
        """`Trainer.train`, with the head options (`zo_head_*`) applied first and the last pending update applied
        before returning. A model from `model_init` is rebuilt here, before the head options, instead of inside
        `Trainer.train`."""
        model_init = self.model_init
        if model_init is not None:
            self._reinit_zo_model(trial)
        check_trainable(self.model)
        check_quantized_base(self.model, self.zo_plugin.offload)
        check_output_dir_is_not_the_model(self.model, self.args.output_dir)
        self._prepare_zo_checkpoints(resume_from_checkpoint)
        self._setup_zo_heads(resume_from_checkpoint)
        self.model_init = None  # rebuilt above: Trainer.train must not replace the model whose head was prepared
        try:
            return super().train(resume_from_checkpoint=resume_from_checkpoint, trial=trial, **kwargs)
        finally:
            self.model_init = model_init
            self.flush_pending_update()

    def evaluate(self, *args, **kwargs):
        """`Trainer.evaluate` on the true (flushed) weights."""
        self.flush_pending_update()
        return super().evaluate(*args, **kwargs)

    def predict(self, *args, **kwargs):
        """`Trainer.predict` on the true (flushed) weights."""
        self.flush_pending_update()
        return super().predict(*args, **kwargs)

    @property
    def zo_trajectory(self) -> ZOTrajectory | None:
        """The run's trajectory (seeds, projected gradients, lr and weight decay of every step), once training began;
        `save_model` writes it as `zo_trajectory.bin`."""
        return self.zo_trajectory_callback.trajectory


class ZOTrainer(ZOTrainerMixin, Trainer):
    """Trainer for zeroth-order fine-tuning: a drop-in replacement for `transformers.Trainer`.

    Each training step estimates the gradient from two forward passes at ``θ ± eps z`` (no backward pass, no
    gradient buffers; dropout is disabled in these forwards so that both see the same network). Gradient
    accumulation adds perturbations: each micro-batch contributes one record per perturbation and the optimizer
    step applies them all. Checkpoints carry the ZO state (base seed, step, optimizer state) so resuming reproduces
    the uninterrupted run bitwise.

    Args:
        model (`PreTrainedModel` or `torch.nn.Module`): the model to train; a PEFT model trains its adapter only.
        args (`ZOConfig`, *optional*): training arguments; a plain `TrainingArguments` is converted.
        data_collator, train_dataset, eval_dataset, processing_class: as for `transformers.Trainer`.
        **kwargs: any other `transformers.Trainer` argument (`compute_metrics`, `callbacks`, `optimizers`, ...).
    """
