"""hf_zo: zeroth-order fine-tuning for the Hugging Face stack."""

from .estimator import LazyParameters, SPSAEstimator, ZORecord
from .models import (
    PooledEncoderConfig,
    PooledEncoderForSequenceClassification,
    load_sequence_classifier,
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
        from . import sft

        return getattr(sft, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "TRAJECTORY_NAME",
    "TrajectoryFormatError",
    "TrajectoryMismatchError",
    "ZOTrajectory",
    "ZOTrajectoryCallback",
    "ZOTrajectoryStep",
    "push_trajectory_to_hub",
    "replay",
    "DistZOPlugin",
    "PooledEncoderConfig",
    "PooledEncoderForSequenceClassification",
    "load_sequence_classifier",
    "FZOO",
    "HiZOO",
    "LazyParameters",
    "LOZO",
    "Noise",
    "NoiseUpdate",
    "SPSAEstimator",
    "ZOAdam",
    "ZOConfig",
    "ZOOptimizer",
    "ZORecord",
    "ZOSGD",
    "ZOSGDConservative",
    "ZOSGDMomentum",
    "ZOSGDSign",
    "ZOTrainer",
    "ZO_OPTIMIZERS",
    "perturb_",
    "restore_and_update_",
]
