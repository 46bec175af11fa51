"""`ZOTrainer`: `transformers.Trainer` with zeroth-order (MeZO-style) optimization.

Only a few hooks are overridden: the optimizer is a :class:`~hf_zo.optim.ZOOptimizer`, a training step is a
two-point estimate instead of forward + backward, and pending (fused, deferred) updates are applied before the
model is evaluated, saved or handed back. Everything else (data loading and resume, LR schedules, logging,
evaluation, callbacks, checkpoints, model cards, `push_to_hub`) is `Trainer`'s own.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import logging as std_logging
import math
import os
import shutil
from collections.abc import Mapping

import torch
from torch.utils.data import RandomSampler, SequentialSampler
from transformers import Trainer, TrainerCallback, TrainingArguments
from transformers.trainer import TRAINER_STATE_NAME
from transformers.trainer_utils import (
    PREFIX_CHECKPOINT_DIR,
    enable_full_determinism,
    get_last_checkpoint,
    has_length,
    rotate_checkpoints,
    set_seed,
)
from transformers.utils import logging

from .engine import DualEngine
from .heads import ZOHeads, example_lengths, prepare_zo_heads
from .noise import Noise
from .optim import ZO_OPTIMIZERS, ZOExecution, ZOOptimizer
from .parallel import DistZOPlugin
from .parallel.mesh import ZOMesh
from .parallel.replicas import ReplicaCallback
from .training import SamplerEpochCallback, ZOConfig, ZOLengthGroupedSampler, fill_method_defaults
from .training.checkpointing import (
    GLOBAL_STEP_KEY,
    OPTIMIZER_STATE_NAME,
    SAVE_TMP_DIR_NAME,
    check_resumable,
    clean_interrupted_saves,
    publish_checkpoint,
    replace_files_atomically,
    staging_dir,
)
from .trajectory import ZOTrajectory, ZOTrajectoryCallback

logger = logging.get_logger(__name__)


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


class ZOTrainer(Trainer):
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

    _tag_names = ["zeroth-order", "hf-zo"]
    _zo_staging = False  # True while Trainer writes a checkpoint, so that it lands in the staging folder

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
        if args is None:
            model_name = getattr(getattr(model, "config", None), "_name_or_path", None) or "model"
            args = ZOConfig(output_dir=f"{model_name.split('/')[-1]}-ZO")
        elif not isinstance(args, ZOConfig):
            args = _to_zo_config(args)
        _follow_process_log_level(args)
        if model is not None and train_dataset is not None:  # a model loaded to be evaluated may be frozen
            _check_trainable(model)
        if args.learning_rate is None or args.zo_eps is None:
            # Filled in by method, here when training is in view or else in create_optimizer; the caller's stay unset.
            args = copy.copy(args)
            if model is not None and train_dataset is not None:
                fill_method_defaults(args, model)
        # The plugin holds the execution layout, offload included. It fails now, not at train(), on a bad layout,
        # and destroys the process groups at exit.
        self.zo_plugin = DistZOPlugin.from_zo_config(args)
        self.zo_plugin.setup()
        _check_sampling_fits_layout(args, self.zo_plugin.mesh)
        _check_parallel_mode(args, self.zo_plugin.mesh.world_size)
        self.zo_offloader = None
        if model is not None:
            self._prepare_zo_model(model, args.device)
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
        self._check_train_dataset()
        self.add_callback(ZOFlushCallback)
        self.zo_sampler_epoch = SamplerEpochCallback()
        self.add_callback(self.zo_sampler_epoch)
        self.zo_trajectory_callback = ZOTrajectoryCallback()
        self.add_callback(self.zo_trajectory_callback)
        if self.zo_plugin.is_distributed:
            self.add_callback(
                ReplicaCallback(
                    self.args.zo_verify_replicas_steps,
                    self.zo_plugin.replica_collectives,
                    lambda: _named_state(self.model, trainable_only=True),
                    flush=self.flush_pending_update,
                )
            )
        self._zo_state_hooks: list = []
        self._zo_saved_global_step: int | None = None
        if self.optimizer is not None:
            self.zo_optimizer.set_execution(self._zo_execution(self.zo_optimizer))
            self._record_global_step(self.zo_optimizer)
        if hasattr(self.model, "add_model_tags"):
            self.model.add_model_tags(self._tag_names)
        self._zo_log_grads: list[float] = []
        self._zo_log_skipped = 0
        self.zo_heads = ZOHeads()
        self._zo_probed_model = None  # the model whose head `train()` has fitted (see `zo_head_init`)

    # ------------------------------------------------------------------ model

    def _prepare_zo_model(self, model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
        """Make `model` ready before `Trainer` places it on `device`: identical on every rank, and offloaded."""
        # What DDP does when it wraps a model: every rank starts from rank 0's weights (a new head or LoRA matrix
        # is initialised from each process's own RNG). Done before offload, while every tensor is resident.
        self.zo_plugin.sync_replicas(_named_state(model))
        # Blocks go to their storage tier before Trainer places the model: they ignore `.to()`, so only the resident
        # modules reach the device.
        if self.zo_plugin.offload is not None:
            self.zo_offloader = self.zo_plugin.prepare_model(model, device)
        return model

    def call_model_init(self, trial=None) -> torch.nn.Module:
        """`Trainer.call_model_init`, with the model made ready for ZO (synchronised replicas, offloaded blocks)."""
        model = self._prepare_zo_model(super().call_model_init(trial), self.args.device)
        if hasattr(model, "add_model_tags"):
            model.add_model_tags(self._tag_names)
        return model

    def _reinit_model(self, trial) -> None:
        """Rebuild the model from `model_init` at the start of `train()`, as `Trainer.train` does, but before the
        head options are applied, so that the linear probe fits the head of the model that then trains."""
        args = self.args
        enable_full_determinism(args.seed) if args.full_determinism else set_seed(args.seed)
        self.model = self.call_model_init(trial)
        self.optimizer, self.lr_scheduler = None, None
        if self.place_model_on_device:
            self._move_model_to_device(self.model, args.device)
        self.model_wrapped = self.model

    # ------------------------------------------------------------------ checks

    def _check_train_dataset(self) -> None:
        """Fail at construction, not mid-training, when the training data cannot produce a loss."""
        dataset = self.train_dataset
        if dataset is None or self.compute_loss_func is not None:
            return
        try:
            size = len(dataset)
        except TypeError:
            return
        if size == 0:
            raise ValueError("train_dataset is empty: ZOTrainer needs at least one training example.")
        if not self.label_names or type(self).compute_loss is not ZOTrainer.compute_loss:
            # A model whose forward takes no label argument computes its loss from the inputs, and an overridden
            # compute_loss may take it from anywhere: in both, a batch without labels can be right.
            return
        example = dataset[0]
        if not isinstance(example, Mapping):
            return
        if self.args.remove_unused_columns:
            self._set_signature_columns_if_needed()
            example = {k: v for k, v in example.items() if k in self._signature_columns}
        try:
            batch = self.data_collator([example])
        except Exception as error:  # the dataloader will raise it with full context; this check is best effort
            logger.debug("Could not collate a probe batch (%s); label check skipped.", error)
            return
        if not any(name in batch for name in self.label_names):
            raise ValueError(
                f"The training batches have no labels (looked for {self.label_names} in the collated batch, got "
                f"{sorted(batch)}). ZO needs a loss: add a 'label'/'labels' column, use a collator that creates "
                "labels (e.g. DataCollatorForLanguageModeling(tokenizer, mlm=False) for causal LM), or pass "
                "compute_loss_func."
            )

    # ------------------------------------------------------------------ optimizer

    @property
    def zo_optimizer(self) -> ZOOptimizer | None:
        """The `ZOOptimizer` driving training (unwrapped from Accelerate), once created."""
        return unwrap_zo_optimizer(self.optimizer)

    def create_optimizer(self, model=None) -> torch.optim.Optimizer:
        """Build the `ZOOptimizer` named by `args.zo_optimizer` over the trainable parameters.

        Each parameter's noise index is its position among the model's trainable parameters, and biases and norm
        weights get no weight decay (MeZO).
        """
        if self.optimizer is not None:
            return self.optimizer
        model = self.model if model is None else model
        decay_names = set(self.get_decay_parameter_names(model))
        groups = {True: {"params": [], "indices": []}, False: {"params": [], "indices": []}}
        trainable = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
        for index, (name, param) in enumerate(trainable):
            if name in self.zo_heads.zo_excluded:  # trained first-order; the other indices stay put
                continue
            groups[name in decay_names]["params"].append(param)
            groups[name in decay_names]["indices"].append(index)
        groups[True]["weight_decay"] = self.args.weight_decay
        groups[False]["weight_decay"] = 0.0
        param_groups = [g for g in groups.values() if g["params"]]
        fill_method_defaults(self.args, model)  # a model from `model_init`
        # Offloaded blocks rest on the CPU but are perturbed where they compute: the noise follows that device.
        working = self.zo_offloader.device.type if self.zo_offloader is not None else None
        self.optimizer = build_zo_optimizer(self.args, param_groups, working, self._zo_execution())
        self._record_global_step(self.optimizer)
        return self.optimizer

    def _record_global_step(self, optimizer: ZOOptimizer) -> None:
        """Make the state `optimizer` saves carry the trainer's `global_step` (:data:`GLOBAL_STEP_KEY`), read back
        when a checkpoint is loaded.

        The ZO step counter seeds the perturbations and runs on across `train()` calls, while `global_step` starts
        again at 0 in each, so the two differ after a first call; the step saved with the state is what shows that
        `trainer_state.json` and `optimizer.pt` come from the same save.
        """
        for handle in self._zo_state_hooks:  # those of an optimizer this trainer no longer uses
            handle.remove()

        def add_global_step(optimizer, state_dict):
            state_dict[GLOBAL_STEP_KEY] = self.state.global_step

        def take_global_step(optimizer, state_dict):
            self._zo_saved_global_step = state_dict.pop(GLOBAL_STEP_KEY, None)

        self._zo_state_hooks = [
            optimizer.register_state_dict_post_hook(add_global_step),
            optimizer.register_load_state_dict_pre_hook(take_global_step),
        ]

    def _zo_execution(self, optimizer: ZOOptimizer | None = None) -> ZOExecution:
        """The engine (`zo_engine="dual"`: block by block, over the offloaded blocks if any) and the parallel layout
        (`zo_plugin`) the ZO optimizer runs with; a passed-in `optimizer` keeps what it has otherwise."""
        current = optimizer.execution if optimizer is not None else ZOExecution()
        engine = current.engine
        if self.args.zo_engine == "dual":
            # zo_exact_restore=None: the engine restores as the optimizer decided (on for small fp16/bf16 sets).
            engine = DualEngine(self.model, offloader=self.zo_offloader, exact_restore=self.args.zo_exact_restore)
        return ZOExecution(engine=engine, parallel=current.parallel or self.zo_plugin.layout())

    # ------------------------------------------------------------------ distributed layout

    def get_train_dataloader(self):
        """`Trainer.get_train_dataloader`, sharded by data-parallel rank (`zo_plugin`): the ranks of one
        perturbation-parallel group see the same batches."""
        return self.zo_plugin.prepare_data_loader(super().get_train_dataloader())

    def _get_train_sampler(self, train_dataset=None):
        """`Trainer`'s sampler, except with `train_sampling_strategy="group_by_length"` (`ZOConfig`'s default): a
        :class:`~hf_zo.training.sampling.ZOLengthGroupedSampler` over the global batch, or random sampling with a
        warning when the examples' lengths cannot be read."""
        _check_sampling_fits_layout(self.args, self.zo_plugin.setup())
        dataset = self.train_dataset if train_dataset is None else train_dataset
        if self.args.train_sampling_strategy != "group_by_length" or dataset is None or not has_length(dataset):
            return super()._get_train_sampler(train_dataset)
        input_name = getattr(self.processing_class, "model_input_names", None) or ["input_ids"]
        lengths = example_lengths(dataset, self.args.length_column_name, input_name[0])
        if lengths is None:
            logger.warning(
                "train_sampling_strategy='group_by_length' (ZOConfig's default) needs each training example's "
                f"length: a '{self.args.length_column_name}' column or '{input_name[0]}' in every example, which "
                f"this {type(dataset).__name__} lacks. Batches are drawn at random instead; set "
                "train_sampling_strategy='random' to silence this, or add the column."
            )
            return RandomSampler(dataset)
        seed = self.args.data_seed if self.args.data_seed is not None else self.args.seed
        self.zo_sampler_epoch.sampler = ZOLengthGroupedSampler(
            lengths, self.get_total_train_batch_size(self.args), seed
        )
        return self.zo_sampler_epoch.sampler

    def _get_eval_sampler(self, eval_dataset):
        """Evaluation and prediction keep the data set's order: only training batches are grouped by length, so
        `predict` returns one row per example in order whatever `train_sampling_strategy` is."""
        if eval_dataset is None or not has_length(eval_dataset):
            return None
        return SequentialSampler(eval_dataset) if self.args.world_size <= 1 else None

    def get_total_train_batch_size(self, args: TrainingArguments) -> int:
        """Examples per optimizer step: the ranks of a perturbation-parallel group share theirs, so only the
        data-parallel groups multiply the batch."""
        return self._train_batch_size * args.gradient_accumulation_steps * self.zo_plugin.setup().dp_size

    def _wrap_model(self, model, training: bool = True, dataloader=None):
        """Never wrap the model for gradient synchronisation: ZO replicas exchange scalars (`zo_plugin`), and DDP
        would allocate and all-reduce model-sized gradient buckets for nothing."""
        model = super()._wrap_model(model, training=False, dataloader=dataloader)
        if training and model is self.model:
            # Mixed precision and compilation only; marks the model prepared so `accelerator.prepare` keeps it bare.
            model = self.accelerator.prepare_model(model, evaluation_mode=True)
        return model

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
        records = optimizer.estimate(closure)
        self.zo_heads.end_micro_batch()
        self._zo_log_skipped += optimizer.num_skipped - skipped_before
        self._zo_log_grads.extend(r.projected_grad for r in records)
        loss = sum(r.loss for r in records) / len(records) if records else math.nan
        return torch.tensor(loss / self.current_gradient_accumulation_steps, device=self.args.device)

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """Add `projected_grad` (mean since the last log) and `zo_skipped` to the training logs."""
        if "loss" in logs:
            if self._zo_log_grads:
                logs["projected_grad"] = sum(self._zo_log_grads) / len(self._zo_log_grads)
            logs["zo_skipped"] = self._zo_log_skipped
            self._zo_log_grads, self._zo_log_skipped = [], 0
        super().log(logs, start_time)

    # ------------------------------------------------------------------ pending updates

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
            self._reinit_model(trial)
        _check_trainable(self.model)
        _check_output_dir_is_not_the_model(self.model, self.args.output_dir)
        self.zo_heads.close()
        if self.zo_heads in self.callback_handler.callbacks:
            self.remove_callback(self.zo_heads)
        if self.args.should_save:
            clean_interrupted_saves(self.args.output_dir)
        self.accelerator.wait_for_everyone()
        if resume_from_checkpoint:
            checkpoint = resume_from_checkpoint
            if checkpoint is True:
                checkpoint = get_last_checkpoint(self.args.output_dir)
            if checkpoint is not None and os.path.isdir(checkpoint):  # else Trainer names what is missing
                check_resumable(checkpoint)
        # A head is fitted once per model: a later train() call goes on from the head trained so far (refitting it
        # would also move weights outside the trajectory that the run records across calls).
        fit_probe = self._zo_probed_model is not self.model
        self.zo_heads = prepare_zo_heads(self, resume_from_checkpoint, fit_probe=fit_probe)
        self._zo_probed_model = self.model
        try:
            self._check_optimizer_leaves_out_heads()
        except ValueError:
            self.zo_heads.close()
            self.zo_heads = ZOHeads()
            raise
        self.add_callback(self.zo_heads)
        self.model_init = None  # rebuilt above: Trainer.train must not replace the model whose head was prepared
        try:
            return super().train(resume_from_checkpoint=resume_from_checkpoint, trial=trial, **kwargs)
        finally:
            self.model_init = model_init
            self.flush_pending_update()

    def _check_optimizer_leaves_out_heads(self) -> None:
        """Fail when the ZO optimizer (one passed in `optimizers=`) holds parameters of a head trained first-order:
        they would be perturbed by ZO and stepped by the head's AdamW both."""
        optimizer, excluded = self.zo_optimizer, self.zo_heads.zo_excluded
        if optimizer is None or not excluded:
            return
        held = {id(p) for group in optimizer.param_groups for p in group["params"]}
        both = sorted(name for name, p in self.model.named_parameters() if name in excluded and id(p) in held)
        if both:
            raise ValueError(
                f"The ZO optimizer passed in optimizers=(...) holds {both}, the parameters of the head that "
                f"zo_head_training={self.args.zo_head_training!r} trains first-order with AdamW, so they would be "
                "updated twice per step. Build the optimizer without them, e.g. "
                "ZOSGD([p for n, p in model.named_parameters() if p.requires_grad and n not in "
                f"{sorted(excluded)}]), leave `optimizers` unset so ZOTrainer builds it, or set "
                "zo_head_training='zeroth_order'."
            )

    def evaluate(self, *args, **kwargs):
        """`Trainer.evaluate` on the true (flushed) weights."""
        self.flush_pending_update()
        return super().evaluate(*args, **kwargs)

    def predict(self, *args, **kwargs):
        """`Trainer.predict` on the true (flushed) weights."""
        self.flush_pending_update()
        return super().predict(*args, **kwargs)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """`Trainer.save_model` of the true (flushed) weights; used by checkpoints too.

        Outside checkpoints (which are published atomically as a whole), the files are written to a temporary
        folder and moved into `output_dir` one atomic rename each, so a crash never leaves a half-written file. With
        `push_to_hub`, a call from user code then pushes `output_dir`, as `Trainer.save_model` does.
        """
        self.flush_pending_update()
        output_dir = output_dir or self.args.output_dir
        target = output_dir
        if not self._zo_staging and self.args.should_save:
            output_dir = os.path.join(target, SAVE_TMP_DIR_NAME)
            shutil.rmtree(output_dir, ignore_errors=True)
        # Trainer's push waits until the files are in `target`: from inside it would upload the temporary folder.
        super().save_model(output_dir, _internal_call=True)
        if self.args.should_save:
            self.zo_trajectory_callback.save(output_dir, self.model)
            if output_dir != target:
                replace_files_atomically(output_dir, target)
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)

    def _get_output_dir(self, trial) -> str:
        run_dir = super()._get_output_dir(trial)
        return str(staging_dir(run_dir)) if self._zo_staging else run_dir

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        """`Trainer._save_optimizer_and_scheduler`, and the first-order head's AdamW state next to the ZO state."""
        super()._save_optimizer_and_scheduler(output_dir)
        if self.args.should_save:
            self.zo_heads.save_checkpoint(output_dir)

    def _push_from_checkpoint(self, checkpoint_folder: str) -> None:
        """`Trainer._push_from_checkpoint`, except for a staged checkpoint: `_save_checkpoint` pushes it once it is
        published (the upload runs in the background, and the staged folder is renamed away as soon as it is
        complete; it would also put the staging folder into the `every_save` upload of the output directory)."""
        if not self._zo_staging:
            super()._push_from_checkpoint(checkpoint_folder)

    def _save_checkpoint(self, model, trial) -> None:
        """`Trainer._save_checkpoint`, written to a staging folder, published with one atomic rename, then pushed to
        the Hub (with `push_to_hub`)."""
        run_dir = super()._get_output_dir(trial)
        staging = staging_dir(run_dir)
        if self.args.should_save:
            clean_interrupted_saves(run_dir)  # a killed save's staged files: never published, incomplete
        self.accelerator.wait_for_everyone()
        self._zo_staging = True
        try:
            super()._save_checkpoint(model, trial)
        finally:
            self._zo_staging = False
        self.accelerator.wait_for_everyone()
        if self.args.should_save:
            name = f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
            staged, final = staging / name, os.path.join(run_dir, name)
            if self.state.best_model_checkpoint == str(staged):
                self.state.best_model_checkpoint = final
                self.state.save_to_json(str(staged / TRAINER_STATE_NAME))
            publish_checkpoint(staged, final)
            with contextlib.suppress(OSError):  # emptied by the publish; a run folder keeps only its checkpoints
                staging.rmdir()
            if self.args.push_to_hub:
                self._push_from_checkpoint(final)
            rotate_checkpoints(
                output_dir=run_dir,
                save_total_limit=self.args.save_total_limit,
                best_model_checkpoint=self.state.best_model_checkpoint,
                use_mtime=True,
            )
        self.accelerator.wait_for_everyone()

    @property
    def zo_trajectory(self) -> ZOTrajectory | None:
        """The run's trajectory (seeds, projected gradients, lr and weight decay of every step), once training began;
        `save_model` writes it as `zo_trajectory.bin`."""
        return self.zo_trajectory_callback.trajectory

    def _load_from_checkpoint(self, resume_from_checkpoint, model=None) -> None:
        """`Trainer._load_from_checkpoint`, with a clear error when the checkpoint belongs to another model."""
        try:
            super()._load_from_checkpoint(resume_from_checkpoint, model)
        except RuntimeError as error:
            lines = [line.strip() for line in str(error).splitlines() if line.strip()]
            mismatch = next((line for line in lines if "size mismatch" in line), None)
            if mismatch is None:
                raise
            raise ValueError(
                f"Checkpoint {resume_from_checkpoint} was saved from a different model or adapter ({mismatch}). "
                "Resume with the model and PEFT config that wrote it, or train into a new output_dir."
            ) from None

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        """`Trainer._load_optimizer_and_scheduler`; the trajectory saved in `checkpoint` is then continued."""
        self._zo_saved_global_step = None
        super()._load_optimizer_and_scheduler(checkpoint)
        if checkpoint is not None:
            saved_step = self._zo_saved_global_step
            if saved_step is None:  # saved before the state recorded it, when both counters ran together
                saved_step = self.zo_optimizer.zo_step
            if saved_step != self.state.global_step:
                raise ValueError(
                    f"Checkpoint {checkpoint} does not hold one state: {TRAINER_STATE_NAME} is at step "
                    f"{self.state.global_step} but the ZO optimizer of {OPTIMIZER_STATE_NAME} was saved at step "
                    f"{saved_step}, so one of them was changed or replaced. Resume from another checkpoint, or train "
                    "into a new output_dir."
                )
        self.zo_trajectory_callback.resume_from = checkpoint

    def init_hf_repo(self, token: str | None = None, private: bool | None = None) -> None:
        """`Trainer.init_hf_repo`, failing with what to do when the Hub repository cannot be created or reached.

        With `push_to_hub=True`, `Trainer` creates the repository when it is constructed, before any training (and
        `push_to_hub()` does when it is called without); without network this was a traceback from the HTTP client.
        """
        try:
            super().init_hf_repo(token=token, private=private)
        except Exception as error:  # network, DNS, auth or permission: all end in the same advice, with the cause
            repo = self.args.hub_model_id or os.path.basename(os.path.abspath(self.args.output_dir))
            raise ConnectionError(
                f"The Hub repository {repo!r} could not be created or reached ({type(error).__name__}: {error}); "
                "nothing was uploaded. Check the network and the token (HF_TOKEN or hub_token); to train without "
                "the Hub, set push_to_hub=False and upload output_dir later."
            ) from error

    def create_model_card(self, *args, tags: str | list[str] | None = None, **kwargs) -> None:
        """`Trainer.create_model_card` with the `zeroth-order` and `hf-zo` tags added."""
        tags = [tags] if isinstance(tags, str) else list(tags or [])
        tags += [t for t in self._tag_names if t not in tags]
        super().create_model_card(*args, tags=tags, **kwargs)


