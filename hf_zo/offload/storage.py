"""Storage tiers: where the offloaded tensors of each block live between their visits to the working device.

- `CPUStorage`: host memory, page-locked (pinned) when CUDA is available so that uploads are asynchronous.
- `DiskStorage`: one safetensors file per block, memory-mapped shared and writable, so the at-rest tensors are
  file-backed pages (not anonymous memory) and write-back updates the file in place. Each file stays a valid
  safetensors file that `safetensors.safe_open` can read. The files live in a folder of the storage's own, created
  inside the chosen directory and removed with the storage, so a user's files there are never touched.

A storage returns, for each block, one *at-rest view* per tensor; the tensor's module parameter points at that view
whenever the block is not on the working device, so `state_dict()`, `load_state_dict()` and saving work unchanged.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import shutil
import tempfile
import warnings
import weakref
from abc import ABC, abstractmethod
from collections.abc import Sequence

import numpy
import torch
from safetensors.torch import save_file
from transformers.utils import logging

from ..pages import release_mapped
from ..safetensors_files import SAFETENSORS_DTYPES, read_safetensors_header

logger = logging.get_logger(__name__)

OFFLOAD_TIERS = ("cpu", "disk")
_BLOCK_FILE = re.compile(r"block_\d{5}\.safetensors")


class BlockStorage(ABC):
    """Base class of the storage tiers.

    Subclasses implement :meth:`store_block`, which receives the block's named tensors (already in their storage
    dtype) and returns their at-rest views, in the same order.
    """

    @abstractmethod
    def store_block(self, block: int, named_tensors: Sequence[tuple[str, torch.Tensor]]) -> list[torch.Tensor]:
        """Keep the tensors of block `block` and return their at-rest views."""

    @abstractmethod
    def close(self) -> None:
        """Release what the storage owns (files it created); the at-rest views must not be used afterwards."""

    @abstractmethod
    def release_pages(self, views: Sequence[torch.Tensor]) -> None:
        """Take the pages of at-rest `views` out of the process's resident set, once their block is done with; the
        values stay."""

    @abstractmethod
    def saving_views(self, block: int) -> list[torch.Tensor]:
        """Views of block `block`'s tensors for saving them, whose pages leave the resident set with the views."""


class CPUStorage(BlockStorage):
    """Blocks kept in host memory, pinned when `pin_memory` (asynchronous host-to-device copies).

    Args:
        pin_memory (`bool`, *optional*): pin the copies; defaults to `torch.cuda.is_available()`.
    """

    def __init__(self, pin_memory: bool | None = None):
        self.pin_memory = torch.cuda.is_available() if pin_memory is None else pin_memory
        self._views: dict[int, list[torch.Tensor]] = {}

    def store_block(self, block, named_tensors):
        views = []
        for _, tensor in named_tensors:
            view = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu", pin_memory=self.pin_memory)
            views.append(view.copy_(tensor))
        self._views[block] = views
        return views

    def release_pages(self, views: Sequence[torch.Tensor]) -> None:
        """Host copies are the tier itself: nothing to hand back."""

    def saving_views(self, block: int) -> list[torch.Tensor]:
        """The at-rest views themselves (host memory, resident either way)."""
        return self._views[block]

    def close(self) -> None:
        """Host copies are plain tensors: they go with the last reference to the at-rest views."""


