"""The checks `ZOTrainer` makes of its set-up that `ZOConfig` alone cannot: each needs the model, the data, the
launched processes or the optimizer. Each rule is one function that fails with the bad value and the fix; the trainer
calls them at construction or at the start of `train()`, so that a wrong set-up fails before any step.

The rules on `ZOConfig`'s fields alone are checked where the config is built (`hf_zo.training.config`).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Collection, Mapping

import torch
from transformers import TrainingArguments
from transformers.utils import logging

from ..models.quantized import SUPPORTED_QUANT_METHODS, quant_method, quantization_record
from ..optim import ZOOptimizer
from ..parallel.mesh import ZOMesh

logger = logging.get_logger(__name__)

__all__ = [
    "check_optimizer_leaves_out_heads",
    "check_output_dir_is_not_the_model",
    "check_parallel_mode",
    "check_quantized_base",
    "check_sampling_fits_layout",
    "check_train_dataset",
    "check_trainable",
]


def check_trainable(model: torch.nn.Module) -> None:
    """Fail when `model` has no trainable parameter: there would be nothing for ZO to update."""
    if not any(p.requires_grad for p in model.parameters()):
        raise ValueError(
            f"{type(model).__name__} has no trainable parameters (every requires_grad is False), so there is nothing "
            "for ZO to update. For PEFT, wrap the model with peft.get_peft_model(model, config); for full "
            "fine-tuning, call model.requires_grad_(True)."
        )


def check_quantized_base(model: torch.nn.Module, offload: str | None) -> None:
    """Fail when `model` has a quantized base that ZO cannot train on: one quantized by another library than
    bitsandbytes (`SUPPORTED_QUANT_METHODS`: the others' weight tensors are not tested, and torchao's cannot be read
    as plain tensors), one without a PEFT adapter (full-parameter ZO would perturb the full-precision remainder,
    embeddings and norms, and none of the quantized weights, which cannot take a small update), or one whose blocks
    are offloaded (`offload`: the storage tiers copy plain tensors, not quantized ones with their scales). A PEFT
    adapter on a bitsandbytes base trains: ZO perturbs the adapter only, in full precision, and no quantized weight
    is ever written."""
    method = quant_method(model)
    if method is None:
        return
    if method not in SUPPORTED_QUANT_METHODS:
        raise ValueError(
            f"{type(model).__name__} is quantized with {method}, and ZO supports bases quantized with "
            f"{list(SUPPORTED_QUANT_METHODS)} only. Load it with BitsAndBytesConfig(load_in_8bit=True) or "
            "BitsAndBytesConfig(load_in_4bit=True) instead (--load_in_8bit / --load_in_4bit in the examples)."
        )
    if not hasattr(model, "peft_config"):
        raise ValueError(
            f"{type(model).__name__} is quantized ({_quantization_name(model)}), and full-parameter ZO cannot train "
            "a quantized base: its 4-bit or 8-bit weights cannot take a small update. Train an adapter on it, as "
            "QLoRA does: peft.get_peft_model(model, LoraConfig(...)), `--peft lora` in examples/train.py, "
            "`--use_peft` in examples/sft.py; or load the model in full precision (no quantization_config)."
        )
    if offload is not None:
        raise ValueError(
            f"zo_offload={offload!r} cannot store the blocks of a quantized base ({_quantization_name(model)}): the "
            "offload tiers copy plain tensors, not quantized weights with their scales. Set zo_offload=None (the "
            "quantized base is what keeps the model small), or load the model in full precision."
        )


def _quantization_name(model: torch.nn.Module) -> str:
    record = quantization_record(model) or {}
    bits = "4-bit" if record.get("load_in_4bit") else "8-bit" if record.get("load_in_8bit") else None
    return " ".join(filter(None, [quant_method(model), bits]))


def check_parallel_mode(args: TrainingArguments, world_size: int) -> None:
    """Fail when several processes were launched but `TrainingArguments` set up a single-process state: each
    process would then evaluate the whole set, log and save on its own."""
    if world_size > 1 and args.world_size != world_size:
        raise ValueError(
            f"{world_size} processes were launched, but Accelerate's state is "
            f"{getattr(args.distributed_state, 'distributed_type', None)} with world size {args.world_size}, so "
            "evaluation, logging and saving would not be coordinated. On CPUs set ACCELERATE_USE_CPU=true (or "
            "use_cpu=True); with GPUs, give each process its own device."
        )


def check_sampling_fits_layout(args: TrainingArguments, mesh: ZOMesh) -> None:
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


def check_output_dir_is_not_the_model(model: torch.nn.Module, output_dir: str) -> None:
    """Fail when training would save into the folder the model was loaded from: the pretrained weights would be
    overwritten, and the run's trajectory could no longer be replayed onto them."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    source = getattr(getattr(base, "config", None), "_name_or_path", None)
    if source and os.path.isdir(source) and os.path.realpath(source) == os.path.realpath(output_dir):
        raise ValueError(
            f"output_dir {output_dir!r} is the folder the model was loaded from: saving there would overwrite the "
            "pretrained weights the run starts from. Choose another output_dir."
        )


