"""The ZO optimizer that a `ZOConfig` describes: `build_zo_optimizer`, a lookup in the optimizers' registry."""

from __future__ import annotations

from ..noise import Noise
from ..optim import ZO_OPTIMIZERS, ZOExecution, ZOOptimizer
from .config import ZOConfig

__all__ = ["build_zo_optimizer"]


def build_zo_optimizer(
    args: ZOConfig, param_groups: list[dict], device_type: str | None = None, execution: ZOExecution | None = None
) -> ZOOptimizer:
    """Instantiate the optimizer registered as `args.zo_optimizer` with the hyper-parameters of `args`: those of every
    `ZOOptimizer`, and the class's own (`config_kwargs`), running with `execution` (engine and parallel layout).

    `device_type` is where the parameters are perturbed, which `zo_noise_algorithm="auto"` follows (default: where
    the first parameter lives; offloaded blocks rest elsewhere).
    """
    cls = ZO_OPTIMIZERS[args.zo_optimizer]
    device_type = device_type or param_groups[0]["params"][0].device.type
    kwargs = dict(
        lr=args.learning_rate,
        eps=args.zo_eps,
        weight_decay=args.weight_decay,
        noise=Noise(
            args.zo_noise,
            algorithm=args.zo_noise_algorithm,
            device_type=device_type,
            stochastic_rounding=args.zo_stochastic_rounding,
        ),
        num_perturbations=args.zo_num_perturbations,
        seed=args.zo_seed,
        max_consecutive_skips=args.zo_max_consecutive_skips,
        cache_noise=args.zo_noise_cache,
        exact_restore=args.zo_exact_restore,
        execution=execution,
    )
    return cls(param_groups, **kwargs, **cls.config_kwargs(args))
