"""Offload (ZO2): blocks live in a storage tier (CPU memory or disk) and stream to the working device.

- `storage`: the tiers (`CPUStorage`, pinned when CUDA is present; `DiskStorage`, memory-mapped safetensors files).
- `transport`: asynchronous copies (`CudaTransport` with streams and events; `ThreadTransport` for a CPU working
  device).
- `schedule`: `BlockOffloader`, the prefetch / compute / write-back schedule shared by the transports.

Memory stays bounded by the blocks in use because the pages of mapped blocks are handed back once used
(`hf_zo.pages.MappedPages`, re-exported here).
"""

from ..pages import MappedPages
from .schedule import BlockOffloader, offload_blocks
from .storage import OFFLOAD_TIERS, BlockStorage, CPUStorage, DiskStorage, build_storage
from .transport import CudaTransport, ThreadTransport

OFFLOAD_DTYPES = ("float32", "bfloat16", "float16")
"""Values of `ZOConfig.zo_offload_dtype` (the storage and transfer dtype of frozen block tensors)."""

__all__ = [
    "OFFLOAD_DTYPES",
    "OFFLOAD_TIERS",
    "BlockOffloader",
    "BlockStorage",
    "CPUStorage",
    "CudaTransport",
    "DiskStorage",
    "MappedPages",
    "ThreadTransport",
    "build_storage",
    "offload_blocks",
]
