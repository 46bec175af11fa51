"""Set-up of the dual engine and of offloaded blocks for a model (what `ZOTrainer` calls)."""

from __future__ import annotations

import torch
from torch import nn

from ..offload import BlockOffloader, offload_blocks
from .blocks import find_blocks


def offload_model(
    model: nn.Module,
    tier: str,
    directory: str | None = None,
    device: torch.device | str | None = None,
    prefetch: int = 1,
    offload_dtype: torch.dtype | str | None = None,
    transport=None,
) -> BlockOffloader:
    """Offload the repeated blocks of `model` (found with `find_blocks`) to storage tier `tier`.

    Call it before moving the model to its device: the blocks then stay in storage and only the other (resident)
    modules move. Pass the returned offloader to `DualEngine(model, offloader=...)`.

    Args:
        model (`nn.Module`): a transformers model, possibly wrapped by PEFT.
        tier (`str`): `"cpu"` (host memory, pinned with CUDA) or `"disk"` (memory-mapped safetensors files).
        directory (`str`, *optional*): the disk tier's directory (default: a temporary one).
        device (`torch.device` or `str`, *optional*): the working device (default: CUDA when available, else CPU).
        prefetch (`int`, defaults to 1): blocks loaded ahead of the one computing.
        offload_dtype (`torch.dtype` or `str`, *optional*): storage/transfer dtype of frozen block tensors.
        transport (*optional*): how blocks move (default: chosen for the device; see `BlockOffloader`).

    Returns:
        `BlockOffloader`: the offloader, whose hooks already serve plain forwards (evaluation, generation).
    """
    return offload_blocks(find_blocks(model), tier, directory, device, prefetch, offload_dtype, transport)
