"""Crash-safe checkpoints: a checkpoint folder appears under its final name only once it is complete.

`ZOTrainer` lets `Trainer` write each checkpoint into a staging folder, then publishes it with one atomic rename
after syncing it to disk. A process killed at any moment leaves either the previous checkpoints untouched and a
stale staging folder (ignored by `get_last_checkpoint`, cleared by the next save), or the new checkpoint complete.
Final saves of the model replace files one by one with atomic renames, so no file is ever half-written.
Before a run resumes, :func:`check_resumable` reads every file of the checkpoint that resuming loads, so that a
damaged or missing one is named instead of failing deep inside a loader or, worse, resuming another run.

:class:`ZOCheckpointingMixin` holds the `Trainer` overrides that do this, with the Hub staging that goes with them.
"""

from __future__ import annotations

import contextlib
import fnmatch
import json
import os
import shutil
import zipfile
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import safe_open
from transformers.trainer import SCALER_NAME, SCHEDULER_NAME, TRAINER_STATE_NAME
from transformers.trainer_pt_utils import safe_globals
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, get_last_checkpoint, rotate_checkpoints
from transformers.utils import (
    ADAPTER_CONFIG_NAME,
    ADAPTER_SAFE_WEIGHTS_NAME,
    ADAPTER_WEIGHTS_NAME,
    CONFIG_NAME,
    SAFE_WEIGHTS_INDEX_NAME,
    SAFE_WEIGHTS_NAME,
    WEIGHTS_INDEX_NAME,
    WEIGHTS_NAME,
)

from ..heads import HEAD_OPTIMIZER_NAME
from ..trajectory import TRAJECTORY_NAME

STAGING_DIR_NAME = ".zo-staging"
"""Folder, inside the run directory, where checkpoints are written before they are published."""


SAVE_TMP_DIR_NAME = ".zo-save-tmp"
"""Folder, inside the folder a model is saved to, where its files are written before they are moved in."""


def staging_dir(run_dir: str | os.PathLike) -> Path:
    """The staging folder of `run_dir`."""
    return Path(run_dir) / STAGING_DIR_NAME


def _fsync_tree(folder: Path) -> None:
    for path in sorted(folder.rglob("*")):
        if path.is_file():
            with open(path, "rb") as handle:
                os.fsync(handle.fileno())
    _fsync_dir(folder)


def _fsync_dir(folder: Path) -> None:
    descriptor = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


REPLACED_SUFFIX = ".replaced"
"""Suffix of the name an older checkpoint of the same step holds while `publish_checkpoint` replaces it."""


def publish_checkpoint(staged: str | os.PathLike, final: str | os.PathLike) -> None:
    """Move the complete checkpoint `staged` to `final` atomically (replacing an older `final` of the same name)."""
    staged, final = Path(staged), Path(final)
    _fsync_tree(staged)
    replaced = None
    if final.exists():
        replaced = final.with_name(final.name + REPLACED_SUFFIX)
        shutil.rmtree(replaced, ignore_errors=True)
        os.replace(final, replaced)
    os.replace(staged, final)
    _fsync_dir(final.parent)
    if replaced is not None:
        shutil.rmtree(replaced, ignore_errors=True)


def clean_interrupted_saves(run_dir: str | os.PathLike) -> None:
    """Clear what saves killed part-way left in `run_dir`, so that no later push or resume picks it up.

    The staging folder and a model save's temporary folder hold only files that were never published: removed.
    A `checkpoint-N.replaced` folder is the complete older checkpoint of step N, left by a `publish_checkpoint`
    killed between its two renames. If `checkpoint-N` is missing the new one never moved in: the older one is
    renamed back, so it is resumable again (and not counted as an extra checkpoint by the rotation, whose pattern it
    matches). Otherwise the new one is in place and the older copy is removed, as the publish would have done.
    """
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return
    for unpublished in (STAGING_DIR_NAME, SAVE_TMP_DIR_NAME):
        shutil.rmtree(run_dir / unpublished, ignore_errors=True)
    for replaced in sorted(run_dir.glob(f"checkpoint-*{REPLACED_SUFFIX}")):
        final = replaced.with_name(replaced.name[: -len(REPLACED_SUFFIX)])
        if final.exists():
            shutil.rmtree(replaced, ignore_errors=True)
        else:
            os.replace(replaced, final)


