"""`ZOExecution`: how an optimizer's estimates run, given to it in one object.

An optimizer runs every estimate through its estimator slot (`hf_zo.estimator.SPSAEstimator`'s `center_forward`,
`signed_forwards` and `flush`). Two collaborators change how, and both are given here, at construction
(``ZOSGD(params, lr, execution=ZOExecution(...))``) or later through :meth:`ZOOptimizer.set_execution`:

- the engine (`hf_zo.engine.DualEngine`) wraps the sequential estimator and runs the same sweeps block by block;
- the parallel layout (`hf_zo.parallel.ParallelEstimation`) decides, on a (dp, pertp) mesh, which micro-batches'
  estimates and which of their forwards this process runs, exchanges the losses and gathers the step's records.

Both are described here by the methods the optimizer calls on them (`Protocol`s), so that this layer imports
neither `hf_zo.engine` nor `hf_zo.parallel`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from ..estimator import EstimateLosses, SPSAEstimator, ZORecord

Closure = Callable[[], torch.Tensor | float]


class Estimator(Protocol):
    """The estimator slot: what an optimizer calls to run the forwards of its estimates."""

    eps: float
    exact_restore: bool | None

    def center_forward(self, closure: Closure | None) -> float:
        """Apply the pending move and return the loss at ``theta`` (NaN without `closure`)."""

    def signed_forwards(
        self, closure: Closure | None, seed: int, signs: tuple[int, ...] = (+1, -1), points: tuple[int, ...] = (+1, -1)
    ) -> tuple[float, float]:
        """The sweeps of one estimate through `points`, with the forwards of `signs`: ``(loss_plus, loss_minus)``."""

    def flush(self) -> None:
        """Apply the pending move."""


class Engine(Protocol):
    """An execution engine: wraps the sequential estimator of an optimizer's parameters."""

    def wrap(self, estimator: SPSAEstimator) -> Estimator:
        """The estimator slot that runs `estimator`'s estimates this engine's way (same parameters and eps)."""


class ParallelLayout(Protocol):
    """A multi-process layout: which estimates and forwards this process runs, and the records of a step. Its methods
    take the `ZOOptimizer` running the step (typed by its base class, since this module sits below it)."""

    def check(self, optimizer: torch.optim.Optimizer) -> None:
        """Raise if `optimizer` cannot run on this layout."""

    def run_forwards(
        self, optimizer: torch.optim.Optimizer, closure: Closure, micro_batch: int
    ) -> list[EstimateLosses]:
        """The losses of this process's `micro_batch`-th micro-batch of the step (exchanged within its group)."""

    def gather_records(self, optimizer: torch.optim.Optimizer, records: list[ZORecord]) -> list[ZORecord]:
        """Every process's records of the step, in the order one process would hold them."""


@dataclass(frozen=True)
class ZOExecution:
    """How a `ZOOptimizer` runs its estimates.

    Args:
        engine (`Engine`, *optional*):
            Runs the forwards of each estimate (e.g. `hf_zo.engine.DualEngine`); `None`: the sequential estimator,
            the whole model at each perturbation. An engine whose `exact_restore` is `None` restores as the
            optimizer does.
        parallel (`ParallelLayout`, *optional*):
            Shares the estimates of a step among processes (`hf_zo.parallel.ParallelEstimation`, which
            `hf_zo.parallel.DistZOPlugin.layout` builds); `None`: one process runs them all.
    """

    engine: Engine | None = None
    parallel: ParallelLayout | None = None
