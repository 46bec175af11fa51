"""Where the model and the data go under the run's `DistZOPlugin` layout: identical replicas, offloaded blocks or
FSDP2 shards, batches sharded by data-parallel rank, and no gradient-synchronising wrapper."""

from __future__ import annotations

import os

import torch
from accelerate.utils import patch_environment
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from transformers import PreTrainedModel, TrainingArguments
from transformers.trainer import TRAINING_ARGS_NAME
from transformers.trainer_utils import enable_full_determinism, set_seed

from ..parallel import DistZOPlugin
from ..parallel.fsdp import check_fsdp_layout, load_saved_shards, save_sharded_checkpoint
from ..parallel.replicas import ReplicaCallback
from .checks import check_parallel_mode, check_sampling_fits_layout

__all__ = ["ZOLayoutMixin", "replica_state"]


def replica_state(model: torch.nn.Module, trainable_only: bool = False) -> list[tuple[str, torch.Tensor]]:
    """The tensors replicas must agree on: the parameters (only the trainable ones if `trainable_only`) and the
    buffers of `model`, with their names."""
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad or not trainable_only]
    return params + list(model.named_buffers())


class ZOLayoutMixin:
    """The `Trainer` hooks that place the model and shard the data as the trainer's `zo_plugin` lays the run out.

    Mixed into `ZOTrainerMixin`, ahead of a `transformers.Trainer`. Its state: `zo_plugin` (the `DistZOPlugin` of
    the run) and `zo_offloader` (the offloaded blocks' storage, or `None`), set by :meth:`_setup_zo_layout`.
    """

    def _setup_zo_layout(self, args: TrainingArguments) -> None:
        """Build the run's `zo_plugin` from `args` before `Trainer` is set up: a layout the launch or the sampling
        cannot feed fails here, not at `train()`. The model is made ready for it once it is final
        (:meth:`_prepare_zo_model`)."""
        # The plugin holds the execution layout, offload included; it destroys the process groups at exit.
        self.zo_plugin = DistZOPlugin.from_zo_config(args)
        self.zo_plugin.setup()
        check_sampling_fits_layout(args, self.zo_plugin.mesh)
        check_parallel_mode(args, self.zo_plugin.mesh.world_size)
        check_fsdp_layout(self.zo_plugin.fsdp_version, engine=args.zo_engine)
        self.zo_offloader = None
        self._zo_full_state_dict = None

    def create_accelerator_and_postprocess(self) -> None:
        """`Trainer.create_accelerator_and_postprocess`. Under FSDP2 hf_zo shards the model itself and gathers it to
        save, so `Trainer` keeps its plain path, on GPUs as on CPUs (where Accelerate sets up no FSDP state): it
        neither wraps the model nor swaps the optimizer's parameters. hf_zo reads the launch's parallelism config
        itself (its groups of sharded replicas), so Accelerate is kept from building a mesh of its own for it."""
        if self.zo_plugin.fsdp_version == 2:
            with patch_environment(accelerate_use_parallelism_config="false"):
                super().create_accelerator_and_postprocess()
            self.is_fsdp_enabled = False
        else:
            super().create_accelerator_and_postprocess()

    def _add_zo_replica_check(self) -> None:
        """In a multi-process run, check every `zo_verify_replicas_steps` that the replicas are still identical (not
        under FSDP2: each process holds its own shards, no replica)."""
        if self.zo_plugin.is_distributed and not self.zo_plugin.shards_parameters:
            self.add_callback(
                ReplicaCallback(
                    self.args.zo_verify_replicas_steps,
                    self.zo_plugin.replica_collectives,
                    lambda: replica_state(self.model, trainable_only=True),
                    flush=self.flush_pending_update,
                )
            )

    def _prepare_zo_model(self, model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
        """Make `model` ready before `Trainer` places it on `device`: identical on every rank, then offloaded or
        sharded with FSDP2, before its optimizer is built over the tensors it will sweep."""
        # What DDP does when it wraps a model: every rank starts from rank 0's weights (a new head or LoRA matrix
        # is initialised from each process's own RNG). Done before offload, while every tensor is resident.
        self.zo_plugin.sync_replicas(replica_state(model))
        # Blocks go to their storage tier before Trainer places the model: they ignore `.to()`, so only the resident
        # modules reach the device. Under FSDP2 each rank keeps its shards of rank 0's weights.
        self.zo_offloader = self.zo_plugin.prepare_model(model, device)
        return model

    def call_model_init(self, trial=None) -> torch.nn.Module:
        """`Trainer.call_model_init`, with the model made ready for ZO (synchronised replicas, offloaded blocks)."""
        model = self._prepare_zo_model(super().call_model_init(trial), self.args.device)
        if hasattr(model, "add_model_tags"):
            model.add_model_tags(self._tag_names)
        return model

    def _reinit_zo_model(self, trial) -> None:
        """Rebuild the model from `model_init` at the start of `train()`, as `Trainer.train` does, but before the
        head options are applied, so that the linear probe fits the head of the model that then trains."""
        args = self.args
        enable_full_determinism(args.seed) if args.full_determinism else set_seed(args.seed)
        self.model = self.call_model_init(trial)
        self.optimizer, self.lr_scheduler = None, None
        if self.place_model_on_device:
            self._move_model_to_device(self.model, args.device)
        self.model_wrapped = self.model

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """`Trainer.save_model`; under FSDP2 every rank first takes part in gathering the whole weights, which the
        saving process writes as an ordinary Hugging Face folder (it loads without FSDP). A checkpoint under
        `fsdp_state_dict_type: SHARDED_STATE_DICT` holds each rank's shards instead, nothing gathered."""
        sharded = self.zo_plugin.shards_parameters and self.zo_plugin.fsdp_state_dict_type == "SHARDED_STATE_DICT"
        if sharded and getattr(self, "_zo_staging", False):  # a checkpoint (`_save_checkpoint` stages it)
            output_dir = output_dir if output_dir is not None else self.args.output_dir
            save_sharded_checkpoint(self.model, output_dir)
            if self.args.should_save:
                self._zo_save_beside_the_weights(output_dir)
            return
        if self.zo_plugin.shards_parameters:
            options = StateDictOptions(full_state_dict=True, cpu_offload=True)
            whole = get_model_state_dict(self.model, options=options)
            # Tied names share one tensor again, as in the unsharded model, so that `save_pretrained` keeps one.
            first_name = {}
            for name, param in self.model.named_parameters(remove_duplicate=False):
                first = first_name.setdefault(id(param), name)
                if first != name and first in whole and name in whole:
                    whole[name] = whole[first]
            self._zo_full_state_dict = whole
        try:
            super().save_model(output_dir, _internal_call=_internal_call)
        finally:
            self._zo_full_state_dict = None

    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        """`Trainer._save`; a model with offloaded blocks writes its weights from their storage shard by shard, so
        that saving holds the resident modules and a shard of the blocks, never the whole model. Under FSDP2 it
        writes the weights gathered by :meth:`save_model`."""
        if state_dict is None and self._zo_full_state_dict is not None:
            state_dict = self._zo_full_state_dict
        if self.zo_offloader is None or state_dict is not None or not isinstance(self.model, PreTrainedModel):
            return super()._save(output_dir, state_dict)  # a PEFT model saves its adapter alone
        if not self.args.should_save:
            return None
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        os.makedirs(output_dir, exist_ok=True)
        # Shards of two blocks, and nothing here keeps the state dict: `save_pretrained` drops each tensor once its
        # shard is written, and the storage's pages go with it.
        self.model.save_pretrained(
            output_dir,
            state_dict=self.zo_offloader.saving_state_dict(self.model),
            max_shard_size=2 * self.zo_offloader.largest_block_bytes,
        )
        self._zo_save_beside_the_weights(output_dir)
        return None

    def _zo_save_beside_the_weights(self, output_dir: str) -> None:
        """What `Trainer._save` writes beside the weights: the tokenizer and the training arguments."""
        tokenizer = self.processing_class or getattr(self.data_collator, "tokenizer", None)
        if tokenizer is not None:
            tokenizer.save_pretrained(output_dir)
        torch.save(self.args, os.path.join(output_dir, TRAINING_ARGS_NAME))

    def _load_from_checkpoint(self, resume_from_checkpoint, model=None) -> None:
        """`Trainer._load_from_checkpoint`; under FSDP2 each rank loads its shards of the checkpoint's weights, saved
        whole or in shards (`hf_zo.parallel.fsdp.load_saved_shards`)."""
        if not self.zo_plugin.shards_parameters:
            return super()._load_from_checkpoint(resume_from_checkpoint, model)
        load_saved_shards(self.model if model is None else model, resume_from_checkpoint)
        return None

    def get_train_dataloader(self):
        """`Trainer.get_train_dataloader`, sharded by data-parallel rank (`zo_plugin`): the ranks of one
        perturbation-parallel group see the same batches."""
        return self.zo_plugin.prepare_data_loader(super().get_train_dataloader())

    def _wrap_model(self, model, training: bool = True, dataloader=None):
        """Never wrap the model for gradient synchronisation: ZO replicas exchange scalars (`zo_plugin`), and DDP
        would allocate and all-reduce model-sized gradient buckets for nothing."""
        model = super()._wrap_model(model, training=False, dataloader=dataloader)
        if training and model is self.model:
            # Mixed precision and compilation only; marks the model prepared so `accelerator.prepare` keeps it bare.
            model = self.accelerator.prepare_model(model, evaluation_mode=True)
        return model
