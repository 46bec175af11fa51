"""ZO under FSDP2: the parameters sharded per decoder block, each process sweeping only its own shards.

`shard_model` applies `torch.distributed.fsdp.fully_shard` to each repeated block of the model (found from its own
metadata, `hf_zo.engine.find_blocks`) and then to the root, as Accelerate's FSDP2 preparation does with its
transformer wrap policy. Every parameter is then a `DTensor` whose local shard is a range of rows, hence one range of
the flat tensor: the counter-based noise of that range is the noise one process gives those elements
(`hf_zo.noise.local_shard`), so a shard is swept bitwise as one process sweeps the whole tensor.

The processes run as ZO data parallelism does (`hf_zo.parallel.estimation`): each runs the forwards of its own
micro-batches, at its own point of the step's sequence of sweeps, and the losses are exchanged as scalars. A forward
gathers every process's shard, so the sweeps are held back from the shards (`hf_zo.estimator.LazyParameters`): just
before a block computes, `ShardedForwards` brings each of its gathered trainable tensors to this process's point,
and the shards take the held-back sweeps where every process has made them all. Nothing is sent but FSDP's own
all-gathers and the step's loss scalars. Every module reshards after its forward (the root included, which FSDP2
otherwise keeps gathered), so that each forward gathers the shards as they are.

Which FSDP a launch asks for is read from Accelerate's own settings (`fsdp_version_from_env`): `accelerate launch`
with a config whose `distributed_type` is `FSDP` sets them, on GPUs and CPUs alike. hf_zo shards the model itself in
both cases, before its optimizer exists (Accelerate on CPUs would wrap the model in DDP instead).
"""

from __future__ import annotations

import json
import logging
import os

import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor
from torch.utils.hooks import RemovableHandle

from ..engine.blocks import find_blocks
from ..estimator import LazyParameters
from ..noise import local_shard

logger = logging.getLogger(__name__)

__all__ = [
    "SHARDED_CHECKPOINT_NAME",
    "ShardedForwards",
    "check_fsdp_layout",
    "check_fsdp_state_dict_type",
    "check_fsdp_version",
    "fsdp_state_dict_type_from_env",
    "fsdp_version_from_env",
    "hsdp_replicate_size_from_env",
    "load_saved_shards",
    "param_bytes",
    "save_sharded_checkpoint",
    "shard_model",
    "sharding_mesh",
]


def fsdp_version_from_env() -> int | None:
    """The FSDP version an `accelerate launch` asked for (`ACCELERATE_USE_FSDP` and `FSDP_VERSION`, which its config's
    `distributed_type: FSDP` and `fsdp_config.fsdp_version` set), or `None` when it asked for none."""
    if os.environ.get("ACCELERATE_USE_FSDP", "false").lower() not in ("1", "true", "yes"):
        return None
    value = os.environ.get("FSDP_VERSION", "1")
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"FSDP_VERSION must be 1 or 2, got {value!r}; set fsdp_version: 2 in the config.") from None


def check_fsdp_version(version: int | None) -> None:
    """Raise unless `version` is `None` (no FSDP) or 2: hf_zo shards with FSDP2 (`fully_shard`) only."""
    if version not in (None, 2):
        raise ValueError(
            f"fsdp_version={version!r}: hf_zo trains under FSDP2 only, whose parameters are DTensors each process can "
            "sweep by its own rows. Set fsdp_version: 2 in the accelerate config's fsdp_config (FSDP_VERSION=2), or "
            "launch without FSDP for ZO data parallelism."
        )


STATE_DICT_TYPES = {"1": "FULL_STATE_DICT", "2": "LOCAL_STATE_DICT", "3": "SHARDED_STATE_DICT"}
"""Accelerate's `FSDP_STATE_DICT_TYPE` may name a type by its `StateDictType` number."""


def fsdp_state_dict_type_from_env() -> str | None:
    """The FSDP state-dict type an `accelerate launch` asked for (`FSDP_STATE_DICT_TYPE`, which its config's
    `fsdp_config.fsdp_state_dict_type` sets), upper-cased, or `None` when it names none."""
    value = os.environ.get("FSDP_STATE_DICT_TYPE")
    if value is None or value.strip() in ("", "None"):
        return None
    return STATE_DICT_TYPES.get(value.strip(), value.strip().upper())


