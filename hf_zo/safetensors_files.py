"""What the safetensors format says about a file: its dtype names and its JSON header, read without its tensors."""

from __future__ import annotations

import json
import struct

import torch

__all__ = ["SAFETENSORS_DTYPES", "read_safetensors_header"]

SAFETENSORS_DTYPES = {
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
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
"""The torch dtype of each dtype name of a safetensors header."""


def read_safetensors_header(path: str) -> tuple[dict, int]:
    """The JSON header of the safetensors file `path` and the offset at which its tensor data starts."""
    with open(path, "rb") as handle:
        (header_size,) = struct.unpack("<Q", handle.read(8))
        return json.loads(handle.read(header_size)), 8 + header_size
