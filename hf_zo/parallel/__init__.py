"""DistZO2 on Accelerate: perturbation parallelism and scalar-only ZO data parallelism over a (dp, pertp) mesh,
sliced upload of offloaded blocks, and FSDP2 shards that each process sweeps on its own (`hf_zo.parallel.fsdp`)."""

from .collectives import CommStats, ScalarCollectives
from .data import shard_by_dp_rank
from .estimation import ParallelEstimation
from .mesh import ZOMesh, build_mesh
from .plugin import DistZOPlugin
from .sliced import SlicedTransport

__all__ = [
    "CommStats",
    "DistZOPlugin",
    "ParallelEstimation",
    "ScalarCollectives",
    "SlicedTransport",
    "ZOMesh",
    "build_mesh",
    "shard_by_dp_rank",
]