def replace_files_atomically(source: str | os.PathLike, target: str | os.PathLike) -> None:
    """Move every file of folder `source` into `target` with one atomic rename each, then remove `source`."""
    source, target = Path(source), Path(target)
    _fsync_tree(source)
    for path in sorted(source.rglob("*")):
        if path.is_file():
            destination = target / path.relative_to(source)
            destination.parent.mkdir(parents=True, exist_ok=True)
            os.replace(path, destination)
    _fsync_dir(target)
    shutil.rmtree(source, ignore_errors=True)


OPTIMIZER_STATE_NAME = "optimizer.pt"
"""The file of a checkpoint holding the ZO optimizer's state, its step counter included (`Trainer`'s name)."""

GLOBAL_STEP_KEY = "hf_zo_global_step"
"""The entry of the optimizer state that `ZOTrainer` saves with its `global_step` (the ZO step counter itself runs on
across `train()` calls, so it is not the trainer's step): what shows that `optimizer.pt` and `trainer_state.json` come
from one save."""

RESUMED_FILE_PATTERNS = (
    TRAINER_STATE_NAME,
    OPTIMIZER_STATE_NAME,
    SCHEDULER_NAME,
    SCALER_NAME,
    "rng_state*.pth",
    HEAD_OPTIMIZER_NAME,
    CONFIG_NAME,
    SAFE_WEIGHTS_NAME,
    SAFE_WEIGHTS_INDEX_NAME,
    "model-*-of-*.safetensors",
    WEIGHTS_NAME,
    WEIGHTS_INDEX_NAME,
    "pytorch_model-*-of-*.bin",
    ADAPTER_CONFIG_NAME,
    ADAPTER_SAFE_WEIGHTS_NAME,
    ADAPTER_WEIGHTS_NAME,
)
"""The files at a checkpoint's top level that `Trainer` and hf_zo load when a run resumes from it."""


def check_resumable(checkpoint: str | os.PathLike) -> None:
    """Fail, naming the file, when the checkpoint folder `checkpoint` lacks its optimizer state or holds a file that
    cannot be read (truncated, or with a damaged header).

    The ZO optimizer's step counter seeds every perturbation, so a checkpoint without `optimizer.pt` would resume
    with other perturbations than the run's; `Trainer` would skip the missing file silently. The files resuming loads
    (:data:`RESUMED_FILE_PATTERNS`) are read as their loaders read them; tensor files are opened, not loaded
    (`safe_open`, `torch.load(mmap=True)`): a changed byte inside a tensor is caught later, by the checksum of the
    checkpoint's trajectory. Other files (a callback's own state, say) are only checked to be whole archives, never
    unpickled: their classes are their owner's business, and resuming does not read them.

    Raises:
        `ValueError`: naming the checkpoint, the file and what to do.
    """
    folder = Path(checkpoint)
    advice = "Resume from another checkpoint, or train into a new output_dir."
    if not (folder / OPTIMIZER_STATE_NAME).is_file():
        raise ValueError(
            f"Checkpoint {folder} has no {OPTIMIZER_STATE_NAME}, which holds the ZO optimizer's step counter: "
            f"resumed without it, the run would draw other perturbations than the ones it was trained with. {advice}"
        )
    for path in sorted(folder.iterdir()):
        if not path.is_file() or path.name == TRAJECTORY_NAME:
            continue  # subfolders are their loaders' business; a trajectory checks itself against the weights
        resumed = any(fnmatch.fnmatch(path.name, pattern) for pattern in RESUMED_FILE_PATTERNS)
        try:
            if path.suffix == ".safetensors":  # a header of JSON: reading it runs no code of the file
                with safe_open(path, framework="pt") as tensors:
                    list(tensors.keys())
            elif not resumed:
                _check_archive(path)
            elif path.suffix == ".json":
                json.loads(path.read_text())
            elif path.suffix in (".pt", ".pth", ".bin"):
                with safe_globals():  # the numpy arrays of Trainer's RNG states
                    torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except Exception as error:  # each reader has its own error types; all mean the same here
            raise ValueError(
                f"Checkpoint {folder} cannot be resumed: {path.name} is damaged or truncated "
                f"({type(error).__name__}: {error}). {advice}"
            ) from error