def build_zo_optimizer(
    args: ZOConfig, param_groups: list[dict], device_type: str | None = None, execution: ZOExecution | None = None
) -> ZOOptimizer:
    """Instantiate the optimizer registered as `args.zo_optimizer` with the hyper-parameters of `args`: those of every
    `ZOOptimizer`, and the class's own (`config_kwargs`), running with `execution` (engine and parallel layout).

    `device_type` is where the parameters are perturbed, which `zo_noise_algorithm="auto"` follows (default: where
    the first parameter lives; offloaded blocks rest elsewhere).
    """
    cls = ZO_OPTIMIZERS[args.zo_optimizer]
    device_type = device_type or param_groups[0]["params"][0].device.type
    kwargs = dict(
        lr=args.learning_rate,
        eps=args.zo_eps,
        weight_decay=args.weight_decay,
        noise=Noise(args.zo_noise, algorithm=args.zo_noise_algorithm, device_type=device_type),
        num_perturbations=args.zo_num_perturbations,
        seed=args.zo_seed,
        max_consecutive_skips=args.zo_max_consecutive_skips,
        cache_noise=args.zo_noise_cache,
        exact_restore=args.zo_exact_restore,
        execution=execution,
    )
    return cls(param_groups, **kwargs, **cls.config_kwargs(args))


