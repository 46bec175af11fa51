"""Which initial tensors of a run its base model restores, and so which ones a trajectory must store.

A replay starts from the base model the user loaded (a folder or a Hub id). Loading it again restores every tensor
its checkpoint holds, but not the ones the run created or changed before training: a PEFT adapter (LoRA's ``A`` is
drawn from the global RNG when `get_peft_model` runs, whose state nothing records), a classification head that
`from_pretrained` initialised at random, a head fitted by the linear probe. Those are found here by comparing the
trainable tensors bitwise with the checkpoint the model was loaded from.

A safetensors checkpoint is compared by reading its bytes in chunks, never by mapping it: a mapped file's pages count
as the process's resident memory for as long as the mapping lives, so a second mapping beside the one
`from_pretrained` keeps would hold every weight twice at the start of training.
"""

from __future__ import annotations

import hashlib
import json
import os
import re

import huggingface_hub
import torch
from torch.distributed.tensor import DTensor
from transformers.utils import logging

from ..pages import MappedPages
from ..safetensors_files import SAFETENSORS_DTYPES, read_safetensors_header

logger = logging.get_logger(__name__)

# PEFT wraps a base module without renaming its tensors in the checkpoint: `query.base_layer.weight` is
# `query.weight`, and a `modules_to_save` copy or an LN-tuning copy (`ln_tuning_layers`) starts as the module it
# copies.
_PEFT_WRAPPERS = re.compile(r"\.(?:base_layer|original_module|(?:modules_to_save|ln_tuning_layers)\.[^.]+)(?=\.)")
_SINGLE_FILES = ("model.safetensors", "pytorch_model.bin")
_INDEX_FILES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
# A plain model's tensors missing from its checkpoint are a head or a few renamed norms; more than this means its
# checkpoint names its tensors in a way not mapped here, and storing them would copy the model into each trajectory.
MAX_PLAIN_INITIAL_BYTES = 64 * 2**20


