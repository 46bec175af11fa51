"""`DistZOPlugin`: the execution layout of a DistZO2 run, in the style of Accelerate's plugins."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from datetime import timedelta

import torch
from torch.utils.data import DataLoader

from ..optim.base import ZOOptimizer
from .collectives import CommStats, ScalarCollectives
from .data import shard_by_dp_rank
from .estimation import ParallelEstimation
from .mesh import ZOMesh, build_mesh, default_backend, destroy_process_group

ENV_PREFIX = "HF_ZO_"
DEFAULT_TIMEOUT_SECONDS = 1800.0


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

    Attributes:
        mesh (`ZOMesh`): this rank's place in the layout, once :meth:`setup` has run.
        collectives (`ScalarCollectives`): the counted collectives of the mesh, once :meth:`setup` has run.
    """

    perturbation_parallel_size: int | None = None
    backend: str | None = None
    timeout_seconds: float | None = None
    mesh: ZOMesh | None = field(default=None, init=False, repr=False)
    collectives: ScalarCollectives | None = field(default=None, init=False, repr=False)

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

    @classmethod
    def from_zo_config(cls, args) -> DistZOPlugin:
        """The plugin described by a `ZOConfig`: `zo_perturbation_parallel_size` and `ddp_timeout`.

        A field left at its default gives way to the matching `HF_ZO_*` environment variable; a field set to
        something else must agree with it.
        """
        size = args.zo_perturbation_parallel_size
        env_size = _from_env("PERTURBATION_PARALLEL_SIZE", int, None)
        if size != 1 and env_size is not None and env_size != size:
            raise ValueError(
                f"zo_perturbation_parallel_size={size} disagrees with HF_ZO_PERTURBATION_PARALLEL_SIZE={env_size}; "
                "set only one of them."
            )
        return cls(
            perturbation_parallel_size=None if size == 1 else size,
            timeout_seconds=_from_env("TIMEOUT", float, float(args.ddp_timeout)),
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
        return self.mesh

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

    def prepare_optimizer(self, optimizer: ZOOptimizer) -> ZOOptimizer:
        """Make `optimizer` split its estimates over the mesh (nothing changes in a single process).

        Args:
            optimizer (`ZOOptimizer`): built over the same parameters, base seed and hyper-parameters on every rank.

        Returns:
            `ZOOptimizer`: the same optimizer.
        """
        mesh = self.setup()
        if mesh.world_size > 1 and optimizer.parallel is None:
            strategy = ParallelEstimation(mesh, self.collectives)
            strategy.check(optimizer)
            optimizer.parallel = strategy
        return optimizer

    def prepare_data_loader(self, dataloader: DataLoader) -> DataLoader:
        """Shard a dataloader prepared by Accelerate by DP rank (ranks of one PertP group get the same batches)."""
        return shard_by_dp_rank(dataloader, self.setup())

    def destroy(self) -> None:
        """Destroy the process groups now (also done automatically at interpreter exit)."""
        destroy_process_group()
        self.mesh = None


def _from_env(name: str, cast: type, default):
    """The value of environment variable ``HF_ZO_{name}`` converted by `cast`, or `default` if it is unset."""
    value = os.environ.get(ENV_PREFIX + name)
    if value is None:
        return default
    try:
        return cast(value)
    except ValueError:
        raise ValueError(f"{ENV_PREFIX}{name} must be a valid {cast.__name__}, got {value!r}.") from None
