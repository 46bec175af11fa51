"""What `ZOTrainer` (`hf_zo.trainer`) is built from: its arguments (`config`), the learning rate and eps chosen by
what the model trains (`defaults`), the order of the training examples (`sampling`) and crash-safe checkpoints
(`checkpointing`)."""

from .config import HEAD_INIT_CHOICES, HEAD_TRAINING_CHOICES, ZOConfig
from .defaults import METHOD_DEFAULTS, MethodDefaults, fill_method_defaults, trained_method
from .sampling import SamplerEpochCallback, ZOLengthGroupedSampler

__all__ = [
    "HEAD_INIT_CHOICES",
    "HEAD_TRAINING_CHOICES",
    "METHOD_DEFAULTS",
    "MethodDefaults",
    "SamplerEpochCallback",
    "ZOConfig",
    "ZOLengthGroupedSampler",
    "fill_method_defaults",
    "trained_method",
]