@torch.no_grad()
def whole(tensor: torch.Tensor) -> torch.Tensor:
    """The whole value of `tensor`: a `DTensor` (an FSDP2 parameter) gathered from the shards of every process, which
    is a collective (every process calls it, for the same tensors in the same order); any other tensor as it is."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def initial_tensors_not_in_base(model: torch.nn.Module, names: list[str]) -> list[str]:
    """The names among `names` (parameters of `model`) whose current values its base checkpoint does not hold.

    Args:
        model (`torch.nn.Module`): the model (or PEFT model) about to be trained.
        names (`list[str]`): the parameters to check, as named by `model.named_parameters()`.

    Returns:
        `list[str]`: the parameters a replay cannot restore by loading the base model, in the order of `names`.
        Without a checkpoint to compare with (a model built in code, a Hub model not in the local cache), these are
        the tensors of a PEFT adapter (never in a base model), and none of a plain model: its replay then needs the
        very weights it started from, which `replay` checks. The same holds, with a warning, when a plain model's
        missing tensors exceed `MAX_PLAIN_INITIAL_BYTES`.
    """
    checkpoint = BaseCheckpoint(model)
    named = dict(model.named_parameters())
    if not checkpoint.found:
        return list(names) if hasattr(model, "peft_config") else []
    missing, pages = [], MappedPages()
    for name in names:
        if not checkpoint.holds(named[name]):
            missing.append(name)
        if not isinstance(named[name], DTensor):
            pages.release(named[name])  # an offloaded tensor's pages, once read (the disk tier)
    size = sum(named[n].numel() * named[n].element_size() for n in missing)
    if not hasattr(model, "peft_config") and size > MAX_PLAIN_INITIAL_BYTES:
        logger.warning(
            "%d trainable tensors (%s, ...; %.0f MiB) differ from the base checkpoint or are not found in it under "
            "their names; the trajectory does not store them, so it replays only onto the exact weights training "
            "starts from.",
            len(missing),
            missing[0],
            size / 2**20,
        )
        return []
    return missing


def frozen_fingerprint(model: torch.nn.Module) -> dict | None:
    """A cheap fingerprint of the frozen base weights of `model` (a PEFT run's base): SHA-256 over the names and 64
    evenly spaced elements of each frozen parameter that its base checkpoint holds (all of them without one).

    A PEFT adapter's updates do not depend on the frozen weights, so only this tells a replay onto a different
    pretrained model of the same shapes from the right one. Parameters stored in another dtype than the model's
    (offloaded in low precision) are left out: their values are not those `from_pretrained` gives.

    Returns:
        `dict` or `None`: ``{"sha256": ..., "tensors": count}``, or `None` when no parameter is frozen.
    """
    checkpoint = BaseCheckpoint(model)
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    dtype = getattr(base, "dtype", None)
    digest, count = hashlib.sha256(), 0
    for name, parameter in model.named_parameters():
        if parameter.requires_grad or (checkpoint.found and checkpoint.key(parameter) is None):
            continue
        if dtype is not None and parameter.dtype != dtype:
            continue
        flat = whole(parameter.detach()).reshape(-1)
        sample = flat[:: max(1, flat.numel() // 64)].cpu().contiguous()
        digest.update(name.encode() + b":" + sample.view(torch.uint8).numpy().tobytes())
        count += 1
    return {"sha256": digest.hexdigest(), "tensors": count} if count else None


class BaseCheckpoint:
    """The checkpoint the base of `model` was loaded from (its `config._name_or_path`: a local folder, or a Hub model
    in the local cache, never downloaded), read lazily.

    Args:
        model (`torch.nn.Module`): a transformers model, possibly PEFT-wrapped.

    Attributes:
        found (`bool`): whether a checkpoint (safetensors or PyTorch, single or sharded) was found.
    """

    def __init__(self, model: torch.nn.Module):
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        config = getattr(base, "config", None)
        self._names = {id(p): name for name, p in base.named_parameters()}
        self._prefix = getattr(base, "base_model_prefix", "")
        self._shards = _shards(getattr(config, "_name_or_path", None), getattr(config, "_commit_hash", None))
        self._headers: dict[str, tuple[dict, int]] = {}
        self.found = bool(self._shards)

    def key(self, parameter: torch.Tensor) -> str | None:
        """The checkpoint key holding the value `parameter` was loaded with, or `None`."""
        name = self._names.get(id(parameter))
        if name is None:  # a tensor PEFT added outside the base model (a prompt encoder)
            return None
        name = _PEFT_WRAPPERS.sub("", name)
        # transformers loads a base model's checkpoint into a model with a head (`bert.` prefix) and back.
        candidates = [name]
        if self._prefix:
            candidates += [name.removeprefix(self._prefix + "."), f"{self._prefix}.{name}"]
        return next((key for key in candidates if key in self._shards), None)

    def holds(self, parameter: torch.Tensor) -> bool:
        """Whether the checkpoint holds `parameter` with exactly its current value (compared in its dtype); an
        FSDP2 parameter is gathered first (:func:`whole`, a collective)."""
        key = self.key(parameter)
        if key is None:
            return False
        path = self._shards[key]
        tensor = whole(parameter.detach())
        if not path.endswith(".safetensors"):
            stored = torch.load(path, map_location="cpu", mmap=True, weights_only=True)[key]
            return stored.shape == tensor.shape and torch.equal(stored.to(tensor), tensor)
        if path not in self._headers:
            self._headers[path] = read_safetensors_header(path)
        header, data_start = self._headers[path]
        entry = header[key]
        dtype = SAFETENSORS_DTYPES.get(entry["dtype"])
        if dtype is None or tuple(entry["shape"]) != tuple(tensor.shape):
            return False
        begin, end = entry["data_offsets"]
        return _file_range_equals(path, data_start + begin, end - begin, dtype, tensor)


_COMPARE_BYTES = 16 * 2**20


def _file_range_equals(path: str, offset: int, nbytes: int, dtype: torch.dtype, tensor: torch.Tensor) -> bool:
    """Whether `nbytes` of `path` at `offset`, read as `dtype` and cast to `tensor`'s dtype, equal `tensor`.

    Reads one bounded chunk at a time into one buffer, so the comparison holds no more than `_COMPARE_BYTES`.
    """
    item = torch.empty((), dtype=dtype).element_size()
    if nbytes != tensor.numel() * item:
        return False
    flat = tensor.reshape(-1)
    step = max(1, _COMPARE_BYTES // item)
    buffer = bytearray(min(nbytes, step * item))
    with open(path, "rb") as handle:
        handle.seek(offset)
        for start in range(0, tensor.numel(), step):
            count = min(step, tensor.numel() - start)
            view = memoryview(buffer)[: count * item]
            if handle.readinto(view) != count * item:
                return False
            stored = torch.frombuffer(view, dtype=dtype, count=count).to(device=flat.device, dtype=flat.dtype)
            if not torch.equal(stored, flat[start : start + count]):
                return False
    return True


def _shards(name_or_path: str | None, revision: str | None) -> dict[str, str]:
    """Checkpoint key -> file holding it, for the weights of a local folder or cached Hub model ({} if none)."""
    if not name_or_path:
        return {}
    for index in _INDEX_FILES:
        path = _local_file(name_or_path, index, revision)
        if path is not None:
            with open(path) as handle:
                weight_map = json.load(handle)["weight_map"]
            return {key: os.path.join(os.path.dirname(path), shard) for key, shard in weight_map.items()}
    for single in _SINGLE_FILES:
        path = _local_file(name_or_path, single, revision)
        if path is not None:
            return dict.fromkeys(_keys(path), path)
    logger.info("No checkpoint of %s found locally: no initial tensor is known to come from it.", name_or_path)
    return {}


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
        return [key for key in read_safetensors_header(path)[0] if key != "__metadata__"]
    return list(torch.load(path, map_location="cpu", mmap=True, weights_only=True))
