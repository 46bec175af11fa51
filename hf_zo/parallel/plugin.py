"""`DistZOPlugin`: the execution layout of a DistZO2 run, in the style of Accelerate's plugins."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from datetime import timedelta

import torch
from torch import nn
from torch.utils.data import DataLoader

from ..engine import offload_model
from ..offload import BlockOffloader
from ..optim import ZOExecution, ZOOptimizer
from .collectives import CommStats, ScalarCollectives
from .data import shard_by_dp_rank
from .estimation import ParallelEstimation
from .fsdp import (
    check_fsdp_layout,
    check_fsdp_state_dict_type,
    check_fsdp_version,
    fsdp_state_dict_type_from_env,
    fsdp_version_from_env,
    hsdp_replicate_size_from_env,
    param_bytes,
    shard_model,
    sharding_mesh,
)
from .mesh import ZOMesh, build_mesh, default_backend, destroy_process_group
from .replicas import sync_replicas
from .sliced import SlicedTransport, build_slice_group

logger = logging.getLogger(__name__)

ENV_PREFIX = "HF_ZO_"
DEFAULT_TIMEOUT_SECONDS = 1800.0


def check_sliced_upload(sliced_upload: bool, offload: str | None, pertp_size: int | None = None) -> None:
    """Raise if sliced upload is on without offloaded blocks to upload or, when `pertp_size` is known, without a
    perturbation-parallel group to split each upload among."""
    if sliced_upload and offload is None:
        raise ValueError(
            "zo_offload_sliced_upload=True shares the upload of offloaded blocks, but offload is None; set "
            "zo_offload='cpu' or 'disk' (with zo_engine='dual'), or turn sliced upload off."
        )
    if sliced_upload and pertp_size is not None and pertp_size < 2:
        raise ValueError(
            "zo_offload_sliced_upload=True splits each block's upload among the ranks of a perturbation-parallel "
            f"group, but perturbation_parallel_size is {pertp_size}; set zo_perturbation_parallel_size (or "
            "HF_ZO_PERTURBATION_PARALLEL_SIZE) to 2 or more, or turn sliced upload off."
        )


@dataclass
class DistZOPlugin:
    """How a zeroth-order run is spread over processes: a ``(dp, pertp)`` mesh that exchanges only scalars.

    The ranks of one perturbation-parallel (PertP) group see the same batch and split its signed forwards; the
    data-parallel (DP) groups see different batches and exchange their ``(seed, projected_grad)`` records. Seeds
    derive from the shared base seed and the step counter, so nothing else is ever sent, and the model is never
    wrapped in DDP/FSDP. Like Accelerate's plugins, every field left unset is read from an `HF_ZO_*` environment
    variable (set it in front of `accelerate launch` or `torchrun`), then from its default.

    Args:
        perturbation_parallel_size (`int`, *optional*):
            Ranks per PertP group, `p`; the number of processes must be a multiple of it (``dp = processes / p``),
            and it must divide the ``2 * zo_num_perturbations`` signed forwards of a micro-batch. Environment:
            `HF_ZO_PERTURBATION_PARALLEL_SIZE`; default 1 (pure ZO data parallelism).
        backend (`str`, *optional*):
            `"gloo"` or `"nccl"` for the mesh's process groups. Environment: `HF_ZO_BACKEND`; default NCCL on GPUs,
            gloo on CPUs.
        timeout_seconds (`float`, *optional*):
            Bound on every collective: a dead or hung rank makes the others fail after this long instead of
            hanging. Environment: `HF_ZO_TIMEOUT`; default 1800 (the `ddp_timeout` of `TrainingArguments`).
        offload (`str`, *optional*):
            Storage tier of the model's blocks (`"cpu"` or `"disk"`, see `hf_zo.offload`); every rank streams its
            own copy of the blocks to its own device. Taken from `ZOConfig.zo_offload` (validated there), like the
            three fields below; `None` keeps the model resident.
        offload_dir (`str`, *optional*): the disk tier's directory; each rank's storage creates its own uniquely
            named folder in it (so ranks, and concurrent runs, share it without meeting) and removes it afterwards.
        offload_prefetch (`int`, defaults to 1): blocks loaded ahead of the one computing.
        offload_dtype (`str`, *optional*): storage and transfer dtype of frozen block tensors.
        sliced_upload (`bool`, *optional*):
            DistZO2's sliced upload: the `p` ranks of a PertP group each move ``1/p`` of every block from storage and
            all-gather the rest over the device interconnect (`hf_zo.parallel.sliced`). Needs `offload` and
            ``perturbation_parallel_size > 1``. Environment: `HF_ZO_OFFLOAD_SLICED_UPLOAD` (`true`/`false`);
            default off.
        fsdp_version (`int`, *optional*):
            2 shards the parameters with FSDP2 per decoder block over all processes (`hf_zo.parallel.fsdp`): each
            process holds, perturbs and updates only its shards, and the processes run as ZO data parallelism
            does. Environment: Accelerate's own (`ACCELERATE_USE_FSDP` and `FSDP_VERSION`, set by `accelerate
            launch` from a config with `distributed_type: FSDP` and `fsdp_version: 2`); default `None` (replicas).
        fsdp_state_dict_type (`str`, *optional*):
            What checkpoints hold under FSDP2: `"FULL_STATE_DICT"` (the whole weights, an ordinary Hugging Face
            folder; also what `None` saves) or `"SHARDED_STATE_DICT"` (each process's shards, with
            `torch.distributed.checkpoint`); `save_model` writes the whole weights either way, and another type is
            refused. Environment: Accelerate's `FSDP_STATE_DICT_TYPE` (the config's
            `fsdp_config.fsdp_state_dict_type`).
        fsdp_replicate_size (`int`, *optional*):
            Under FSDP2, how many groups of processes each hold the whole model in shards (HSDP): a forward gathers
            the shards of its own group only, and the groups exchange the step's loss scalars as every process
            does. Must divide the number of processes. Environment: Accelerate's
            `PARALLELISM_CONFIG_DP_REPLICATE_SIZE` (the config's
            `parallelism_config.parallelism_config_dp_replicate_size`); default 1 (one shard per process).

    Attributes:
        mesh (`ZOMesh`): this rank's place in the layout, once :meth:`setup` has run.
        collectives (`ScalarCollectives`): the counted collectives of the mesh, once :meth:`setup` has run.
        replica_collectives (`ScalarCollectives`): the collectives that keep the replicas identical (the start-of-run
            synchronisation and the checksums of `zo_verify_replicas_steps`), counted apart from the per-step
            scalars of :attr:`collectives`.
        upload_stats (`CommStats`): the bytes of the sliced upload's block all-gathers (parameter bytes over the
            device interconnect), counted apart from the scalar collectives of :attr:`collectives`.
        offloader (`BlockOffloader`): the model's offloaded blocks, once :meth:`prepare_model` has offloaded them.
        sharded_model (`nn.Module`): the model, once :meth:`prepare_model` has sharded it with FSDP2.
    """

    perturbation_parallel_size: int | None = None
    backend: str | None = None
    timeout_seconds: float | None = None
    offload: str | None = None
    offload_dir: str | None = None
    offload_prefetch: int = 1
    offload_dtype: str | None = None
    sliced_upload: bool | None = None
    fsdp_version: int | None = None
    fsdp_state_dict_type: str | None = None
    fsdp_replicate_size: int | None = None
    mesh: ZOMesh | None = field(default=None, init=False, repr=False)
    collectives: ScalarCollectives | None = field(default=None, init=False, repr=False)
    replica_collectives: ScalarCollectives | None = field(default=None, init=False, repr=False)
    upload_stats: CommStats = field(default_factory=CommStats, init=False, repr=False)
    offloader: BlockOffloader | None = field(default=None, init=False, repr=False)
    sharded_model: nn.Module | None = field(default=None, init=False, repr=False)
    _sharded_layout: ParallelEstimation | None = field(default=None, init=False, repr=False)

    def __post_init__(self):
        if self.perturbation_parallel_size is None:
            self.perturbation_parallel_size = _from_env("PERTURBATION_PARALLEL_SIZE", int, 1)
        if self.backend is None:
            self.backend = _from_env("BACKEND", str, None) or default_backend()
        if self.timeout_seconds is None:
            self.timeout_seconds = _from_env("TIMEOUT", float, DEFAULT_TIMEOUT_SECONDS)
        if not isinstance(self.perturbation_parallel_size, int) or self.perturbation_parallel_size < 1:
            raise ValueError(
                f"perturbation_parallel_size must be an integer >= 1, got {self.perturbation_parallel_size!r}."
            )
        if self.backend not in ("gloo", "nccl"):
            raise ValueError(f"backend must be 'gloo' or 'nccl', got {self.backend!r}.")
        if not self.timeout_seconds > 0:
            raise ValueError(f"timeout_seconds must be > 0, got {self.timeout_seconds!r}.")
        if self.sliced_upload is None:
            self.sliced_upload = _from_env("OFFLOAD_SLICED_UPLOAD", _boolean, False)
        check_sliced_upload(self.sliced_upload, self.offload, self.perturbation_parallel_size)
        if self.fsdp_version is None:
            self.fsdp_version = fsdp_version_from_env()
        check_fsdp_version(self.fsdp_version)
        if self.fsdp_state_dict_type is None:
            self.fsdp_state_dict_type = fsdp_state_dict_type_from_env()
        check_fsdp_state_dict_type(self.fsdp_version, self.fsdp_state_dict_type)
        if self.fsdp_replicate_size is None:
            self.fsdp_replicate_size = hsdp_replicate_size_from_env() if self.fsdp_version == 2 else 1
        if not isinstance(self.fsdp_replicate_size, int) or self.fsdp_replicate_size < 1:
            raise ValueError(f"fsdp_replicate_size must be an integer >= 1, got {self.fsdp_replicate_size!r}.")
        check_fsdp_layout(self.fsdp_version, self.offload, self.perturbation_parallel_size)

    @classmethod
    def from_zo_config(cls, args) -> DistZOPlugin:
        """The plugin described by a `ZOConfig`: `zo_perturbation_parallel_size`, `ddp_timeout` and the `zo_offload*`
        fields.

        A field left at its default gives way to the matching `HF_ZO_*` environment variable; a field set to
        something else must agree with it.
        """
        size = _field_or_env(
            "zo_perturbation_parallel_size", args.zo_perturbation_parallel_size, 1, "PERTURBATION_PARALLEL_SIZE"
        )
        return cls(
            perturbation_parallel_size=None if size == 1 else size,
            timeout_seconds=_field_or_env("ddp_timeout", float(args.ddp_timeout), DEFAULT_TIMEOUT_SECONDS, "TIMEOUT"),
            offload=args.zo_offload,
            offload_dir=args.zo_offload_dir,
            offload_prefetch=args.zo_offload_prefetch,
            offload_dtype=args.zo_offload_dtype,
            sliced_upload=getattr(args, "zo_offload_sliced_upload", False) or None,
        )

    # ------------------------------------------------------------------ layout

    @property
    def timeout(self) -> timedelta:
        """:attr:`timeout_seconds` as a `timedelta`."""
        return timedelta(seconds=self.timeout_seconds)

    def setup(self) -> ZOMesh:
        """Join the launcher's process group if needed and build the mesh (once); return it."""
        if self.mesh is None:
            self.mesh = build_mesh(self.perturbation_parallel_size, self.backend, self.timeout)
            device = torch.device("cuda", torch.cuda.current_device()) if self.backend == "nccl" else "cpu"
            self.collectives = ScalarCollectives(device, self.timeout_seconds)
            self.replica_collectives = ScalarCollectives(device, self.timeout_seconds)
        return self.mesh

    @property
    def shards_parameters(self) -> bool:
        """Whether the parameters are sharded with FSDP2 (`fsdp_version=2` on more than one process)."""
        return self.fsdp_version == 2 and self.is_distributed

    @property
    def is_distributed(self) -> bool:
        """Whether the run spans more than one process."""
        return self.setup().world_size > 1

    @property
    def comm_stats(self) -> CommStats:
        """The bytes and calls of this rank's ZO collectives so far (reset them to measure a window)."""
        self.setup()
        return self.collectives.stats

    # ------------------------------------------------------------------ preparation

    def sync_replicas(self, named_tensors) -> list[str]:
        """Make every process hold rank 0's value of each tensor, as `DistributedDataParallel` does when it wraps a
        model (see :func:`hf_zo.parallel.replicas.sync_replicas`: only the tensors that differ are sent).

        Call it on every rank with the same tensors, e.g. `model.named_parameters()` before the model is offloaded
        (`ZOTrainer` does, at construction). Nothing happens in a single process.

        Args:
            named_tensors (`Iterable[tuple[str, torch.Tensor]]`): the tensors to agree on, with their names.

        Returns:
            `list[str]`: the names of the tensors that were broadcast from rank 0.
        """
        if not self.is_distributed:
            return []
        return sync_replicas(named_tensors, self.replica_collectives)

    def prepare_model(self, model: nn.Module, device: torch.device | str | None = None) -> BlockOffloader | None:
        """Offload the blocks of `model` as :attr:`offload` says, or shard them with FSDP2 (:attr:`shards_parameters`;
        see `hf_zo.parallel.fsdp.shard_model`); nothing to do otherwise.

        Call it before the model moves to its device and before its optimizer is built (`ZOTrainer` does, at
        construction): offloaded blocks then stay in storage, and the optimizer sweeps the shards. With
        :attr:`sliced_upload` the blocks arrive through a `SlicedTransport` over this rank's PertP group (a process
        group of its own, created here on every rank). Sharding logs the line ``hf_zo layout: fsdp2 world=<N>
        local_param_bytes=<the most any process holds> total_param_bytes=<all parameters>``.

        Args:
            model (`nn.Module`): the model, PEFT already applied.
            device (`torch.device` or `str`, *optional*): the working device (default: CUDA when available).

        Returns:
            `BlockOffloader` or `None`: the offloader (also kept in :attr:`offloader`).
        """
        if self.shards_parameters:
            self._shard(model)
            return None
        if self.offload is None:
            return None
        mesh = self.setup()
        device = torch.device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
        transport = None
        if self.sliced_upload:
            group = build_slice_group(mesh, self.backend, self.timeout)
            transport = SlicedTransport(device, group, self.upload_stats)
        self.offloader = offload_model(
            model, self.offload, self.offload_dir, device, self.offload_prefetch, self.offload_dtype, transport
        )
        return self.offloader

    def _shard(self, model: nn.Module) -> None:
        """Shard `model` over the data-parallel dimension of the mesh (every process, as perturbation parallelism
        does not combine with FSDP2) and log its layout line."""
        mesh = self.setup()
        shard_model(model, sharding_mesh(mesh.device_mesh["dp"], self.fsdp_replicate_size))
        self.sharded_model = model
        local, total = param_bytes(model)
        largest = int(self.replica_collectives.all_gather(torch.tensor([local]), mesh.dp_group).max())
        replicas = f" replicas={self.fsdp_replicate_size}" if self.fsdp_replicate_size > 1 else ""
        logger.info(
            "hf_zo layout: fsdp2 world=%d local_param_bytes=%d total_param_bytes=%d%s",
            mesh.world_size,
            largest,
            total,
            replicas,
        )

    def layout(self) -> ParallelEstimation | None:
        """The parallel layout of this mesh, for an optimizer's `hf_zo.optim.ZOExecution` (`None` in a single
        process): ``ZOSGD(params, lr, execution=ZOExecution(parallel=plugin.layout()))``."""
        mesh = self.setup()
        if mesh.world_size == 1:
            return None
        if self.sharded_model is None:
            return ParallelEstimation(mesh, self.collectives)
        if self._sharded_layout is None:  # one for the model: it owns the hooks on its forwards
            self._sharded_layout = ParallelEstimation(mesh, self.collectives, self.sharded_model)
        return self._sharded_layout

    def prepare_optimizer(self, optimizer: ZOOptimizer) -> ZOOptimizer:
        """Make an optimizer built without :meth:`layout` split its estimates over the mesh, keeping its engine
        (`ZOOptimizer.set_execution`; nothing changes in a single process or when it has a layout already).

        Args:
            optimizer (`ZOOptimizer`): built over the same parameters, base seed and hyper-parameters on every rank.

        Returns:
            `ZOOptimizer`: the same optimizer.
        """
        parallel = self.layout()
        if parallel is not None and optimizer.parallel is None:
            optimizer.set_execution(ZOExecution(engine=optimizer.engine, parallel=parallel))
        return optimizer

    def prepare_data_loader(self, dataloader: DataLoader) -> DataLoader:
        """Shard a dataloader prepared by Accelerate by DP rank (ranks of one PertP group get the same batches)."""
        return shard_by_dp_rank(dataloader, self.setup())

    def destroy(self) -> None:
        """Destroy the process groups now (also done automatically at interpreter exit)."""
        destroy_process_group()
        self.mesh = None


def _boolean(value: str) -> bool:
    """Parse an environment flag: `1`/`true`/`yes` or `0`/`false`/`no` (any case)."""
    lowered = value.strip().lower()
    if lowered in ("1", "true", "yes"):
        return True
    if lowered in ("0", "false", "no"):
        return False
    raise ValueError(value)


def _field_or_env(field: str, value, default, name: str):
    """`value` of a `ZOConfig` field, or when it is at its `default` the environment variable ``HF_ZO_{name}``
    (read as the field's type); a field set to something else and a variable that disagrees with it fail."""
    from_env = _from_env(name, type(value), None)
    if from_env is None:
        return value
    if value == default:
        return from_env
    if from_env != value:
        raise ValueError(f"{field}={value} disagrees with {ENV_PREFIX}{name}={from_env}; set only one of them.")
    return value


def _from_env(name: str, cast: type, default):
    """The value of environment variable ``HF_ZO_{name}`` converted by `cast`, or `default` if it is unset."""
    value = os.environ.get(ENV_PREFIX + name)
    if value is None:
        return default
    try:
        return cast(value)
    except ValueError:
        kind = cast.__name__.strip("_")
        raise ValueError(f"{ENV_PREFIX}{name} must be a valid {kind}, got {value!r}.") from None