def _check_archive(path: Path) -> None:
    """Read the table of contents of `path` if it is a zip archive (what `torch.save` writes): a truncated one has
    lost it. Nothing is unpickled, and a file in any other format is left alone."""
    with open(path, "rb") as handle:
        if handle.read(4) != b"PK\x03\x04":
            return
    with zipfile.ZipFile(path) as archive:
        archive.namelist()


SAVED_RUN_PATTERNS = (
    f"{PREFIX_CHECKPOINT_DIR}-*",
    TRAJECTORY_NAME,
    "trainer_state.json",
    CONFIG_NAME,
    "adapter_config.json",
    "tokenizer_config.json",
    "*.safetensors",
    "pytorch_model*.bin",
    "adapter_model.*",
)
"""Names that mark a folder as holding a saved run or model (checkpoints, weights, configs, a trajectory)."""


def saved_run_files(folder: str | os.PathLike) -> list[str]:
    """The entries of `folder` that belong to a saved run or model (:data:`SAVED_RUN_PATTERNS`), sorted; empty for
    a missing folder or one that holds only other files (notes, data)."""
    if not os.path.isdir(folder):
        return []
    return sorted(name for name in os.listdir(folder) if any(fnmatch.fnmatch(name, p) for p in SAVED_RUN_PATTERNS))


class GlobalStepStamp:
    """Stamps the trainer's `global_step` into the state a ZO optimizer saves (:data:`GLOBAL_STEP_KEY`), and takes it
    back out when a state is loaded.

    The ZO step counter seeds the perturbations and runs on across `train()` calls, while `global_step` starts again at
    0 in each, so the two differ after a first call; the step saved with the state is what shows that
    `trainer_state.json` and `optimizer.pt` come from the same save.

    Args:
        global_step (`Callable[[], int]`): reads the trainer's current `global_step`.

    Attributes:
        loaded_step (`int` or `None`): the step stamped in the state last loaded (`None`: none loaded since
            :meth:`expect_load`, or a state saved before stamps existed).
    """

    def __init__(self, global_step: Callable[[], int]):
        self._global_step = global_step
        self._handles: list = []
        self.loaded_step: int | None = None

    def attach(self, optimizer: torch.optim.Optimizer) -> None:
        """Stamp the states `optimizer` saves and read the stamp of those it loads (instead of a previous
        optimizer's)."""
        for handle in self._handles:
            handle.remove()
        self._handles = [
            optimizer.register_state_dict_post_hook(self._stamp),
            optimizer.register_load_state_dict_pre_hook(self._take),
        ]

    def expect_load(self) -> None:
        """Forget the stamp read so far, before a checkpoint's state is loaded."""
        self.loaded_step = None

    def _stamp(self, optimizer, state_dict) -> None:
        state_dict[GLOBAL_STEP_KEY] = self._global_step()

    def _take(self, optimizer, state_dict) -> None:
        self.loaded_step = state_dict.pop(GLOBAL_STEP_KEY, None)


