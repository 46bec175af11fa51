"""Find the repeated blocks of a model (the units the dual engine and offload work block by block on), and offload
them (:func:`offload_model`).

Blocks are found from the model's own metadata, never from per-architecture code (DESIGN invariant 8): the classes
named in `_no_split_modules` (the layers that `accelerate` never splits across devices), taken where they sit in an
`nn.ModuleList` (the repeated stack of layers). PEFT wrappers are looked through.
"""

from __future__ import annotations

import torch
from torch import nn

from ..offload import BlockOffloader, offload_blocks


class BlocksNotFoundError(ValueError):
    """Raised when a model has no repeated blocks that the dual engine or offload can work on."""


def no_split_module_names(model: nn.Module) -> set[str]:
    """The class names in `_no_split_modules` of `model` and of every model it wraps (PEFT, Accelerate)."""
    names = set()
    for module in model.modules():
        value = getattr(module, "_no_split_modules", None)
        if value:
            names.update(value)
    return names


def find_blocks(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks of `model`, in the order of their `nn.ModuleList` (the order a forward runs them).

    A block is a module whose class is named in `_no_split_modules` and that is an element of an `nn.ModuleList`.
    When the model declares no `_no_split_modules`, the longest `nn.ModuleList` of at least two modules of one class
    that own parameters is used instead (a custom model's stack of layers).

    Args:
        model (`nn.Module`): a transformers model, possibly wrapped by PEFT.

    Returns:
        `list[nn.Module]`: the blocks, outermost lists first, each list in its own order.

    Raises:
        `BlocksNotFoundError`: naming what was looked for, when nothing matches.
    """
    names = no_split_module_names(model)
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList)]
    blocks = [child for lst in lists for child in lst if type(child).__name__ in names]
    if blocks:
        return _outermost(blocks)
    if not names:
        candidates = [lst for lst in lists if _is_repeated(lst)]
        if candidates:
            return list(max(candidates, key=len))
    raise BlocksNotFoundError(
        f"Could not find the repeated blocks of {type(model).__name__}: looked for modules of the classes in "
        f"`_no_split_modules` ({sorted(names) or 'not set'}) inside an nn.ModuleList"
        + ("" if names else ", and for an nn.ModuleList of at least two modules of one class with parameters")
        + ". Use zo_engine='sequential' (works for any model), or set `_no_split_modules` on the model class to the "
        "name of its layer class."
    )


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


def _is_repeated(module_list: nn.ModuleList) -> bool:
    children = list(module_list)
    return (
        len(children) >= 2
        and len({type(c) for c in children}) == 1
        and all(any(True for _ in c.parameters()) for c in children)
    )


def _outermost(blocks: list[nn.Module]) -> list[nn.Module]:
    """Drop blocks nested inside other blocks (a block class reused as a sub-layer)."""
    inner = {id(sub) for block in blocks for sub in block.modules() if sub is not block}
    return [b for b in blocks if id(b) not in inner]
