"""Crash-safe checkpoints: a checkpoint folder appears under its final name only once it is complete.

`ZOTrainer` lets `Trainer` write each checkpoint into a staging folder, then publishes it with one atomic rename
after syncing it to disk. A process killed at any moment leaves either the previous checkpoints untouched and a
stale staging folder (ignored by `get_last_checkpoint`, cleared by the next save), or the new checkpoint complete.
Final saves of the model replace files one by one with atomic renames, so no file is ever half-written.
Before a run resumes, :func:`check_resumable` reads every file of the checkpoint that resuming loads, so that a
damaged or missing one is named instead of failing deep inside a loader or, worse, resuming another run.
"""

from __future__ import annotations

import fnmatch
import json
import os
import shutil
import zipfile
from pathlib import Path

import torch
from safetensors import safe_open
from transformers.trainer import SCALER_NAME, SCHEDULER_NAME, TRAINER_STATE_NAME
from transformers.trainer_pt_utils import safe_globals
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
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