def check_train_dataset(
    dataset,
    collate: Callable[[list], Mapping],
    label_names: Collection[str] = (),
    columns: Collection[str] | None = None,
) -> None:
    """Fail when the training `dataset` is empty, or when the batch that `collate` makes of its first example (kept
    to `columns`, the model's inputs, if given) holds none of `label_names`: ZO needs a loss, and the model would
    compute none. Empty `label_names`: the loss needs no labels (a model or `compute_loss` that takes it from the
    inputs).

    A best-effort check made at construction, not mid-training: a data set without a length is not checked, and a
    collator that fails on one example is left to fail in the dataloader, with its full context.
    """
    try:
        size = len(dataset)
    except TypeError:
        return
    if size == 0:
        raise ValueError("train_dataset is empty: ZOTrainer needs at least one training example.")
    if not label_names:
        return
    example = dataset[0]
    if not isinstance(example, Mapping):
        return
    if columns is not None:
        example = {k: v for k, v in example.items() if k in columns}
    try:
        batch = collate([example])
    except Exception as error:  # the dataloader will raise it with full context; this check is best effort
        logger.debug("Could not collate a probe batch (%s); label check skipped.", error)
        return
    if not any(name in batch for name in label_names):
        raise ValueError(
            f"The training batches have no labels (looked for {list(label_names)} in the collated batch, got "
            f"{sorted(batch)}). ZO needs a loss: add a 'label'/'labels' column, use a collator that creates "
            "labels (e.g. DataCollatorForLanguageModeling(tokenizer, mlm=False) for causal LM), or pass "
            "compute_loss_func."
        )


def check_optimizer_leaves_out_heads(
    optimizer: ZOOptimizer | None, model: torch.nn.Module, excluded: Collection[str], head_training: str
) -> None:
    """Fail when the ZO `optimizer` (one passed in `optimizers=`) holds parameters of a head trained first-order
    (their names: `excluded`): they would be perturbed by ZO and stepped by the head's AdamW both."""
    if optimizer is None or not excluded:
        return
    held = {id(p) for group in optimizer.param_groups for p in group["params"]}
    both = sorted(name for name, p in model.named_parameters() if name in excluded and id(p) in held)
    if both:
        raise ValueError(
            f"The ZO optimizer passed in optimizers=(...) holds {both}, the parameters of the head that "
            f"zo_head_training={head_training!r} trains first-order with AdamW, so they would be "
            "updated twice per step. Build the optimizer without them, e.g. "
            "ZOSGD([p for n, p in model.named_parameters() if p.requires_grad and n not in "
            f"{sorted(excluded)}]), leave `optimizers` unset so ZOTrainer builds it, or set "
            "zo_head_training='zeroth_order'."
        )
