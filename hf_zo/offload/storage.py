"""Storage tiers: where the offloaded tensors of each block live between their visits to the working device.

- `CPUStorage`: host memory, page-locked (pinned) when CUDA is available so that uploads are asynchronous.
- `DiskStorage`: one safetensors file per block, memory-mapped shared and writable, so the at-rest tensors are
  file-backed pages (not anonymous memory) and write-back updates the file in place. Each file stays a valid
  safetensors file that `safetensors.safe_open` can read.

A storage returns, for each block, one *at-rest view* per tensor; the tensor's module parameter points at that view
whenever the block is not on the working device, so `state_dict()`, `load_state_dict()` and saving work unchanged.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import struct
import tempfile
import weakref
from abc import ABC, abstractmethod
from collections.abc import Sequence

import numpy
import torch
from safetensors.torch import save_file

OFFLOAD_TIERS = ("cpu", "disk")


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


class CPUStorage(BlockStorage):
    """Blocks kept in host memory, pinned when `pin_memory` (asynchronous host-to-device copies).

    Args:
        pin_memory (`bool`, *optional*): pin the copies; defaults to `torch.cuda.is_available()`.
    """

    def __init__(self, pin_memory: bool | None = None):
        self.pin_memory = torch.cuda.is_available() if pin_memory is None else pin_memory

    def store_block(self, block, named_tensors):
        views = []
        for _, tensor in named_tensors:
            view = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu", pin_memory=self.pin_memory)
            views.append(view.copy_(tensor))
        return views

    def close(self) -> None:
        """Host copies are plain tensors: they go with the last reference to the at-rest views."""


class DiskStorage(BlockStorage):
    """Blocks kept in safetensors files (`block_00000.safetensors`, ...) mapped into memory, shared and writable.

    Args:
        directory (`str`, *optional*):
            Where the files go. Defaults to a new temporary directory. The block files are removed by
            :meth:`close`, or when the storage is garbage-collected or the process exits, whichever comes first, and
            with them the directory if this storage created it; an existing directory is left in place.
    """

    def __init__(self, directory: str | None = None):
        # A folder this storage creates (a temporary one, or a zo_offload_dir that did not exist) goes with it.
        self._owns_directory = directory is None or not os.path.exists(directory)
        self.directory = tempfile.mkdtemp(prefix="hf_zo_offload_") if directory is None else directory
        try:
            os.makedirs(self.directory, exist_ok=True)
            tempfile.TemporaryFile(dir=self.directory).close()  # probe: can we create files there?
        except OSError as error:
            raise OSError(
                f"zo_offload_dir {self.directory!r} is not a writable folder ({error.strerror or error}); choose a "
                "folder you can write to, on a local disk with room for the model's blocks."
            ) from None
        self.paths: list[str] = []
        # Mapped files stay readable after unlinking, so the files (and a directory of our own) can go when the
        # storage does, or at the latest when the process exits: a user's zo_offload_dir keeps none of them.
        weakref.finalize(self, _remove, self.paths, self.directory if self._owns_directory else None)

    def store_block(self, block, named_tensors):
        path = os.path.join(self.directory, f"block_{block:05d}.safetensors")
        names = [name for name, _ in named_tensors]
        if len(set(names)) != len(names):
            raise ValueError(f"Tensor names of block {block} must be unique, got {names}.")
        needed = sum(tensor.numel() * tensor.element_size() for _, tensor in named_tensors)
        free = shutil.disk_usage(self.directory).free
        if free < needed:
            raise OSError(
                f"zo_offload_dir {self.directory!r} has {free / 2**20:.1f} MiB free but block {block} needs "
                f"{needed / 2**20:.1f} MiB; free some space or choose another zo_offload_dir (or zo_offload='cpu')."
            )
        save_file({name: tensor.detach().contiguous().cpu() for name, tensor in named_tensors}, path)
        self.paths.append(path)
        return _map_safetensors(path, names)

    def close(self) -> None:
        _remove(self.paths, self.directory if self._owns_directory else None)


def _remove(paths: list[str], directory: str | None) -> None:
    """Delete the block files `paths` (emptying the list) and then `directory`, when given and empty."""
    for path in paths:
        if os.path.exists(path):
            os.remove(path)
    paths.clear()
    if directory is not None:
        with contextlib.suppress(OSError):  # gone already, or holding files that are not ours
            os.rmdir(directory)


_SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


def _map_safetensors(path: str, names: Sequence[str]) -> list[torch.Tensor]:
    """Writable views of the tensors `names` of the safetensors file `path`, each backed by its own shared memory
    map (distinct storages, so `save_pretrained` does not mistake them for tied weights)."""
    with open(path, "rb") as handle:
        (header_size,) = struct.unpack("<Q", handle.read(8))
        header = json.loads(handle.read(header_size))
    base = 8 + header_size
    views = []
    for name in names:
        entry = header[name]
        dtype = _SAFETENSORS_DTYPES[entry["dtype"]]
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
        mapped = numpy.memmap(path, dtype=numpy.uint8, mode="r+", offset=base + start, shape=(stop - start,))
        views.append(torch.from_numpy(mapped).view(dtype).view(entry["shape"]))
    return views


def build_storage(tier: str, directory: str | None = None) -> BlockStorage:
    """The storage for `tier` (`"cpu"` or `"disk"`); `directory` is used by the disk tier only."""
    if tier == "cpu":
        return CPUStorage()
    if tier == "disk":
        return DiskStorage(directory)
    raise ValueError(f"Unknown offload tier {tier!r}; choose one of {OFFLOAD_TIERS}.")
