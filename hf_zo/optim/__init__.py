"""Zeroth-order optimizers: each turns ``(seed, projected_grad)`` records into parameter updates."""

from .adam import ZOAdam
from .base import ZOOptimizer
from .fzoo import FZOO
from .hizoo import HiZOO, PreconditionedNoise
from .lozo import LOZO, LowRankNoise
from .sgd import ZOSGD, ZOSGDConservative, ZOSGDMomentum, ZOSGDSign

ZO_OPTIMIZERS: dict[str, type[ZOOptimizer]] = {
    "zo_sgd": ZOSGD,
    "zo_sgd_momentum": ZOSGDMomentum,
    "zo_sgd_sign": ZOSGDSign,
    "zo_sgd_cons": ZOSGDConservative,
    "zo_adam": ZOAdam,
    "lozo": LOZO,
    "hizoo": HiZOO,
    "fzoo": FZOO,
}
"""The optimizers selectable by name (`ZOConfig.zo_optimizer`)."""

__all__ = [
    "FZOO",
    "HiZOO",
    "LOZO",
    "LowRankNoise",
    "PreconditionedNoise",
    "ZO_OPTIMIZERS",
    "ZOAdam",
    "ZOOptimizer",
    "ZOSGD",
    "ZOSGDConservative",
    "ZOSGDMomentum",
    "ZOSGDSign",
]
