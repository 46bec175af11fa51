"""`ZOTrajectoryCallback`: how `ZOTrainer` records a run's trajectory, across checkpoints and resumes."""

from __future__ import annotations

import os
from pathlib import Path

import torch
from transformers import TrainerCallback
from transformers.utils import logging

from ..optim import ZOOptimizer
from .format import TRAJECTORY_NAME, TrajectoryFormatError, ZOTrajectory, checksum, trajectory_tensors

logger = logging.get_logger(__name__)


class ZOTrajectoryCallback(TrainerCallback):
    """Records the trajectory of a `ZOTrainer` run; `ZOTrainer` adds it and saves its trajectory with the model.

    On a resumed run it continues the trajectory saved in the checkpoint (name it with :meth:`continue_from` before
    training), so the trajectory of a resumed run is the whole run.

    Attributes:
        trajectory (`ZOTrajectory`): the trajectory being recorded, once training has begun.
        resume_from (`str`): the checkpoint folder training resumes from, if any.
    """

    def __init__(self):
        self.trajectory: ZOTrajectory | None = None
        self.resume_from: str | None = None
        self._handle = None
        self._sharded = False

    def continue_from(self, checkpoint: str | None) -> None:
        """Continue the trajectory saved in the checkpoint folder `checkpoint` when training begins (`None`: start
        one, or go on with the one recorded so far)."""
        self.resume_from = checkpoint

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        while optimizer is not None and not isinstance(optimizer, ZOOptimizer):
            optimizer = getattr(optimizer, "optimizer", None)
        if optimizer is None or model is None:
            return
        # Under FSDP2 every process records the trajectory (the same records), so that each takes part in gathering
        # the whole weights for its checksums.
        self._sharded = optimizer.params.sharded
        if self._handle is not None:
            self._handle.remove()
        if self.trajectory is None or self.trajectory.next_step != optimizer.zo_step:
            self.trajectory = self._resumed_trajectory(optimizer, model) or ZOTrajectory.start(model, optimizer)
        others = self.trajectory.header.get("trained_outside", [])
        if others:
            logger.info(
                "%d trainable parameters (%s, ...) are not updated by the ZO optimizer: the trajectory stores their "
                "values at each save.",
                len(others),
                others[0],
            )
        self._handle = self.trajectory.attach(optimizer)

    def _resumed_trajectory(self, optimizer: ZOOptimizer, model: torch.nn.Module) -> ZOTrajectory | None:
        if self.resume_from is None:
            return None
        path = Path(self.resume_from) / TRAJECTORY_NAME
        if not path.is_file():
            logger.warning(
                "Checkpoint %s has no %s: the trajectory starts at step %d from the checkpoint's weights.",
                self.resume_from,
                TRAJECTORY_NAME,
                optimizer.zo_step,
            )
            return None
        try:
            trajectory = ZOTrajectory.load(path)
        except TrajectoryFormatError as error:
            logger.warning("%s The trajectory starts again at step %d.", error, optimizer.zo_step)
            return None
        if trajectory.next_step != optimizer.zo_step:
            logger.warning(
                "%s ends before step %d but the optimizer resumes at step %d: starting a new trajectory there.",
                path,
                trajectory.next_step,
                optimizer.zo_step,
            )
            return None
        recorded = trajectory.header["optimizer"]["noise"]["algorithm"]
        if recorded != optimizer.noise.algorithm:
            logger.warning(
                "%s was recorded with the %r noise algorithm but the run resumes with %r: starting a new trajectory "
                "at step %d.",
                path,
                recorded,
                optimizer.noise.algorithm,
                optimizer.zo_step,
            )
            return None
        self._check_resumed_weights(trajectory, model)
        trajectory.header["checksums"]["end"] = None
        return trajectory

    def _check_resumed_weights(self, trajectory: ZOTrajectory, model: torch.nn.Module) -> None:
        """Fail when the weights loaded from the checkpoint are not those its trajectory ended with: a weights file
        changed after the save (a damaged byte, or another run's file copied in) would otherwise be trained on."""
        end = trajectory.header["checksums"]["end"]
        if end is None or end.get("step") != trajectory.next_step:
            return
        actual = checksum(trajectory_tensors(model, trajectory.header))
        if actual["sha256"] == end["sha256"]:
            return
        differ = [name for name, digest in actual["parameters"].items() if digest != end["parameters"].get(name)]
        raise ValueError(
            f"The weights loaded from checkpoint {self.resume_from} are not those its {TRAJECTORY_NAME} recorded at "
            f"step {trajectory.next_step}: {len(differ)} of {len(actual['parameters'])} trained tensors differ "
            f"({', '.join(differ[:3])}{' and more' if len(differ) > 3 else ''}). Its weights file was changed or "
            "damaged after the save. Resume from another checkpoint, or train into a new output_dir."
        )

    def on_train_end(self, args, state, control, **kwargs):
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
        best = state.best_model_checkpoint
        if args.load_best_model_at_end and best is not None and (Path(best) / TRAJECTORY_NAME).is_file():
            # Trainer reloaded the best checkpoint's weights: their trajectory is the one that checkpoint holds.
            self.trajectory = ZOTrajectory.load(Path(best) / TRAJECTORY_NAME)

    def save(self, output_dir: str | os.PathLike, model: torch.nn.Module, write: bool = True) -> Path | None:
        """Write the trajectory, with the end checksum of `model` (flushed), into `output_dir`, if recording.

        Call it on every process: under FSDP2 each takes part in gathering the weights for the checksum, and only
        those with `write` (the saving process) write the file; without FSDP2 the others do nothing.
        """
        if self.trajectory is None or not (write or self._sharded):
            return None
        if not write:
            self.trajectory.record_end(model)
            return None
        return self.trajectory.save(output_dir, model)
