"""hf_zo: zeroth-order fine-tuning for the Hugging Face stack."""

from importlib.util import find_spec as _find_spec

# First: importing it checks the installed transformers, peft, accelerate and torch against the tested ranges.
from .dependency_versions import EXTRA_RANGES as _EXTRA_RANGES
from .dependency_versions import check_dependency_versions as _check_dependency_versions
from .estimator import LazyParameters, SPSAEstimator, ZORecord
from .models import (
    PooledEncoderConfig,
    PooledEncoderForSequenceClassification,
    embedded_llm_path,
    is_norm_module,
    load_sequence_classifier,
    norm_module_names,
)
from .noise import Noise, NoiseUpdate, perturb_, restore_and_update_
from .optim import (
    FZOO,
    LOZO,
    ZO_OPTIMIZERS,
    ZOSGD,
    HiZOO,
    ZOAdam,
    ZOOptimizer,
    ZOSGDConservative,
    ZOSGDMomentum,
    ZOSGDSign,
)
from .parallel import DistZOPlugin
from .prompts import PromptClassification
from .trainer import ZOTrainer
from .training import ZOConfig
from .trajectory import (
    TRAJECTORY_NAME,
    TrajectoryFormatError,
    TrajectoryMismatchError,
    ZOTrajectory,
    ZOTrajectoryCallback,
    ZOTrajectoryStep,
    push_trajectory_to_hub,
    replay,
)

__version__ = "0.1.0"

_NEEDS_TRL = ("ZOSFTConfig", "ZOSFTTrainer")


def __getattr__(name: str):
    # Imported on first use, so that `import hf_zo` works without TRL (`pip install "hf_zo[trl]"`).
    if name in _NEEDS_TRL:
        if _find_spec("trl") is not None:
            _check_dependency_versions(_EXTRA_RANGES)
        from . import sft

        return getattr(sft, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    # trainers and their configurations
    "ZOTrainer",
    "ZOConfig",
    # optimizers
    "ZOOptimizer",
    "ZO_OPTIMIZERS",
    "ZOSGD",
    "ZOSGDMomentum",
    "ZOSGDSign",
    "ZOSGDConservative",
    "ZOAdam",
    "HiZOO",
    "LOZO",
    "FZOO",
    # distributed training and offload
    "DistZOPlugin",
    # models and tasks
    "PooledEncoderConfig",
    "PooledEncoderForSequenceClassification",
    "load_sequence_classifier",
    "embedded_llm_path",
    "norm_module_names",
    "is_norm_module",
    "PromptClassification",
    # trajectories
    "TRAJECTORY_NAME",
    "ZOTrajectory",
    "ZOTrajectoryStep",
    "ZOTrajectoryCallback",
    "TrajectoryFormatError",
    "TrajectoryMismatchError",
    "push_trajectory_to_hub",
    "replay",
    # the estimator and the noise, for custom loops and new optimizers
    "SPSAEstimator",
    "ZORecord",
    "LazyParameters",
    "Noise",
    "NoiseUpdate",
    "perturb_",
    "restore_and_update_",
]
if _find_spec("trl") is not None:  # imported on first use; listed only where `from hf_zo import *` can import them
    __all__ += list(_NEEDS_TRL)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_NEEDS_TRL))
