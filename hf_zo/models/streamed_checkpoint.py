"""A local safetensors checkpoint read tensor by tensor, each tensor in memory of its own.

`from_pretrained` reads a checkpoint through one mapping of each file that stays open until loading ends, so every
page it has read stays resident: loading a float32 checkpoint into a base quantized on the fly holds the whole
float32 model at the end of loading, on top of the quantized one. :class:`StreamedCheckpoint` is a state dict for
`from_pretrained(None, config=..., state_dict=...)` whose values read their tensor from disk only when transformers
asks for it (`tensor[...]`, the way it reads safetensors' own lazy slices), into an anonymous mapping of its own that
goes back to the system as soon as the tensor is freed: once a weight is quantized, its float32 copy is gone. The
file layout read here is the safetensors format's (an 8-byte header length, a JSON header of dtypes, shapes and byte
offsets, the tensors' bytes).
"""

from __future__ import annotations

import json
import mmap
import os
from collections.abc import Iterator, Mapping

import torch

from ..heap import return_freed_memory
from ..safetensors_files import SAFETENSORS_DTYPES, read_safetensors_header

__all__ = ["StreamedCheckpoint", "StreamedTensor", "local_safetensors_files"]


_OWN_MAPPING_BYTES = 1 << 20
"""Tensors from this size up are read into an anonymous mapping of their own; smaller ones into ordinary memory."""


def local_safetensors_files(path: str | os.PathLike) -> list[str] | None:
    """The safetensors files of the checkpoint in the local folder `path` (the shards its index names, or its
    `model.safetensors`), or `None` when `path` is not such a folder (a Hub id, a PyTorch `.bin` checkpoint)."""
    path = os.fspath(path)
    if not os.path.isdir(path):
        return None
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index, encoding="utf-8") as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(path, shard) for shard in shards]
    single = os.path.join(path, "model.safetensors")
    return [single] if os.path.isfile(single) else None


class StreamedTensor:
    """One tensor of a safetensors file, read from disk each time it is indexed.

    Answers what transformers asks of safetensors' lazy slices: `get_dtype()` (the format's dtype name, such as
    `"F32"`), `get_shape()` and indexing (`tensor[...]` reads the whole tensor).
    """

    def __init__(self, file, name: str, dtype: str, shape: list[int], offset: int, nbytes: int):
        if dtype not in SAFETENSORS_DTYPES:
            raise ValueError(
                f"Tensor {name!r} of {file.name} has dtype {dtype!r}, which this reader does not know "
                f"(it reads {sorted(SAFETENSORS_DTYPES)}): load the checkpoint with `from_pretrained(path)` instead."
            )
        self._file = file
        self.name = name
        self._dtype = dtype
        self._shape = list(shape)
        self._offset = offset
        self._nbytes = nbytes

    def get_dtype(self) -> str:
        """The tensor's dtype as the safetensors format names it (`"F32"`, `"BF16"`, ...)."""
        return self._dtype

    def get_shape(self) -> list[int]:
        """The tensor's shape."""
        return list(self._shape)

    def __getitem__(self, index) -> torch.Tensor:
        return self.read()[index]

    def read(self) -> torch.Tensor:
        """The whole tensor, read from disk into memory of its own."""
        dtype = SAFETENSORS_DTYPES[self._dtype]
        return_freed_memory()
        if self._nbytes == 0:
            return torch.empty(self._shape, dtype=dtype)
        if self._nbytes >= _OWN_MAPPING_BYTES:
            buffer = mmap.mmap(-1, self._nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            self._read_into(memoryview(buffer))
            flat = torch.frombuffer(buffer, dtype=torch.uint8)
        else:
            flat = torch.empty(self._nbytes, dtype=torch.uint8)
            self._read_into(memoryview(flat.numpy()))
        return flat.view(dtype).view(self._shape)

    def _read_into(self, view: memoryview) -> None:
        done = 0
        while done < self._nbytes:
            read = os.preadv(self._file.fileno(), [view[done:]], self._offset + done)
            if read == 0:
                raise OSError(f"{self._file.name} ends inside tensor {self.name!r}: the file is truncated.")
            done += read


class StreamedCheckpoint(Mapping):
    """The tensors of local safetensors files by name, as :class:`StreamedTensor` s: a state dict for
    `from_pretrained(None, config=config, state_dict=checkpoint)` that reads each tensor only when it is loaded.

    Use it as a context manager, which closes the files. Copying it (`copy.deepcopy`) gives the same checkpoint.

    Args:
        files (`list[str]`): the safetensors files (all shards of one checkpoint).
    """

    def __init__(self, files: list[str]):
        self._files = []
        self._tensors: dict[str, StreamedTensor] = {}
        try:
            for path in files:
                file = open(path, "rb")  # noqa: SIM115 (closed by close())
                self._files.append(file)
                self._index(file, *read_safetensors_header(path))
        except BaseException:
            self.close()
            raise

    def _index(self, file, header: dict, start: int) -> None:
        for name, entry in header.items():
            if name == "__metadata__":
                continue
            begin, end = entry["data_offsets"]
            size = end - begin
            self._tensors[name] = StreamedTensor(file, name, entry["dtype"], entry["shape"], start + begin, size)

    def __getitem__(self, name: str) -> StreamedTensor:
        return self._tensors[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)

    def __deepcopy__(self, memo) -> StreamedCheckpoint:
        return self

    def close(self) -> None:
        """Close the checkpoint's files."""
        for file in self._files:
            file.close()
        self._files = []

    def __enter__(self) -> StreamedCheckpoint:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()
