"""Which initial tensors of a run its base model restores, and so which ones a trajectory must store.

A replay starts from the base model the user loaded (a folder or a Hub id). Loading it again restores every tensor
its checkpoint holds, but not the ones the run created or changed before training: a PEFT adapter (LoRA's ``A`` is
drawn from the global RNG when `get_peft_model` runs, whose state nothing records), a classification head that
`from_pretrained` initialised at random, a head fitted by the linear probe. Those are found here by comparing the
trainable tensors bitwise with the checkpoint the model was loaded from.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable

import huggingface_hub
import torch
from safetensors import safe_open
from transformers.utils import logging

logger = logging.get_logger(__name__)

# PEFT wraps a base module without renaming its tensors in the checkpoint: `query.base_layer.weight` is
# `query.weight`, and a `modules_to_save` copy starts as the module it copies.
_PEFT_WRAPPERS = re.compile(r"\.(?:base_layer|original_module|modules_to_save\.[^.]+)(?=\.)")
_SINGLE_FILES = ("model.safetensors", "pytorch_model.bin")
_INDEX_FILES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")


def initial_tensors_not_in_base(model: torch.nn.Module, names: list[str]) -> list[str]:
    """The names among `names` (parameters of `model`) whose current values its base checkpoint does not hold.

    Args:
        model (`torch.nn.Module`): the model (or PEFT model) about to be trained.
        names (`list[str]`): the parameters to check, as named by `model.named_parameters()`.

    Returns:
        `list[str]`: the parameters a replay cannot restore by loading the base model, in the order of `names`.
        Without a checkpoint to compare with (a model built in code, a Hub model not in the local cache), these are
        the tensors of a PEFT adapter (never in a base model), and none of a plain model: its replay then needs the
        very weights it started from, which `replay` checks.
    """
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    config = getattr(base, "config", None)
    read = _checkpoint_reader(getattr(config, "_name_or_path", None), getattr(config, "_commit_hash", None))
    in_base = {id(p): name for name, p in base.named_parameters()}
    named = dict(model.named_parameters())
    if read is None:
        return list(names) if hasattr(model, "peft_config") else []
    prefix = getattr(base, "base_model_prefix", "")
    missing = []
    for name in names:
        tensor = named[name]
        base_name = in_base.get(id(tensor))
        stored = None if base_name is None else _lookup(read, _PEFT_WRAPPERS.sub("", base_name), prefix)
        if stored is None or stored.shape != tensor.shape or not torch.equal(stored.to(tensor), tensor.detach()):
            missing.append(name)
    return missing


def _lookup(read: Callable[[str], torch.Tensor | None], key: str, prefix: str) -> torch.Tensor | None:
    """The checkpoint tensor of `key`, also under or without the model's base prefix (`bert.`), as transformers
    loads a base model's checkpoint into a model with a head and back."""
    candidates = [key]
    if prefix:
        candidates += [key.removeprefix(prefix + "."), f"{prefix}.{key}"]
    for candidate in candidates:
        tensor = read(candidate)
        if tensor is not None:
            return tensor
    return None


def _checkpoint_reader(name_or_path: str | None, revision: str | None) -> Callable[[str], torch.Tensor | None] | None:
    """A function from checkpoint key to tensor (or `None`) over the weights of a local folder or cached Hub model."""
    if not name_or_path:
        return None
    files = {name: _local_file(name_or_path, name, revision) for name in _SINGLE_FILES + _INDEX_FILES}
    shards: dict[str, str] = {}
    for index in _INDEX_FILES:
        if files[index] is not None:
            with open(files[index]) as handle:
                weight_map = json.load(handle)["weight_map"]
            folder = os.path.dirname(files[index])
            shards = {key: os.path.join(folder, shard) for key, shard in weight_map.items()}
            break
    else:
        single = next((files[name] for name in _SINGLE_FILES if files[name] is not None), None)
        if single is None:
            logger.info("No checkpoint of %s found locally: initial tensors are compared with nothing.", name_or_path)
            return None
        shards = dict.fromkeys(_keys(single), single)
    opened: dict[str, Callable[[str], torch.Tensor]] = {}

    def read(key: str) -> torch.Tensor | None:
        path = shards.get(key)
        if path is None:
            return None
        if path not in opened:
            opened[path] = _open(path)
        return opened[path](key)

    return read


def _local_file(name_or_path: str, filename: str, revision: str | None) -> str | None:
    """`filename` of a local model folder, or of a Hub model in the local cache (never downloaded)."""
    if os.path.isdir(name_or_path):
        path = os.path.join(name_or_path, filename)
        return path if os.path.isfile(path) else None
    try:
        path = huggingface_hub.try_to_load_from_cache(name_or_path, filename, revision=revision)
    except ValueError:  # not a valid repo id
        return None
    return path if isinstance(path, str) else None


def _keys(path: str) -> list[str]:
    if path.endswith(".safetensors"):
        with safe_open(path, "pt") as handle:
            return list(handle.keys())
    return list(torch.load(path, map_location="cpu", mmap=True, weights_only=True))


def _open(path: str) -> Callable[[str], torch.Tensor]:
    if path.endswith(".safetensors"):
        handle = safe_open(path, "pt")
        return handle.get_tensor
    state = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    return state.__getitem__