class DiskStorage(BlockStorage):
    """Blocks kept in safetensors files (`block_00000.safetensors`, ...) mapped into memory, shared and writable.

    The files go in a new folder of this storage's own, uniquely named (`hf_zo-offload-XXXXXXXX`), inside
    `directory`: the storage never writes, overwrites or deletes anything it did not create, so a user's files in
    `directory` are left untouched and several storages (the ranks of a multi-process run, or concurrent runs) can
    share one `directory`.

    Args:
        directory (`str`, *optional*):
            The folder in which the storage's own folder is created; created if missing. Defaults to the system's
            temporary directory. The block files and the storage's own folder are removed by :meth:`close`, or when
            the storage is garbage-collected or the process exits, whichever comes first, and with them the folders
            of `directory` that this storage had to create, when they are empty; an existing `directory` is left
            in place.

    Attributes:
        directory (`str`): the storage's own folder, where the block files live.
        paths (`list[str]`): the block files written so far.
    """

    PREFIX = "hf_zo-offload-"
    """Name prefix of the storage's own folder."""

    LOCK_NAME = ".owner.lock"
    """A file in the storage's folder, locked (`flock`) while the storage lives."""

    def __init__(self, directory: str | None = None):
        root = tempfile.gettempdir() if directory is None else os.path.abspath(directory)
        # The folders on the way to `root` that do not exist yet, deepest first: the storage creates them, so they
        # may go with it (only while empty: anything put in them later is not ours).
        created = []
        parent = root
        while not os.path.lexists(parent) and os.path.dirname(parent) != parent:
            created.append(parent)
            parent = os.path.dirname(parent)
        # A unique folder of our own (mode 0o700), so block names never meet a user's files or another storage's.
        try:
            for attempt in range(3):
                os.makedirs(root, exist_ok=True)
                try:
                    self.directory = tempfile.mkdtemp(prefix=self.PREFIX, dir=root)
                    break
                except FileNotFoundError:  # another storage that had created `root` removed it in between
                    if attempt == 2:
                        raise
        except OSError as error:
            _remove_folders(created)
            raise OSError(
                f"zo_offload_dir {root!r} is not a writable folder ({error.strerror or error}); choose a folder you "
                "can write to, on a local disk with room for the model's blocks."
            ) from None
        self.root = root
        self.paths: list[str] = []
        self._names: dict[int, list[str]] = {}
        # Held for the storage's life: the kernel releases it when the process ends, however it ends, which is how
        # a later storage tells a killed run's folder from a live one. The file takes its name only once locked, so
        # another storage cleaning `root` never finds it unlocked while its owner lives.
        unnamed_lock = os.path.join(self.directory, self.LOCK_NAME + ".new")
        self._lock = open(unnamed_lock, "w")
        fcntl.flock(self._lock, fcntl.LOCK_EX)
        self._lock_path = os.path.join(self.directory, self.LOCK_NAME)
        os.rename(unnamed_lock, self._lock_path)
        # Mapped files stay readable after unlinking, so the files and the folders the storage created can go when
        # the storage does, or at the latest when the process exits: a user's zo_offload_dir keeps none of them.
        self._folders = [self.directory, *created]
        weakref.finalize(self, _remove, self.paths, self._folders, self._lock, self._lock_path)
        _remove_abandoned(root, keep=self.directory)

    def store_block(self, block, named_tensors):
        path = os.path.join(self.directory, f"block_{block:05d}.safetensors")
        names = [name for name, _ in named_tensors]
        if len(set(names)) != len(names):
            raise ValueError(f"Tensor names of block {block} must be unique, got {names}.")
        needed = sum(tensor.numel() * tensor.element_size() for _, tensor in named_tensors)
        free = shutil.disk_usage(self.directory).free
        if free < needed:
            raise OSError(
                f"zo_offload_dir {self.root!r} has {free / 2**20:.1f} MiB free but block {block} needs "
                f"{needed / 2**20:.1f} MiB; free some space or choose another zo_offload_dir (or zo_offload='cpu')."
            )
        if path not in self.paths:
            self.paths.append(path)  # before writing: a partly written file is ours to remove too
        save_file({name: tensor.detach().contiguous().cpu() for name, tensor in named_tensors}, path)
        self._names[block] = names
        return _map_safetensors(path, names)

    def release_pages(self, views: Sequence[torch.Tensor]) -> None:
        """Drop the pages of `views` (shared mappings of the block files) from the resident set; the files keep
        every write."""
        for view in views:
            release_mapped(view, shared=True)

    def saving_views(self, block: int) -> list[torch.Tensor]:
        """Read-only mappings of block `block`'s file of their own: each view's pages leave the resident set when the
        view is freed, so a save that drops each tensor once written holds a shard, not the model."""
        path = os.path.join(self.directory, f"block_{block:05d}.safetensors")
        return _map_safetensors(path, self._names[block], mode="r")

    def close(self) -> None:
        _remove(self.paths, self._folders, self._lock, self._lock_path)


