"""The (dp, pertp) process mesh of a DistZO2 run and the life cycle of its process groups."""

from __future__ import annotations

import atexit
import logging
import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

logger = logging.getLogger(__name__)

MESH_DIM_NAMES = ("dp", "pertp")

_exit_hook_registered = False


@dataclass(frozen=True)
class ZOMesh:
    """Where this rank sits in the 2D layout: data parallel (different batches) x perturbation parallel (same batch,
    different signed forwards).

    Global rank ``r = dp_rank * pertp_size + pertp_rank``: the ranks of one PertP group are consecutive, so with
    one process per GPU they share a node and its interconnect.

    Attributes:
        dp_size (`int`): data-parallel groups (replicas that see different batches).
        pertp_size (`int`): ranks per perturbation-parallel group (they split the signed forwards of a batch).
        dp_rank (`int`): this rank's data-parallel index (which batches it sees).
        pertp_rank (`int`): this rank's index within its PertP group (which forwards it runs).
        device_mesh (`DeviceMesh`, *optional*): the `torch.distributed` mesh with dimensions ``("dp", "pertp")``;
            `None` in a single process.
    """

    dp_size: int = 1
    pertp_size: int = 1
    dp_rank: int = 0
    pertp_rank: int = 0
    device_mesh: DeviceMesh | None = None

    @property
    def world_size(self) -> int:
        """Processes in the mesh."""
        return self.dp_size * self.pertp_size

    @property
    def rank(self) -> int:
        """This process's global rank."""
        return self.dp_rank * self.pertp_size + self.pertp_rank

    @property
    def dp_group(self) -> dist.ProcessGroup | None:
        """The ranks with this rank's PertP index, one per data-parallel group (`None` in a single process)."""
        return self.device_mesh.get_group("dp") if self.device_mesh is not None else None

    @property
    def pertp_group(self) -> dist.ProcessGroup | None:
        """The ranks that share this rank's batch (`None` in a single process)."""
        return self.device_mesh.get_group("pertp") if self.device_mesh is not None else None


def default_backend() -> str:
    """The backend of the process group already joined (e.g. by Accelerate); else NCCL when this process drives a
    CUDA device (and `ACCELERATE_USE_CPU` is not set), gloo otherwise."""
    if dist.is_available() and dist.is_initialized():
        return "nccl" if "nccl" in str(dist.get_backend()) else "gloo"
    use_cpu = os.environ.get("ACCELERATE_USE_CPU", "false").lower() in ("1", "true", "yes")
    return "nccl" if torch.cuda.is_available() and not use_cpu else "gloo"


def init_process_group(backend: str, timeout: timedelta) -> None:
    """Join the launcher's process group (if not joined yet) and bound every collective on it by `timeout`.

    A launcher (`torchrun`, `accelerate launch`) sets `WORLD_SIZE`, `RANK` and the rendezvous address; Accelerate
    usually initialises the group first, in which case only its timeout is set here: Trainer's own collectives run
    on it too, and a dead or hung peer must make the survivors fail instead of waiting for the 30-minute default.
    The group is destroyed at interpreter exit (gloo aborts the process otherwise).
    """
    if not dist.is_initialized():
        if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
            _warn_if_launcher_started_one_process()
            return
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend=backend, timeout=timeout)
    else:
        dist.distributed_c10d._set_pg_timeout(timeout)
    _register_exit_hook()


def _warn_if_launcher_started_one_process() -> None:
    """Warn when `accelerate launch` was asked for several processes but ran the script once.

    Without `--multi_gpu` (or a config file), `accelerate launch --cpu --num_processes 2` takes its single-process
    launcher: it sets the rendezvous address that only a multi-process launch needs, and no `WORLD_SIZE`.
    """
    launched_by_accelerate = "ACCELERATE_DYNAMO_BACKEND" in os.environ
    if launched_by_accelerate and "MASTER_ADDR" in os.environ and "WORLD_SIZE" not in os.environ:
        logger.warning(
            "accelerate launch was given more than one process (or machine) but started this script once, so this "
            "run trains in a single process. On CPUs add --multi_gpu (Accelerate's multi-process launcher, also for "
            "CPUs) or use --config_file examples/accelerate_configs/cpu_2_processes.yaml; "
            "`torchrun --nproc_per_node N` works too."
        )


def destroy_process_group() -> None:
    """Destroy the default process group and its subgroups if they exist (safe to call more than once)."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def _register_exit_hook() -> None:
    global _exit_hook_registered
    if not _exit_hook_registered:
        atexit.register(destroy_process_group)
        _exit_hook_registered = True


def build_mesh(pertp_size: int, backend: str, timeout: timedelta) -> ZOMesh:
    """Build the ``(dp, pertp)`` mesh over all launched processes (a trivial mesh in a single process).

    Args:
        pertp_size (`int`): ranks per perturbation-parallel group; must divide the number of processes.
        backend (`str`): `"gloo"` or `"nccl"`, for the subgroups.
        timeout (`timedelta`): bound on every collective of the subgroups.

    Returns:
        `ZOMesh`: this rank's place in the layout.
    """
    init_process_group(backend, timeout)
    world_size = dist.get_world_size() if dist.is_initialized() else 1
    if pertp_size < 1 or world_size % pertp_size:
        raise ValueError(
            f"The number of processes ({world_size}) must be a multiple of zo_perturbation_parallel_size "
            f"({pertp_size}): launch dp * {pertp_size} processes, or change zo_perturbation_parallel_size."
        )
    dp_size = world_size // pertp_size
    if world_size == 1:
        return ZOMesh()
    rank = dist.get_rank()
    layout = torch.arange(world_size).view(dp_size, pertp_size)
    # Every rank must create every subgroup, in the same order (a collective requirement of new_group).
    groups = {}
    for name, rows in (("pertp", layout.tolist()), ("dp", layout.t().tolist())):
        for ranks in rows:
            group = dist.new_group(ranks=ranks, backend=backend, timeout=timeout, group_desc=f"hf_zo_{name}")
            if rank in ranks:
                groups[name] = group
    device_type = "cuda" if backend == "nccl" else "cpu"
    device_mesh = DeviceMesh.from_group(
        [groups["dp"], groups["pertp"]], device_type, mesh=layout, mesh_dim_names=MESH_DIM_NAMES
    )
    mesh = ZOMesh(dp_size, pertp_size, rank // pertp_size, rank % pertp_size, device_mesh)
    logger.info(
        "hf_zo mesh: rank %d is dp %d/%d, pertp %d/%d.", rank, mesh.dp_rank, dp_size, mesh.pertp_rank, pertp_size
    )
    return mesh
