"""`ZOSFTTrainer`: TRL's `SFTTrainer` with zeroth-order (MeZO-style) optimization.

`ZOSFTTrainer` is :class:`~hf_zo.trainer.ZOTrainerMixin` over `trl.SFTTrainer`, as `ZOTrainer` is over
`transformers.Trainer`: TRL prepares the data (language modelling, conversational, prompt-completion, packing),
loads the model and applies `peft_config`; the ZO wiring trains it. The few hooks here only keep SFT's training
metrics right under ZO (docs/trl.md). Needs TRL: ``pip install "hf_zo[trl]"``.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from dataclasses import dataclass, field

import torch

try:
    from trl import SFTConfig, SFTTrainer
except ImportError as error:
    raise ImportError(
        'ZOSFTTrainer and ZOSFTConfig need TRL, which is not installed: pip install "hf_zo[trl]"'
    ) from error

from .models.quantized import is_quantized
from .trainer import ZOTrainerMixin
from .training import ZOConfig

__all__ = [
    "ZOSFTConfig",
    "ZOSFTTrainer",
    "adapter_back_to_float32",
    "check_sft_options",
    "labelled_positions_only_on_cpu",
]


@contextlib.contextmanager
def labelled_positions_only_on_cpu():
    """Within this context, TRL's fused LM head projects only the positions that have a label on the CPU too.

    `SFTTrainer`'s loss goes through TRL's fused LM head, which projects the hidden states of the positions whose
    label is not -100 only on Triton devices, and every position elsewhere, so that compiled backends see fixed tile
    shapes. Eager CPU code compiles nothing, and with a completion-only loss most positions are the prompt's, whose
    projection is then most of a loss forward's cost beyond the backbone (docs/results/trl.md). The scores of the
    labelled positions are the same; the other positions' are zero either way. Other devices keep TRL's choice.
    Relies on TRL's private `trl.trainer.utils._use_triton` (TRL 1.16, the lowest release hf_zo[trl] allows, is
    the first to have it).
    """
    from trl.trainer import utils as trl_utils

    chooses_compact = trl_utils._use_triton
    trl_utils._use_triton = lambda device: chooses_compact(device) or torch.device(device).type == "cpu"
    try:
        yield
    finally:
        trl_utils._use_triton = chooses_compact


def adapter_back_to_float32(model: torch.nn.Module) -> list[str]:
    """Cast back to float32 the trainable tensors of a quantized base's adapter that `SFTTrainer` cast to bfloat16.

    On a quantized base (QLoRA) `SFTTrainer` casts the adapter to bfloat16, following the QLoRA paper's recipe for
    first-order training. ZO moves every trainable weight by ``±eps z`` and back, and adds updates of the order of the
    learning rate: in bfloat16 (8 bits of mantissa) those moves round, and small updates vanish. PEFT itself keeps
    a quantized base's adapter in float32, which this restores (the values are those of the cast, so a run starts the
    same each time).

    Returns:
        `list[str]`: the names of the tensors cast back.
    """
    cast = []
    for name, parameter in model.named_parameters():
        if parameter.requires_grad and parameter.dtype == torch.bfloat16:
            parameter.data = parameter.data.to(torch.float32)
            cast.append(name)
    return cast


def check_sft_options(args: SFTConfig) -> None:
    """Fail on the `SFTConfig` options that need a backward pass, which ZO training never runs.

    Raises:
        ValueError: naming the option and the value to set.
    """
    refused = {
        "activation_offloading": "it offloads the activations kept for the backward pass (and ZO's training step "
        "does not enter SFTTrainer's offloading context)",
        "gradient_checkpointing": "it recomputes activations for the backward pass; ZO keeps none to save",
        "activation_checkpointing": "it recomputes activations for the backward pass; ZO keeps none to save",
        "use_liger_kernel": "Liger's kernels are written for first-order training; TRL deprecates the option for "
        "Hub kernels (model_init_kwargs={'use_kernels': True})",
    }
    for name, reason in refused.items():
        if getattr(args, name, False):
            raise ValueError(
                f"{name}=True is not supported by ZOSFTTrainer: {reason}. ZO runs forward passes only; set "
                f"{name}=False."
            )


@dataclass
class ZOSFTConfig(ZOConfig, SFTConfig):
    """Configuration class for [`ZOSFTTrainer`]: every argument of `ZOConfig` (the `zo_*` options and ZO's defaults,
    e.g. a learning rate chosen by what the model trains) and of TRL's `SFTConfig` (the data and the model loading).

    Where both set a default, `ZOConfig`'s holds. Gradient checkpointing is off by default (TRL turns it on);
    `gradient_checkpointing` / `activation_checkpointing`, `activation_offloading` and `use_liger_kernel` set to
    `True` are refused (:func:`check_sft_options`).

    Parameters that change from `SFTConfig`:
        gradient_checkpointing (`bool`, *optional*, defaults to `None`, i.e. off):
            transformers' deprecated alias of `activation_checkpointing`; must stay off: ZO runs no backward pass.
    """

    gradient_checkpointing: bool | None = field(
        default=None, metadata={"help": "Must stay off: ZO runs no backward pass, so nothing is recomputed."}
    )

    def __post_init__(self):
        check_sft_options(self)
        super().__post_init__()


class ZOSFTTrainer(ZOTrainerMixin, SFTTrainer):
    """Trainer for zeroth-order supervised fine-tuning: a drop-in replacement for `trl.SFTTrainer`.

    Each training step is `ZOTrainer`'s: two-point estimates on the loss `SFTTrainer.compute_loss` computes (over
    the completion or assistant tokens when `completion_only_loss` / `assistant_only_loss` say so). SFT's training
    metrics (`entropy`, `mean_token_accuracy`, `num_tokens`) are recorded once per micro-batch, from its first
    forward, which runs on perturbed weights; the other forwards of the micro-batch record none. On the CPU, TRL's
    fused LM head projects only the labelled positions (:func:`labelled_positions_only_on_cpu`). On a quantized base
    (`model_init_kwargs={"quantization_config": ...}`, or `--load_in_4bit` in examples/sft.py) the adapter stays in
    float32, where TRL would cast it to bfloat16 (:func:`adapter_back_to_float32`).

    Args:
        model (`str`, `PreTrainedModel` or `PeftModel`): the model, or its name to load, as for `SFTTrainer`.
        args (`ZOSFTConfig`, *optional*): training arguments; an `SFTConfig` or `TrainingArguments` is converted.
        **kwargs: any other `SFTTrainer` argument (`train_dataset`, `processing_class`, `peft_config`, ...).
    """

    _tag_names = [*ZOTrainerMixin._tag_names, *SFTTrainer._tag_names]
    _zo_config_class = ZOSFTConfig
    _zo_forwards: int | None = None  # forwards of the current ZO micro-batch; None outside training_step

    def create_accelerator_and_postprocess(self) -> None:
        """`ZOTrainerMixin.create_accelerator_and_postprocess`, after undoing the bfloat16 cast `SFTTrainer` gives the
        adapter of a quantized base (:func:`adapter_back_to_float32`)."""
        if self._zo_model_pending and self.model is not None and is_quantized(self.model):
            adapter_back_to_float32(self.model)
        super().create_accelerator_and_postprocess()

    def training_step(self, model, inputs, num_items_in_batch=None) -> torch.Tensor:
        """`ZOTrainerMixin.training_step`, counting its forwards so that SFT's metrics are recorded once."""
        self._zo_forwards = 0
        try:
            return super().training_step(model, inputs, num_items_in_batch)
        finally:
            self._zo_forwards = None

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """`SFTTrainer.compute_loss`; in a ZO training step, whose forwards run in eval mode, its metrics go to the
        training metrics from the first forward and nowhere from the others."""
        if self._zo_forwards is None:  # evaluation and prediction
            with self._labelled_positions_only():
                return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        first = self._zo_forwards == 0
        self._zo_forwards += 1
        kept = self._metrics
        if first:
            # SFTTrainer counts the tokens in train mode only; ZO's forwards run in eval mode.
            self._total_train_tokens += self._count_tokens(inputs) // self._tp_size
            self._metrics = {"train": kept["train"], "eval": kept["train"]}
        else:
            self._metrics = {"train": defaultdict(list), "eval": defaultdict(list)}
        try:
            with self._labelled_positions_only():
                return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        finally:
            self._metrics = kept

    def _labelled_positions_only(self):
        """:func:`labelled_positions_only_on_cpu`, unless the model is compiled (TRL's fixed shapes then hold)."""
        return contextlib.nullcontext() if self.args.torch_compile else labelled_positions_only_on_cpu()

    def _count_tokens(self, inputs: dict) -> int:
        """The tokens of this micro-batch over all processes, as `SFTTrainer.compute_loss` counts them."""
        if "attention_mask" in inputs:
            local = inputs["attention_mask"].sum()
        else:  # padding-free batches carry position_ids instead
            local = torch.tensor(inputs["position_ids"].size(1), device=inputs["position_ids"].device)
        return int(self.accelerator.gather_for_metrics(local).sum().item())

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """`SFTTrainer.log`, which reads the training metrics while the model is in train mode: ZO's training steps
        leave it in eval mode."""
        model = self.model
        training = "loss" in logs and not model.training
        with contextlib.ExitStack() as stack:
            if training:
                model.train()
                stack.callback(model.eval)
            super().log(logs, start_time)
