"""FZOO: one-sided Rademacher estimates around one centre loss, with a step normalised by their spread."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable

from ..estimator import EstimateLosses, ZORecord
from .base import Closure, ZOOptimizer, mean_projected_grads

logger = logging.getLogger(__name__)

ONE_SIDED = (+1,)


class FZOO(ZOOptimizer, name="fzoo"):
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

    Under ZO data parallelism each rank runs the forwards of its own micro-batches and only sweeps its peers'
    perturbations, as for the two-point optimizers; perturbation parallelism and the dual engine are refused.

    Args:
        params, lr, **kwargs: as :class:`ZOOptimizer`.
        num_perturbations (`int`, defaults to 4): N, the one-sided estimates per batch; at least 2.
        noise (`str` or `Noise`, defaults to `"rademacher"`): the perturbation distribution.
    """

    stateless = True
    default_noise = "rademacher"
    min_num_perturbations = 2
    supports_dual_engine = False
    supports_perturbation_parallel = False
    supports_fsdp = True
    limitations = {
        "num_perturbations": "divides its step by the spread of the perturbed losses (the paper uses 8)",
        "dual_engine": "runs one-sided forwards around a centre loss",
        "perturbation_parallel": "zo_optimizer='fzoo' runs one-sided forwards around a centre loss",
    }

    def __init__(self, params, lr: float, num_perturbations: int = 4, **kwargs):
        super().__init__(params, lr, num_perturbations=num_perturbations, **kwargs)

    def run_forwards(
        self, closure: Closure | None, first: int, signs: Callable[[int], tuple[int, ...]] | None = None
    ) -> list[EstimateLosses]:
        """The centre loss, then one sweep and forward at ``theta + eps u_i`` per estimate (see
        :meth:`ZOOptimizer.run_forwards`; without `closure`, the same sweeps and no forward)."""
        loss_center = self.estimator.center_forward(closure)
        losses = []
        for j in range(self.num_perturbations):
            seed = self._start_estimate(first + j, counted=closure is not None)
            run = () if closure is None else ONE_SIDED
            loss, _ = self.estimator.signed_forwards(closure, seed, signs=run, points=ONE_SIDED)
            losses.append(EstimateLosses(seed, loss, math.nan, loss_center))
        return losses

    def records_from(self, losses: list[EstimateLosses]) -> list[ZORecord | None]:
        """``(l_i - l_0) / eps`` as each record's projected gradient (`None`, with a warning, if a loss is not
        finite); the record keeps ``l_i`` as `loss_plus` and ``l_0`` as `loss_minus`."""
        records = [
            ZORecord(e.seed, (e.loss_plus - e.loss_center) / self.eps, e.loss_plus, e.loss_center)
            if math.isfinite(e.loss_plus) and math.isfinite(e.loss_center)
            else None
            for e in losses
        ]
        if None in records:
            logger.warning(
                "Non-finite loss in an FZOO estimate (centre loss %s): the parameters are restored and the estimate "
                "is skipped.",
                losses[0].loss_center if losses else None,
            )
        return records

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
