"""`replay`: rebuild the trained weights from the base model and a trajectory."""

from __future__ import annotations

import inspect
import os

import torch
from tqdm.auto import tqdm
from transformers.utils import logging

from ..noise import Noise
from ..optim import ZOOptimizer
from .format import ZOTrajectory, from_json, optimizer_class, trajectory_tensors

logger = logging.get_logger(__name__)


def replay(
    model: torch.nn.Module,
    trajectory: ZOTrajectory | str | os.PathLike,
    verify: bool = True,
    show_progress: bool = False,
) -> torch.nn.Module:
    """Apply a trajectory to its base model, in place: the result is the trained model.

    Rebuilds the recorded optimizer over `model`'s parameters (same groups and noise indices), then replays each
    step exactly as training ran it: the ``±eps`` moves of every estimate (they round, so they are part of the
    trajectory of the bits), then the update with the recorded lr and weight decay. On the device type of the run
    the result is bitwise the trained weights, for stateful optimizers too (their state is rebuilt on the way).

    Args:
        model (`torch.nn.Module`): the base model (for a PEFT run: with the initial adapter loaded, trainable).
        trajectory (`ZOTrajectory` or path): the trajectory, or a file or folder holding one.
        verify (`bool`, defaults to `True`):
            Check the base against the recorded start checksum first, and the result against the end checksum
            (when the trajectory has one and runs on the recorded device type).
        show_progress (`bool`, defaults to `False`): show a progress bar over the steps.

    Returns:
        `torch.nn.Module`: `model`, now holding the trained weights.

    Raises:
        `TrajectoryMismatchError`: the base model or the result does not match the recorded checksums.
        `ValueError`: the trajectory cannot be replayed (the message says why).
    """
    if not isinstance(trajectory, ZOTrajectory):
        trajectory = ZOTrajectory.load(trajectory)
    reason = trajectory.replayable()
    if reason is not None:
        raise ValueError(f"This trajectory cannot be replayed: {reason}.")
    if verify:
        trajectory.verify(model, "start")
    optimizer = _build_optimizer(trajectory, trajectory_tensors(model, trajectory.header))
    on_recorded_device = optimizer.params.tensors[0][1].device.type == trajectory.header["device_type"]
    if not on_recorded_device:
        logger.warning(
            "Replaying a trajectory recorded on %s on %s: %s, so the result may not match the trained weights "
            "bitwise.",
            trajectory.header["device_type"],
            optimizer.params.tensors[0][1].device.type,
            "the 'torch' noise algorithm draws different noise on each device type"
            if optimizer.noise.algorithm == "torch"
            else "the noise is the same but the update arithmetic may round differently",
        )
    optimizer.zo_step = trajectory.first_step
    for step in tqdm(
        trajectory.steps(), total=len(trajectory), desc="Replaying", unit="step", disable=not show_progress
    ):
        for group, lr, weight_decay in zip(optimizer.param_groups, step.lrs, step.weight_decays):
            group["lr"], group["weight_decay"] = lr, weight_decay
        for seed in step.seeds:
            optimizer.estimator.estimate(_no_loss, seed)
        optimizer.records = step.records
        optimizer.step()
    optimizer.flush()
    end = trajectory.header["checksums"]["end"]
    if verify and on_recorded_device and end is not None and end["step"] == trajectory.next_step:
        trajectory.verify(model, "end")
    return model


def _no_loss() -> float:
    return 0.0


def _build_optimizer(trajectory: ZOTrajectory, tensors: dict[str, torch.Tensor]) -> ZOOptimizer:
    """The recorded optimizer, over `tensors` (by name), with the recorded groups, noise indices and settings."""
    spec = trajectory.header["optimizer"]
    cls = optimizer_class(spec["class"])
    groups = [dict(from_json(hyper), params=[], indices=[]) for hyper in trajectory.header["param_groups"]]
    for parameter in trajectory.header["parameters"]:
        groups[parameter["group"]]["params"].append(tensors[parameter["name"]])
        groups[parameter["group"]]["indices"].append(parameter["index"])
    defaults = from_json(spec["defaults"])
    accepted = set(inspect.signature(cls.__init__).parameters) - set(inspect.signature(ZOOptimizer).parameters)
    return cls(
        groups,
        lr=defaults["lr"],
        eps=spec["eps"],
        weight_decay=defaults["weight_decay"],
        noise=Noise(**spec["noise"]),
        num_perturbations=spec["num_perturbations"],
        seed=spec["seed"],
        **{k: v for k, v in defaults.items() if k in accepted},
    )