def _remove(paths: list[str], folders: list[str], lock=None, lock_path: str | None = None) -> None:
    """Delete the lock file `lock_path` (then close `lock`, its open file) and the block files `paths`, then each of
    `folders` (in order) that is empty, and empty both lists."""
    if lock is not None and not lock.closed:
        with contextlib.suppress(FileNotFoundError):
            os.remove(lock_path)
        lock.close()
    for path in paths:
        with contextlib.suppress(FileNotFoundError):
            os.remove(path)
    paths.clear()
    _remove_folders(folders)


def _remove_abandoned(root: str, keep: str) -> None:
    """Remove the storage folders in `root` that a killed process left behind (a process that ends normally removes
    its own): those whose lock file is not held. Only the files a storage writes there are deleted; a folder holding
    anything else stays, and so does one without a lock file (a storage between its folder and its lock)."""
    for entry in os.scandir(root):
        if (
            not entry.name.startswith(DiskStorage.PREFIX)
            or entry.path == keep
            or not entry.is_dir(follow_symlinks=False)
        ):
            continue
        try:
            with open(os.path.join(entry.path, DiskStorage.LOCK_NAME), "r+") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)  # raises while the owner lives
                names = os.listdir(entry.path)
                if all(n == DiskStorage.LOCK_NAME or _BLOCK_FILE.fullmatch(n) for n in names):
                    for name in names:
                        os.remove(os.path.join(entry.path, name))
                    os.rmdir(entry.path)
                    logger.warning(f"Removed {entry.path}, the block files of an offloaded run that was killed.")
        except OSError:  # held by a live storage, no lock file, or not ours to remove
            continue


def _remove_folders(folders: list[str]) -> None:
    """`rmdir` each of `folders` in order (children before parents), emptying the list; a folder that is gone
    already or holds files that are not ours stays, and so do its parents."""
    for folder in folders:
        try:
            os.rmdir(folder)
        except FileNotFoundError:
            continue
        except OSError:
            break
    folders.clear()


def _map_safetensors(path: str, names: Sequence[str], mode: str = "r+") -> list[torch.Tensor]:
    """Views of the tensors `names` of the safetensors file `path`, each backed by its own shared memory map
    (distinct storages, so `save_pretrained` does not mistake them for tied weights): writable with `mode="r+"`,
    read-only with `"r"`."""
    header, base = read_safetensors_header(path)
    views = []
    for name in names:
        entry = header[name]
        dtype = SAFETENSORS_DTYPES[entry["dtype"]]
        start, stop = entry["data_offsets"]
        if stop == start:
            views.append(torch.empty(entry["shape"], dtype=dtype))
            continue
        itemsize = torch.empty((), dtype=dtype).element_size()
        if (base + start) % itemsize:
            raise RuntimeError(
                f"Tensor {name!r} of {path} is not aligned to its {itemsize}-byte elements and cannot be mapped; "
                "this safetensors version orders tensors differently. Use zo_offload='cpu' instead."
            )
        mapped = numpy.memmap(path, dtype=numpy.uint8, mode=mode, offset=base + start, shape=(stop - start,))
        if mode == "r":
            with warnings.catch_warnings():  # torch warns that the array is not writable; nothing writes to it
                warnings.simplefilter("ignore", UserWarning)
                views.append(torch.from_numpy(mapped).view(dtype).view(entry["shape"]))
        else:
            views.append(torch.from_numpy(mapped).view(dtype).view(entry["shape"]))
    return views


def build_storage(tier: str, directory: str | None = None) -> BlockStorage:
    """The storage for `tier` (`"cpu"` or `"disk"`); `directory` is used by the disk tier only."""
    if tier == "cpu":
        return CPUStorage()
    if tier == "disk":
        return DiskStorage(directory)
    raise ValueError(f"Unknown offload tier {tier!r}; choose one of {OFFLOAD_TIERS}.")