def _named_state(model: torch.nn.Module, trainable_only: bool = False) -> list[tuple[str, torch.Tensor]]:
    """The tensors replicas must agree on: the parameters (only the trainable ones if `trainable_only`) and the
    buffers of `model`, with their names."""
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad or not trainable_only]
    return params + list(model.named_buffers())


def _check_parallel_mode(args: TrainingArguments, world_size: int) -> None:
    """Fail when several processes were launched but `TrainingArguments` set up a single-process state: each
    process would then evaluate the whole set, log and save on its own."""
    if world_size > 1 and args.world_size != world_size:
        raise ValueError(
            f"{world_size} processes were launched, but Accelerate's state is "
            f"{getattr(args.distributed_state, 'distributed_type', None)} with world size {args.world_size}, so "
            "evaluation, logging and saving would not be coordinated. On CPUs set ACCELERATE_USE_CPU=true (or "
            "use_cpu=True); with GPUs, give each process its own device."
        )


def _check_sampling_fits_layout(args: TrainingArguments, mesh: ZOMesh) -> None:
    """Fail when `args.train_sampling_strategy` cannot feed this layout: Trainer's `BatchRebalanceSampler` hands
    each process its own batches, but the ranks of one perturbation-parallel group must all see the same batch
    (each would estimate the gradient on another one, and the step would mix them)."""
    if args.train_sampling_strategy == "batch_rebalance" and mesh.pertp_size > 1:
        raise ValueError(
            f"train_sampling_strategy='batch_rebalance' cannot feed perturbation parallelism (a perturbation-parallel "
            f"size of {mesh.pertp_size}): its sampler gives every process different batches, while the ranks of one "
            "perturbation-parallel group must share theirs. Use train_sampling_strategy='group_by_length' (ZOConfig's "
            "default, which also batches examples of similar length) or 'random', or set "
            "zo_perturbation_parallel_size=1."
        )