def check_fsdp_state_dict_type(fsdp_version: int | None, state_dict_type: str | None) -> None:
    """Raise when FSDP2 is asked to save checkpoints with another state-dict type than `FULL_STATE_DICT` or
    `SHARDED_STATE_DICT` (`None`: not asked, the whole weights are saved)."""
    if fsdp_version != 2 or state_dict_type in (None, "FULL_STATE_DICT", "SHARDED_STATE_DICT"):
        return
    raise ValueError(
        f"fsdp_state_dict_type={state_dict_type!r} cannot combine with hf_zo's FSDP2: its checkpoints hold either the "
        "whole weights (FULL_STATE_DICT, an ordinary Hugging Face folder) or each process's shards of them "
        "(SHARDED_STATE_DICT, torch.distributed.checkpoint), and save_model always writes the whole weights. Set "
        "fsdp_state_dict_type to one of those in the accelerate config's fsdp_config (FSDP_STATE_DICT_TYPE)."
    )


def hsdp_replicate_size_from_env() -> int:
    """How many replicas of the sharded model an `accelerate launch` asked for (`PARALLELISM_CONFIG_DP_REPLICATE_SIZE`,
    which its config's `parallelism_config.parallelism_config_dp_replicate_size` sets: FSDP2 over groups, HSDP); 1
    when it asked for none.

    Raises:
        `ValueError`: when the parallelism config asks for tensor, context or sequence parallelism, which hf_zo's
            FSDP2 does not build (it shards the model itself and would ignore them).
    """
    if os.environ.get("ACCELERATE_USE_PARALLELISM_CONFIG", "false").lower() not in ("1", "true", "yes"):
        return 1
    for dimension in ("TP", "CP", "SP"):
        if _env_int(f"PARALLELISM_CONFIG_{dimension}_SIZE") > 1:
            raise ValueError(
                f"parallelism_config_{dimension.lower()}_size={_env_int(f'PARALLELISM_CONFIG_{dimension}_SIZE')} "
                "cannot combine with hf_zo's FSDP2, which shards over data-parallel dimensions only: set it to 1 in "
                "the accelerate config's parallelism_config (keep parallelism_config_dp_replicate_size for groups of "
                "sharded replicas)."
            )
    return _env_int("PARALLELISM_CONFIG_DP_REPLICATE_SIZE")


def _env_int(name: str) -> int:
    value = os.environ.get(name, "1")
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{name} must be an integer, got {value!r}.") from None


def check_fsdp_layout(
    fsdp_version: int | None,
    offload: str | None = None,
    pertp_size: int = 1,
    engine: str | None = None,
) -> None:
    """Raise when FSDP2 (`fsdp_version` 2) is asked for with what it does not combine with yet, naming the
    alternative: offloaded blocks (`offload`), perturbation parallelism (`pertp_size` > 1) or the dual engine
    (`engine`, `zo_engine`; `None` when not known yet)."""
    if fsdp_version != 2:
        return
    if offload is not None:
        raise ValueError(
            f"zo_offload={offload!r} cannot combine with FSDP2: offload streams whole blocks from each process's "
            "own storage, FSDP2 gathers them from every process's shards. For a model larger than one device on "
            "one device, launch without FSDP and keep zo_offload; on several devices, drop zo_offload and keep FSDP2."
        )
    if pertp_size > 1:
        raise ValueError(
            f"zo_perturbation_parallel_size={pertp_size} cannot combine with FSDP2, whose forwards gather the "
            "shards of every process at once while perturbation parallelism splits them among processes. Under "
            "FSDP2 every process runs the forwards of its own micro-batches (as ZO data parallelism does): set "
            "zo_perturbation_parallel_size=1 (and HF_ZO_PERTURBATION_PARALLEL_SIZE), or launch without FSDP."
        )
    if engine not in (None, "sequential"):
        raise ValueError(
            f"zo_engine={engine!r} cannot combine with FSDP2: the dual engine runs both perturbed passes block by "
            "block on whole blocks, FSDP2 gathers them per forward. Set zo_engine='sequential' (the default), or "
            "launch without FSDP to use the dual engine."
        )


