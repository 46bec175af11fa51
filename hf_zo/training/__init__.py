"""What `ZOTrainer` (`hf_zo.trainer`) is built from: its arguments (`config`, and what the trainer does with those it
is given: `arguments`), the learning rate and eps chosen by what the model trains (`defaults`), the checks of its
set-up (`checks`), the parameter groups of its optimizer (`param_groups`), its pending updates (`pending_updates`),
and the mixins of `ZOTrainerMixin` beside the ZO hooks: crash-safe checkpoints (`checkpointing`), the order of the
examples (`sampling`) and the placement of model and data under the distributed layout (`layout`)."""

from .config import HEAD_INIT_CHOICES, HEAD_TRAINING_CHOICES, ZOConfig
from .defaults import (
    LABEL_WORD_LORA_TARGET_DEFAULTS,
    LABEL_WORD_METHOD_DEFAULTS,
    METHOD_DEFAULTS,
    OPTIMIZER_METHOD_DEFAULTS,
    PROMPT_LORA_LAYERS_LEFT_OUT,
    PROMPT_LORA_TARGET_MODULES,
    PROMPT_ZO_DEFAULTS,
    MethodDefaults,
    fill_method_defaults,
    prompt_lora_layers,
    prompt_lora_target_modules,
    trained_method,
)
from .sampling import LengthSortedSampler, SamplerEpochCallback, ZOLengthGroupedSampler

__all__ = [
    "HEAD_INIT_CHOICES",
    "HEAD_TRAINING_CHOICES",
    "LABEL_WORD_LORA_TARGET_DEFAULTS",
    "LABEL_WORD_METHOD_DEFAULTS",
    "LengthSortedSampler",
    "METHOD_DEFAULTS",
    "OPTIMIZER_METHOD_DEFAULTS",
    "PROMPT_LORA_LAYERS_LEFT_OUT",
    "PROMPT_LORA_TARGET_MODULES",
    "PROMPT_ZO_DEFAULTS",
    "MethodDefaults",
    "SamplerEpochCallback",
    "ZOConfig",
    "ZOLengthGroupedSampler",
    "fill_method_defaults",
    "prompt_lora_layers",
    "prompt_lora_target_modules",
    "trained_method",
]