class ZOCheckpointingMixin:
    """The `Trainer` overrides that make checkpoints crash-safe and carry the ZO state, with their Hub staging.

    A checkpoint is written by `Trainer` into a staging folder, published with one atomic rename, then pushed; a
    final `save_model` replaces files one atomic rename each; a checkpoint to resume from is checked first, and its
    ZO optimizer state must be of the same step as its `trainer_state.json`.

    Mixed into `ZOTrainerMixin`, ahead of a `transformers.Trainer`. Its own state, set up by
    :meth:`_init_zo_checkpointing`:

    - `_zo_staging` (`bool`): `True` while `Trainer._save_checkpoint` runs, so that `_get_output_dir` hands it the
      staging folder, `save_model` writes in place and `_push_from_checkpoint` waits for the publish;
    - `_zo_step_stamp` (:class:`GlobalStepStamp`): the step saved with, and loaded from, the optimizer state.

    It calls the trainer's `flush_pending_update()` and reads `zo_optimizer`, `zo_heads` and `zo_trajectory_callback`.
    """

    _zo_staging: bool = False

    def _init_zo_checkpointing(self) -> None:
        """Set up the mixin's state; called once, before the trainer builds or is given an optimizer."""
        self._zo_staging = False
        self._zo_step_stamp = GlobalStepStamp(lambda: self.state.global_step)

    def _prepare_zo_checkpoints(self, resume_from_checkpoint: str | bool | None) -> None:
        """Before training: clear what killed saves left in `output_dir`, and check the checkpoint to resume from."""
        if self.args.should_save:
            clean_interrupted_saves(self.args.output_dir)
        self.accelerator.wait_for_everyone()
        if resume_from_checkpoint:
            checkpoint = resume_from_checkpoint
            if checkpoint is True:
                checkpoint = get_last_checkpoint(self.args.output_dir)
            if checkpoint is not None and os.path.isdir(checkpoint):  # else Trainer names what is missing
                check_resumable(checkpoint)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """`Trainer.save_model` of the true (flushed) weights; used by checkpoints too.

        Outside checkpoints (which are published atomically as a whole), the files are written to a temporary
        folder and moved into `output_dir` one atomic rename each, so a crash never leaves a half-written file. With
        `push_to_hub`, a call from user code then pushes `output_dir`, as `Trainer.save_model` does.
        """
        self.flush_pending_update()
        output_dir = output_dir or self.args.output_dir
        target = output_dir
        if not self._zo_staging and self.args.should_save:
            output_dir = os.path.join(target, SAVE_TMP_DIR_NAME)
            shutil.rmtree(output_dir, ignore_errors=True)
        # Trainer's push waits until the files are in `target`: from inside it would upload the temporary folder.
        super().save_model(output_dir, _internal_call=True)
        self.zo_trajectory_callback.save(output_dir, self.model, write=self.args.should_save)
        if self.args.should_save:
            if output_dir != target:
                replace_files_atomically(output_dir, target)
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)

    def _get_output_dir(self, trial) -> str:
        run_dir = super()._get_output_dir(trial)
        return str(staging_dir(run_dir)) if self._zo_staging else run_dir

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        """`Trainer._save_optimizer_and_scheduler`, and the first-order head's AdamW state next to the ZO state."""
        super()._save_optimizer_and_scheduler(output_dir)
        if self.args.should_save:
            self.zo_heads.save_checkpoint(output_dir)

    def _push_from_checkpoint(self, checkpoint_folder: str) -> None:
        """`Trainer._push_from_checkpoint`, except for a staged checkpoint: `_save_checkpoint` pushes it once it is
        published (the upload runs in the background, and the staged folder is renamed away as soon as it is
        complete; it would also put the staging folder into the `every_save` upload of the output directory)."""
        if not self._zo_staging:
            super()._push_from_checkpoint(checkpoint_folder)

    def _save_checkpoint(self, model, trial) -> None:
        """`Trainer._save_checkpoint`, written to a staging folder, published with one atomic rename, then pushed to
        the Hub (with `push_to_hub`)."""
        run_dir = super()._get_output_dir(trial)
        staging = staging_dir(run_dir)
        if self.args.should_save:
            clean_interrupted_saves(run_dir)  # a killed save's staged files: never published, incomplete
        self.accelerator.wait_for_everyone()
        self._zo_staging = True
        try:
            super()._save_checkpoint(model, trial)
        finally:
            self._zo_staging = False
        self.accelerator.wait_for_everyone()
        if self.args.should_save:
            name = f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
            staged, final = staging / name, os.path.join(run_dir, name)
            if self.state.best_model_checkpoint == str(staged):
                self.state.best_model_checkpoint = final
                self.state.save_to_json(str(staged / TRAINER_STATE_NAME))
            publish_checkpoint(staged, final)
            with contextlib.suppress(OSError):  # emptied by the publish; a run folder keeps only its checkpoints
                staging.rmdir()
            if self.args.push_to_hub:
                self._push_from_checkpoint(final)
            rotate_checkpoints(
                output_dir=run_dir,
                save_total_limit=self.args.save_total_limit,
                best_model_checkpoint=self.state.best_model_checkpoint,
                use_mtime=True,
            )
        self.accelerator.wait_for_everyone()

    def _load_from_checkpoint(self, resume_from_checkpoint, model=None) -> None:
        """`Trainer._load_from_checkpoint`, with a clear error when the checkpoint belongs to another model."""
        try:
            super()._load_from_checkpoint(resume_from_checkpoint, model)
        except RuntimeError as error:
            lines = [line.strip() for line in str(error).splitlines() if line.strip()]
            mismatch = next((line for line in lines if "size mismatch" in line), None)
            if mismatch is None:
                raise
            raise ValueError(
                f"Checkpoint {resume_from_checkpoint} was saved from a different model or adapter ({mismatch}). "
                "Resume with the model and PEFT config that wrote it, or train into a new output_dir."
            ) from None

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        """`Trainer._load_optimizer_and_scheduler`; the trajectory saved in `checkpoint` is then continued."""
        self._zo_step_stamp.expect_load()
        super()._load_optimizer_and_scheduler(checkpoint)
        if checkpoint is not None:
            saved_step = self._zo_step_stamp.loaded_step
            if saved_step is None:  # saved before the state recorded it, when both counters ran together
                saved_step = self.zo_optimizer.zo_step
            if saved_step != self.state.global_step:
                raise ValueError(
                    f"Checkpoint {checkpoint} does not hold one state: {TRAINER_STATE_NAME} is at step "
                    f"{self.state.global_step} but the ZO optimizer of {OPTIMIZER_STATE_NAME} was saved at step "
                    f"{saved_step}, so one of them was changed or replaced. Resume from another checkpoint, or train "
                    "into a new output_dir."
                )
        self.zo_trajectory_callback.continue_from(checkpoint)

    def init_hf_repo(self, token: str | None = None, private: bool | None = None) -> None:
        """`Trainer.init_hf_repo`, failing with what to do when the Hub repository cannot be created or reached.

        With `push_to_hub=True`, `Trainer` creates the repository when it is constructed, before any training (and
        `push_to_hub()` does when it is called without); without network this was a traceback from the HTTP client.
        """
        try:
            super().init_hf_repo(token=token, private=private)
        except Exception as error:  # network, DNS, auth or permission: all end in the same advice, with the cause
            repo = self.args.hub_model_id or os.path.basename(os.path.abspath(self.args.output_dir))
            raise ConnectionError(
                f"The Hub repository {repo!r} could not be created or reached ({type(error).__name__}: {error}); "
                "nothing was uploaded. Check the network and the token (HF_TOKEN or hub_token); to train without "
                "the Hub, set push_to_hub=False and upload output_dir later."
            ) from error

    def create_model_card(self, *args, tags: str | list[str] | None = None, **kwargs) -> None:
        """`Trainer.create_model_card` with the trainer's tags (`_tag_names`: `zeroth-order`, `hf-zo`) added."""
        tags = [tags] if isinstance(tags, str) else list(tags or [])
        tags += [t for t in self._tag_names if t not in tags]
        super().create_model_card(*args, tags=tags, **kwargs)
