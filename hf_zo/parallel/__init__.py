"""DistZO2 on Accelerate: perturbation parallelism and scalar-only ZO data parallelism over a (dp, pertp) mesh."""

from .collectives import CommStats, ScalarCollectives
from .data import shard_by_dp_rank
from .estimation import ParallelEstimation
from .mesh import ZOMesh, build_mesh
from .plugin import DistZOPlugin

__all__ = [
    "CommStats",
    "DistZOPlugin",
    "ParallelEstimation",
    "ScalarCollectives",
    "ZOMesh",
    "build_mesh",
    "shard_by_dp_rank",
]
