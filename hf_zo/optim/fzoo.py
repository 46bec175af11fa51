"""FZOO: one-sided Rademacher estimates around one centre loss, with a step normalised by their spread."""

from __future__ import annotations

import logging
import math

from ..estimator import ZORecord
from .base import Closure, ZOOptimizer, mean_projected_grads

logger = logging.getLogger(__name__)


class FZOO(ZOOptimizer):
    """FZOO (Dang et al., 2025, arXiv 2506.09034), a zeroth-order normalised SGD.

    Each call of :meth:`estimate` measures the loss ``l_0`` at ``theta`` and the losses ``l_i`` at
    ``theta + eps * u_i`` for `num_perturbations` (N) Rademacher directions ``u_i``: N + 1 forwards, each after one
    sweep over the trainable weights. The step is::

        g = mean_i((l_i - l_0) / eps * u_i)
        theta <- (1 - lr * wd) * theta - lr / sigma * g

    with ``sigma`` the standard deviation of the differences ``l_i - l_0`` of the step's estimates (the spread of
    the N perturbed losses of a batch). Dividing by it takes long steps where the loss is flat and short ones where
    it is steep, which a fixed learning rate cannot; the learning rate is therefore of another scale than MeZO's
    (the paper's grid: 1e-6 to 1e-5 for full fine-tuning).

    ``sigma`` is computed from the records' projected gradients (``eps * g_i``), so a trajectory replays the step
    bitwise from its records. The optimizer is stateless apart from the step counter. A step whose estimates all
    give the same loss (``sigma = 0``) changes nothing and is logged.

    Args:
        params, lr, **kwargs: as :class:`ZOOptimizer`.
        num_perturbations (`int`, defaults to 4): N, the one-sided estimates per batch; at least 2.
        noise (`str` or `Noise`, defaults to `"rademacher"`): the perturbation distribution.
    """

    def __init__(self, params, lr: float, num_perturbations: int = 4, noise="rademacher", **kwargs):
        if not isinstance(num_perturbations, int) or num_perturbations < 2:
            raise ValueError(
                f"FZOO normalises its step by the spread of the perturbed losses, so it needs num_perturbations >= 2 "
                f"(zo_num_perturbations in ZOConfig), got {num_perturbations!r}; the paper uses 8."
            )
        super().__init__(params, lr, num_perturbations=num_perturbations, noise=noise, **kwargs)

    def estimate(self, closure: Closure) -> list[ZORecord]:
        """The centre loss and `num_perturbations` one-sided estimates on `closure`, kept for :meth:`step`."""
        if self.parallel is not None or self.engine is not None:
            raise ValueError(
                "FZOO runs with the sequential engine in one process or in plain data parallelism of whole batches "
                "only; use zo_engine='sequential' without perturbation parallelism, or another zo_optimizer."
            )
        loss_center = self.estimator.center_forward(closure)
        estimates = []
        for _ in range(self.num_perturbations):
            seed = self.perturbation_seed(self.zo_step, self._num_estimates)
            self._num_estimates += 1
            loss = self.estimator.one_sided_forward(closure, seed)
            finite = math.isfinite(loss) and math.isfinite(loss_center)
            estimates.append(ZORecord(seed, (loss - loss_center) / self.eps, loss, loss_center) if finite else None)
        if None in estimates:
            logger.warning(
                "Non-finite loss in an FZOO estimate (centre loss %s): the parameters are restored and the estimate "
                "is skipped.",
                loss_center,
            )
        return self.keep_estimates(estimates, closure)

    def _apply_records(self, records: list[ZORecord]) -> None:
        differences = [self.eps * r.projected_grad for r in records]
        mean = sum(differences) / len(differences)
        sigma = math.sqrt(sum((d - mean) ** 2 for d in differences) / len(differences))
        if not sigma > 0:
            logger.info("FZOO step %d: every perturbed loss equals the centre loss; no update.", self.zo_step)
            return
        lrs, wds = self.group_values("lr"), self.group_values("weight_decay")
        self.params.scale([1.0 - lr * wd for lr, wd in zip(lrs, wds)])
        for seed, weight in mean_projected_grads(records):
            self.params.add(seed, [-lr * weight / sigma for lr in lrs])
