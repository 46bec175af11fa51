"""Crash-safe checkpoints: a checkpoint folder appears under its final name only once it is complete.

`ZOTrainer` lets `Trainer` write each checkpoint into a staging folder, then publishes it with one atomic rename
after syncing it to disk. A process killed at any moment leaves either the previous checkpoints untouched and a
stale staging folder (ignored by `get_last_checkpoint`, cleared by the next save), or the new checkpoint complete.
Final saves of the model replace files one by one with atomic renames, so no file is ever half-written.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

STAGING_DIR_NAME = ".zo-staging"
"""Folder, inside the run directory, where checkpoints are written before they are published."""


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


def publish_checkpoint(staged: str | os.PathLike, final: str | os.PathLike) -> None:
    """Move the complete checkpoint `staged` to `final` atomically (replacing an older `final` of the same name)."""
    staged, final = Path(staged), Path(final)
    _fsync_tree(staged)
    replaced = None
    if final.exists():
        replaced = final.with_name(final.name + ".replaced")
        shutil.rmtree(replaced, ignore_errors=True)
        os.replace(final, replaced)
    os.replace(staged, final)
    _fsync_dir(final.parent)
    if replaced is not None:
        shutil.rmtree(replaced, ignore_errors=True)


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
