"""Trajectories: a zeroth-order fine-tune as a few kilobytes of seeds and scalars, replayable bitwise.

Every ZO update is a sum of regenerable noise terms, so each optimizer step is fully described by the seeds of its
estimates, their projected gradients and the learning rate and weight decay of each parameter group. A
:class:`ZOTrajectory` is that list, plus a header naming the base model, the optimizer and its hyper-parameters, the
trainable parameters and checksums of their values before and after training (`format`), and the few tensors that
neither the seeds nor the base model's checkpoint give back: a PEFT adapter's start, a new or fitted head, a
first-order head's end (`base`). `ZOTrainer` records one
with every run (`callback`); :func:`replay` applies it to the base model and returns the trained weights, bitwise on
the device type the run was recorded on (`replay`); :func:`push_trajectory_to_hub` shares it instead of weights
(`hub`).
"""

from .callback import ZOTrajectoryCallback
from .format import (
    FORMAT_VERSION,
    TRAJECTORY_NAME,
    TrajectoryFormatError,
    TrajectoryMismatchError,
    ZOTrajectory,
    ZOTrajectoryStep,
)
from .hub import push_trajectory_to_hub, trajectory_model_card
from .replay import replay

__all__ = [
    "FORMAT_VERSION",
    "TRAJECTORY_NAME",
    "TrajectoryFormatError",
    "TrajectoryMismatchError",
    "ZOTrajectory",
    "ZOTrajectoryCallback",
    "ZOTrajectoryStep",
    "push_trajectory_to_hub",
    "replay",
    "trajectory_model_card",
]
