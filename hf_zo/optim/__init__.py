"""Zeroth-order optimizers: each turns ``(seed, projected_grad)`` records into parameter updates.

Each optimizer registers itself under its `ZOConfig.zo_optimizer` name (``class ...(ZOOptimizer, name=...)``) and
declares what the rest of hf_zo asks of it (see `ZOOptimizer`); importing its module here is all it takes to add one.
"""

# isort: off
# Importing a module registers its optimizers, in this order (that of `ZO_OPTIMIZERS` and of the CLI's choices).
from .sgd import ZOSGD, ZOSGDConservative, ZOSGDMomentum, ZOSGDSign
from .adam import ZOAdam
from .lozo import LOZO, LowRankNoise
from .hizoo import HiZOO, PreconditionedNoise
from .fzoo import FZOO

# isort: on
from .base import ZO_OPTIMIZERS, ZOOptimizer
from .chunkwise import ChunkwiseZOOptimizer
from .execution import ZOExecution

__all__ = [
    "FZOO",
    "ChunkwiseZOOptimizer",
    "HiZOO",
    "LOZO",
    "LowRankNoise",
    "PreconditionedNoise",
    "ZO_OPTIMIZERS",
    "ZOAdam",
    "ZOExecution",
    "ZOOptimizer",
    "ZOSGD",
    "ZOSGDConservative",
    "ZOSGDMomentum",
    "ZOSGDSign",
]
