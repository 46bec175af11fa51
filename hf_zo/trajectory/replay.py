"""`replay`: rebuild the trained weights from the base model and a trajectory."""

from __future__ import annotations

import copy
import inspect
import os

import torch
from tqdm.auto import tqdm
from transformers.utils import logging

from ..noise import Noise
from ..optim import ZOOptimizer
from ..peft_warnings import peft_warnings_ignored
from .format import TrajectoryMismatchError, ZOTrajectory, from_json, optimizer_class, trajectory_tensors

logger = logging.get_logger(__name__)


def check_replayable(trajectory: ZOTrajectory) -> None:
    """Raise a `ValueError` saying why :func:`replay` cannot rebuild `trajectory`'s run, if it cannot (before a
    caller loads a base model for nothing)."""
    reason = trajectory.replayable()
    if reason is not None:
        raise ValueError(f"This trajectory cannot be replayed: {reason}.")


def replay(
    model: torch.nn.Module,
    trajectory: ZOTrajectory | str | os.PathLike,
    verify: bool = True,
    show_progress: bool = False,
) -> torch.nn.Module:
    """Apply a trajectory to its base model: the result is the trained model.

    First restores the start of the run (see :func:`initial_model`: the recorded PEFT adapter is added to a bare
    base model, and the stored initial tensors are written). Then rebuilds the recorded optimizer over the
    parameters (same groups and noise indices) and replays each step exactly as training ran it: the ``±eps`` moves
    of every estimate (they round, so they are part of the trajectory of the bits), then the update with the
    recorded lr and weight decay. Last, the tensors trained outside the ZO optimizer (a first-order head) take their
    stored end values. On the device type of the run the result is bitwise the trained weights, for stateful
    optimizers too (their state is rebuilt on the way).

    Args:
        model (`torch.nn.Module`):
            The base model the run started from, as `from_pretrained` loads it (the same `num_labels` for a
            classifier). For a PEFT run, the bare base model (the adapter is added) or a `PeftModel` holding the
            adapter as it was before training.
        trajectory (`ZOTrajectory` or path): the trajectory, or a file or folder holding one.
        verify (`bool`, defaults to `True`):
            Check the base against the recorded start checksum first, and the result against the end checksum
            (when the trajectory has one and runs on the recorded device type).
        show_progress (`bool`, defaults to `False`): show a progress bar over the steps.

    Returns:
        `torch.nn.Module`: the trained model: `model` itself, or for a PEFT run on a bare base model the new
        `PeftModel` around it.

    Raises:
        `TrajectoryMismatchError`: the base model or the result does not match the recorded checksums.
        `ValueError`: the trajectory cannot be replayed (the message says why).
    """
    if not isinstance(trajectory, ZOTrajectory):
        trajectory = ZOTrajectory.load(trajectory)
    check_replayable(trajectory)
    model = initial_model(model, trajectory)
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
        # Each micro-batch's sweeps, as the optimizer made them (two-point, one-sided around a centre, ...), without
        # the forwards: the same path a data-parallel rank takes for its peers' micro-batches.
        for first in range(0, len(step.seeds), optimizer.num_perturbations):
            optimizer.run_forwards(None, first)
        optimizer.records = step.records
        optimizer.step()
    optimizer.flush()
    _write_tensors(model, trajectory.final_tensors, "end")
    end = trajectory.header["checksums"]["end"]
    if verify and on_recorded_device and end is not None and end["step"] == trajectory.next_step:
        trajectory.verify(model, "end")
    return model


def initial_model(model: torch.nn.Module, trajectory: ZOTrajectory) -> torch.nn.Module:
    """`model`, the base of `trajectory`, as the recorded run started: with the recorded PEFT adapter added if it
    has none, and the stored initial tensors (adapter, new or fitted head) written into it.

    Args:
        model (`torch.nn.Module`): the base model (or a `PeftModel` with the initial adapter).
        trajectory (`ZOTrajectory`): the trajectory.

    Returns:
        `torch.nn.Module`: `model`, or the `PeftModel` wrapping it.
    """
    peft = trajectory.header["base_model"]["peft"]
    if peft and not hasattr(model, "peft_config"):
        if "initial_tensors" not in trajectory.header:
            raise ValueError(
                f"This trajectory trains a {peft['peft_type']} adapter and was recorded before format version 2, so "
                "it does not hold the adapter's initial weights: pass a PeftModel holding the adapter saved before "
                "training (PeftModel.from_pretrained(base, initial_adapter, is_trainable=True)), or for hf-zo replay "
                "that adapter's folder as BASE."
            )
        from peft import get_peft_config, get_peft_model

        # The adapter config names the base it is loaded onto now, as PEFT's own save does.
        name = getattr(getattr(model, "config", None), "_name_or_path", None)
        # A deep copy: PEFT extends the config's lists (modules_to_save) in place, which must not reach the header.
        config = get_peft_config(dict(copy.deepcopy(peft), inference_mode=False, base_model_name_or_path=name or None))
        # get_peft_model draws the adapter from the global RNG: the stored values replace it, the user's stream
        # stays untouched.
        with torch.random.fork_rng(devices=[]), peft_warnings_ignored():
            model = get_peft_model(model, config)
        # A classifier's PeftModel appends its head names to modules_to_save, which the recorded config already has.
        if config.modules_to_save:
            config.modules_to_save = list(dict.fromkeys(config.modules_to_save))
    _write_tensors(model, trajectory.initial_tensors, "start")
    return model


def _write_tensors(model: torch.nn.Module, tensors: dict[str, torch.Tensor], stage: str) -> None:
    named = dict(model.named_parameters())
    for name, value in tensors.items():
        parameter = named.get(name)
        if parameter is None or parameter.shape != value.shape:
            found = "has no such parameter" if parameter is None else f"has it with shape {list(parameter.shape)}"
            raise TrajectoryMismatchError(
                f"The trajectory stores the {stage} value of {name!r} with shape {list(value.shape)}, but the model "
                f"{found}: load the base model the run started from, with the same configuration (num_labels, ...)."
            )
        with torch.no_grad():
            parameter.copy_(value)


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
        # The run's restore (its rounding is part of the bits); a file from before it was recorded: the default.
        exact_restore=spec.get("exact_restore"),
        **{k: v for k, v in defaults.items() if k in accepted},
    )
