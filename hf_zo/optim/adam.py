"""ZO-Adam: Adam moments over the zeroth-order gradient estimate."""

from __future__ import annotations

from .chunkwise import ChunkwiseZOOptimizer


class ZOAdam(ChunkwiseZOOptimizer, name="zo_adam"):
    """Adam (with decoupled weight decay, as AdamW) on ``g = mean_i(g_i * z_i)``.

    State: the first and second moments of each parameter and a step count per group. Args as
    :class:`~hf_zo.optim.ZOOptimizer`, plus `betas` (default ``(0.9, 0.999)``) and `adam_eps` (default 1e-8).
    """

    state_keys = ("exp_avg", "exp_avg_sq")
    group_hyperparameters = ("betas", "adam_eps", "adam_step")

    @classmethod
    def config_kwargs(cls, args) -> dict:
        """`betas` from `adam_beta1` and `adam_beta2`, `adam_eps` from `adam_epsilon` (`TrainingArguments`' fields)."""
        return {"betas": (args.adam_beta1, args.adam_beta2), "adam_eps": args.adam_epsilon}

    def __init__(self, params, lr: float, betas: tuple[float, float] = (0.9, 0.999), adam_eps: float = 1e-8, **kw):
        if not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"betas must be in [0, 1), got {betas}.")
        if not adam_eps > 0:
            raise ValueError(f"adam_eps must be > 0, got {adam_eps}.")
        super().__init__(params, lr, betas=tuple(betas), adam_eps=adam_eps, adam_step=0, **kw)

    def _begin_step(self) -> None:
        for group in self.param_groups:
            group["adam_step"] += 1

    def _update_chunk(self, chunk, grad, state, group):
        exp_avg, exp_avg_sq = state
        beta1, beta2 = group["betas"]
        step = group["adam_step"]
        exp_avg.mul_(beta1).add_(grad, alpha=1.0 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1.0 - beta2)
        if group["weight_decay"]:
            chunk.mul_(1.0 - group["lr"] * group["weight_decay"])
        denom = (exp_avg_sq / (1.0 - beta2**step)).sqrt_().add_(group["adam_eps"])
        chunk.addcdiv_(exp_avg.to(denom.dtype), denom, value=-group["lr"] / (1.0 - beta1**step))