def sharding_mesh(dp_mesh: DeviceMesh, replicate_size: int) -> DeviceMesh:
    """The mesh FSDP2 shards over: `dp_mesh` itself (every process holds one shard), or, with `replicate_size` > 1,
    a ``("dp_replicate", "dp_shard")`` mesh over the same processes (HSDP): `replicate_size` groups of consecutive
    ranks, each holding the whole model in shards, whose forwards gather only within their group.

    Raises:
        `ValueError`: when `replicate_size` does not divide the number of processes.
    """
    if replicate_size == 1:
        return dp_mesh
    world = dp_mesh.size()
    if replicate_size < 1 or world % replicate_size:
        raise ValueError(
            f"parallelism_config_dp_replicate_size={replicate_size} must divide the {world} processes: each of its "
            "groups shards the model over the same number of processes. Launch a multiple of it, or change it."
        )
    return DeviceMesh(
        dp_mesh.device_type,
        dp_mesh.mesh.view(replicate_size, world // replicate_size),
        mesh_dim_names=("dp_replicate", "dp_shard"),
    )


def shard_model(model: nn.Module, mesh: DeviceMesh) -> nn.Module:
    """Shard `model` in place with FSDP2 over `mesh`: each repeated block, the input and output embeddings when
    they are not tied (so that a forward never holds both whole at once), then the root, all resharded after their
    forward.

    Args:
        model (`nn.Module`): a transformers model, possibly wrapped by PEFT, identical on every process.
        mesh (`DeviceMesh`): the processes that share the parameters: one dimension (each holds a shard), or two
            (:func:`sharding_mesh`: replicas of the sharded model, HSDP).

    Returns:
        `nn.Module`: `model`, now an `FSDPModule` whose parameters are `DTensor`s.

    Raises:
        `hf_zo.engine.BlocksNotFoundError`: when the model has no repeated blocks to shard.
    """
    if isinstance(model, FSDPModule):
        raise ValueError(
            f"{type(model).__name__} is sharded already; hand ZOTrainer the model before fully_shard (hf_zo shards "
            "it per block itself, so that its optimizer sees the shards it sweeps)."
        )
    for unit in [*find_blocks(model), *_untied_embeddings(model)]:
        fully_shard(unit, mesh=mesh, reshard_after_forward=True)
    fully_shard(model, mesh=mesh, reshard_after_forward=True)
    return model


def _untied_embeddings(model: nn.Module) -> list[nn.Module]:
    """The input and output embeddings of a transformers model (`get_input_embeddings`, `get_output_embeddings`),
    unless they share their weight (one FSDP2 unit must then hold both: the root's)."""
    found = []
    for getter in ("get_input_embeddings", "get_output_embeddings"):
        try:
            module = getattr(model, getter)()
        except (AttributeError, NotImplementedError):
            continue
        if isinstance(module, nn.Module) and any(True for _ in module.parameters()):
            found.append(module)
    if len(found) == 2 and {id(p) for p in found[0].parameters()} & {id(p) for p in found[1].parameters()}:
        return []
    return found


def param_bytes(model: nn.Module) -> tuple[int, int]:
    """The bytes of the parameters of `model` this process holds (its shards, and whole tensors that are not
    sharded), and the bytes of all of them, trainable and frozen; a tied tensor counts once."""
    local = total = 0
    for param in model.parameters():
        shard, _ = local_shard(param)
        local += shard.numel() * shard.element_size()
        total += param.numel() * param.element_size()
    return local, total


WEIGHT_FILES = ("model.safetensors", "adapter_model.safetensors")

SHARDED_CHECKPOINT_NAME = "pytorch_model_fsdp_0"
"""The folder of a checkpoint that holds each process's shards (Accelerate's name for FSDP's sharded state dict)."""


def save_sharded_checkpoint(model: nn.Module, folder: str | os.PathLike) -> None:
    """Write each process's shards of the trainable parameters of the FSDP2-sharded `model` into
    ``folder/pytorch_model_fsdp_0`` with `torch.distributed.checkpoint` (every process takes part; nothing is
    gathered). The frozen base of an adapter is not saved: it never changes. :func:`load_saved_shards` reads it
    back."""
    dcp.save(_trainable_shards(model), checkpoint_id=os.path.join(folder, SHARDED_CHECKPOINT_NAME))


def _trainable_shards(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: param.detach() for name, param in model.named_parameters() if param.requires_grad}


def load_saved_shards(model: nn.Module, folder: str | os.PathLike) -> None:
    """Load into each parameter of the FSDP2-sharded `model` its shard of the weights saved in `folder`: the shards
    of a sharded checkpoint (:func:`save_sharded_checkpoint`, read with `torch.distributed.checkpoint`), or the whole
    tensors of a checkpoint or `save_model` folder (safetensors, possibly split into several files), of which each
    process keeps its own rows without sending anything. A PEFT model loads its adapter (the frozen base stays as it
    is).

    Raises:
        `FileNotFoundError`: when `folder` holds no weights file.
        `ValueError`: when a parameter of `model` is missing from the saved weights.
    """
    if os.path.isdir(os.path.join(folder, SHARDED_CHECKPOINT_NAME)):
        shards = _trainable_shards(model)
        with torch.no_grad():
            dcp.load(shards, checkpoint_id=os.path.join(folder, SHARDED_CHECKPOINT_NAME))  # into the shards in place
        return
    saved = _read_weights(folder)
    adapter = getattr(model, "active_adapter", None) if hasattr(model, "peft_config") else None
    with torch.no_grad():
        for name, param in model.named_parameters():
            key = name if adapter is None else name.replace(f".{adapter}.", ".")
            if key not in saved:
                if adapter is not None and not param.requires_grad:
                    continue  # the frozen base of an adapter, which the checkpoint does not hold
                raise ValueError(
                    f"{folder} does not hold {key!r}, a parameter of {type(model).__name__}: resume with the model "
                    "(and PEFT config) that wrote it."
                )
            shard, offset = local_shard(param)
            whole = saved[key].reshape(-1).to(shard.dtype)
            shard.view(-1).copy_(whole[offset : offset + shard.numel()])


def _read_weights(folder: str | os.PathLike) -> dict[str, torch.Tensor]:
    """The tensors of the safetensors weights in `folder` (one file, or the files of its index)."""
    for file in WEIGHT_FILES:
        index = os.path.join(folder, file + ".index.json")
        if os.path.isfile(index):
            with open(index) as f:
                files = sorted(set(json.load(f)["weight_map"].values()))
            return {k: v for name in files for k, v in load_file(os.path.join(folder, name)).items()}
        if os.path.isfile(os.path.join(folder, file)):
            return load_file(os.path.join(folder, file))
    raise FileNotFoundError(f"{folder} holds none of {WEIGHT_FILES} (nor their .index.json): no weights to resume.")


class ShardedForwards:
    """Forward pre-hooks that bring the gathered trainable tensors of each FSDP2 module to this process's point of
    the step (:meth:`hf_zo.estimator.LazyParameters.replay_onto`), after FSDP2 has gathered them.

    FSDP2 registers its own pre-hook first, so when a module's hook runs, its parameters are the gathered tensors,
    freed again after its forward. A tensor tied to two modules of one FSDP2 group is brought there once.

    Args:
        model (`nn.Module`): the model sharded by :func:`shard_model`.
        params (`LazyParameters`): the optimizer's trainable tensors (the model's `DTensor` parameters).
    """

    def __init__(self, model: nn.Module, params: LazyParameters):
        self.params = params
        position_of = {id(tensor): k for k, (_, tensor) in enumerate(params.tensors)}
        self._handles: list[RemovableHandle] = []
        for module in model.modules():
            if not isinstance(module, FSDPModule):
                continue
            inner = [sub for sub in module.modules() if sub is not module and isinstance(sub, FSDPModule)]
            nested = {id(p) for sub in inner for p in sub.parameters()}
            owned, seen = [], set()
            for sub in module.modules():
                for attr, param in sub.named_parameters(recurse=False):
                    position = position_of.get(id(param))
                    if position is not None and id(param) not in nested and position not in seen:
                        seen.add(position)
                        owned.append((sub, attr, position))
            if owned:
                self._handles.append(module.register_forward_pre_hook(self._hook(owned)))

    def _hook(self, owned: list[tuple[nn.Module, str, int]]):
        params = self.params

        @torch.no_grad()
        def bring_to_this_point(module, args):
            if not params.held_back:
                return
            for sub, attr, position in owned:
                gathered = getattr(sub, attr)
                if isinstance(gathered, DTensor):
                    raise RuntimeError(
                        f"{type(sub).__name__}.{attr} is still sharded in its module's forward: FSDP2 gathers it in "
                        "the pre-forward hook of its fully_shard module, which must run before hf_zo's."
                    )
                params.replay_onto(position, gathered)

        return bring_to_this_point

    def remove(self) -> None:
        """Remove the hooks."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