def _check_output_dir_is_not_the_model(model: torch.nn.Module, output_dir: str) -> None:
    """Fail when training would save into the folder the model was loaded from: the pretrained weights would be
    overwritten, and the run's trajectory could no longer be replayed onto them."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    source = getattr(getattr(base, "config", None), "_name_or_path", None)
    if source and os.path.isdir(source) and os.path.realpath(source) == os.path.realpath(output_dir):
        raise ValueError(
            f"output_dir {output_dir!r} is the folder the model was loaded from: saving there would overwrite the "
            "pretrained weights the run starts from. Choose another output_dir."
        )


def _check_trainable(model: torch.nn.Module) -> None:
    if not any(p.requires_grad for p in model.parameters()):
        raise ValueError(
            f"{type(model).__name__} has no trainable parameters (every requires_grad is False), so there is nothing "
            "for ZO to update. For PEFT, wrap the model with peft.get_peft_model(model, config); for full "
            "fine-tuning, call model.requires_grad_(True)."
        )


def _follow_process_log_level(args: ZOConfig) -> None:
    """Give hf_zo's loggers the level `Trainer` gives transformers' (`log_level` on the main process,
    `log_level_replica` on the others; transformers' verbosity when `"passive"`), and print their records to stderr
    when the application has configured no logging, as transformers' own handler does. A `"passive"` level leaves
    an application's own logging configuration (`logging.basicConfig`) in charge."""
    library, configured = std_logging.getLogger("hf_zo"), bool(std_logging.getLogger().handlers)
    if (args.log_level if args.should_log else args.log_level_replica) != "passive" or not configured:
        library.setLevel(args.get_process_log_level())
    if not library.handlers and not configured:
        library.addHandler(std_logging.StreamHandler())
        library.propagate = False


def _to_zo_config(args: TrainingArguments) -> ZOConfig:
    """`args` as a `ZOConfig`, keeping every value; warns about the ones left at `TrainingArguments`' defaults for
    first-order training where `ZOConfig`'s differ (a set value cannot be told from a default, so both are kept)."""
    init_fields = {f.name for f in dataclasses.fields(ZOConfig) if f.init}
    values = {k: v for k, v in args.to_dict().items() if k in init_fields}
    values["hub_token"] = args.hub_token
    first_order_defaults = {f.name: f.default for f in dataclasses.fields(TrainingArguments) if f.init}
    zo_defaults = {f.name: f.default for f in dataclasses.fields(ZOConfig) if f.init}
    kept = [
        f"{name}={values[name]!r} (ZOConfig's default: {zo_defaults[name] or 'chosen by what the model trains'!r})"
        for name in ("learning_rate", "lr_scheduler_type", "max_grad_norm", "train_sampling_strategy")
        if name in values
        and values[name] == first_order_defaults.get(name)
        and first_order_defaults.get(name) != zo_defaults.get(name)
    ]
    if kept:
        logger.warning(
            "ZOTrainer was given a TrainingArguments and keeps its values, among them %s, which are "
            "TrainingArguments' defaults for first-order training (a learning rate of 5e-5 diverges for all weights "
            "under ZO). Pass a ZOConfig to get the ZO defaults, or set these values explicitly.",
            ", ".join(kept),
        )
    return ZOConfig(**values)
