"""Perturbation-parallel and ZO data-parallel estimation: how the replicas of a mesh split one optimizer step.

Every rank follows the same sequence of parameter sweeps, the one a single process would follow with gradient
accumulation over all the micro-batches of the step (DP rank ``r``'s ``m``-th micro-batch of a step is global
micro-batch ``m * dp + r``, as Accelerate's batch sharding hands them out). Only the forwards are split: DP rank
``r`` runs those of its own micro-batches, and within a PertP group the ``2q`` signed forwards of a micro-batch
go round-robin to its ``p`` ranks. The losses are then exchanged as scalars, so every rank builds the same records,
applies them in the same order and holds bitwise the same parameters as every other rank, and as the single
process doing all the forwards itself (same intra-op thread count assumed, since a forward's rounding depends on
it). The price: each rank also sweeps the perturbations whose forwards other ranks run (memory-bound, no forward).

With the dual engine (`zo_engine="dual"`, with or without offload) each rank runs its share of the forwards
through the engine, which replays block by block the sweeps of the forwards this rank does not run (for a DP
peer's micro-batch: every block visited, no forward), so the replicas stay bitwise identical as well; under
offload each rank streams the blocks from its own storage (or, with sliced upload, its slice of them: see
`hf_zo.parallel.sliced`).
"""

from __future__ import annotations

import math

import torch

from ..estimator import ZORecord, _as_float, make_record
from ..optim.base import Closure, ZOOptimizer
from ..optim.sgd import ZOSGDConservative
from .collectives import ScalarCollectives
from .mesh import ZOMesh

_RECORD_FIELDS = 5  # (k, seed, projected_grad bits, loss_plus bits, loss_minus bits), as int64; + curvature bits


class ParallelEstimation:
    """The strategy a `ZOOptimizer` defers to when it runs on a (dp, pertp) mesh (its `parallel` attribute).

    Args:
        mesh (`ZOMesh`): this rank's place in the layout.
        collectives (`ScalarCollectives`): the counted collectives to exchange losses and records with.
    """

    def __init__(self, mesh: ZOMesh, collectives: ScalarCollectives):
        self.mesh = mesh
        self.collectives = collectives
        self._index_of_seed: dict[int, int] = {}

    def check(self, optimizer: ZOOptimizer) -> None:
        """Raise if `optimizer` cannot run on this mesh (called when the strategy is attached)."""
        forwards = 2 * optimizer.num_perturbations
        if forwards % self.mesh.pertp_size:
            raise ValueError(
                f"zo_perturbation_parallel_size ({self.mesh.pertp_size}) must divide the {forwards} signed forwards "
                f"of a micro-batch (2 * zo_num_perturbations = 2 * {optimizer.num_perturbations}); use a divisor of "
                f"{forwards} or raise zo_num_perturbations."
            )
        if self.mesh.pertp_size > 1 and optimizer.needs_center_loss:
            raise ValueError(
                f"{type(optimizer).__name__} measures the loss at the unperturbed weights before each two-point "
                "estimate, which perturbation parallelism does not split between ranks; set "
                f"zo_perturbation_parallel_size=1 (got {self.mesh.pertp_size}) and use data parallelism instead."
            )
        if self.mesh.dp_size > 1 and isinstance(optimizer, ZOSGDConservative):
            raise ValueError(
                "zo_sgd_cons chooses its update from the loss on each rank's own last batch, so data-parallel "
                f"replicas (dp={self.mesh.dp_size}) would diverge; use another zo_optimizer or "
                "zo_perturbation_parallel_size equal to the number of processes."
            )

    # ------------------------------------------------------------------ estimate

    @torch.no_grad()
    def estimate(self, optimizer: ZOOptimizer, closure: Closure) -> list[ZORecord]:
        """This rank's share of `optimizer.estimate(closure)`: see the module docstring.

        Returns the records of this rank's micro-batch (identical on the ranks of its PertP group).
        """
        q, dp = optimizer.num_perturbations, self.mesh.dp_size
        micro_batch = optimizer._num_estimates // q
        optimizer._num_estimates += q
        own_seeds, own_losses, own_centers = [], [], []
        for dp_rank in range(dp):
            mine = dp_rank == self.mesh.dp_rank
            for j in range(q):
                k = (micro_batch * dp + dp_rank) * q + j
                seed = optimizer.perturbation_seed(optimizer.zo_step, k)
                center = self._center_forward(optimizer, closure if mine else None)
                losses = self._signed_forwards(optimizer, closure if mine else None, seed, j)
                if mine:
                    self._index_of_seed[seed] = k
                    own_seeds.append(seed)
                    own_losses.append(losses)
                    own_centers.append(center)
        losses = self._exchange_losses(own_losses)
        records = [
            make_record(seed, plus, minus, optimizer.eps, center)
            for seed, (plus, minus), center in zip(own_seeds, losses, own_centers)
        ]
        return optimizer.keep_estimates(records, closure)

    @staticmethod
    def _center_forward(optimizer: ZOOptimizer, closure: Closure | None) -> float | None:
        """The loss at the unperturbed weights for an optimizer that needs it (HiZOO; `None` for the others), made
        as `SPSAEstimator.estimate` makes it: every rank applies the pending restore, the owner of the batch runs
        the forward (the others get NaN; only the owner's records use it)."""
        if not optimizer.needs_center_loss:
            return None
        optimizer.params.flush()
        return math.nan if closure is None else _as_float(closure())

    def _signed_forwards(self, optimizer: ZOOptimizer, closure: Closure | None, seed: int, j: int) -> list[float]:
        """The sweeps of one estimate, running only the forwards assigned to this rank (the others: NaN).

        With the dual engine (and offload) the engine replays the sweeps of the forwards it does not run, block by
        block (`DualEngine.signed_forwards`); otherwise the optimizer's own estimator makes them
        (`SPSAEstimator.signed_forwards`): the very sweeps of a single process, so the weights move as they do
        there, restored from a copy with `exact_restore` (bf16/fp16 weights do not drift at lr = 0) and put back
        before the exception propagates if the closure raises.
        """
        p, rank = self.mesh.pertp_size, self.mesh.pertp_rank
        signs = () if closure is None else tuple(s for f, s in enumerate((+1, -1)) if (2 * j + f) % p == rank)
        engine = getattr(optimizer, "engine", None)
        if engine is not None:
            return list(engine.signed_forwards(optimizer.params, optimizer.eps, closure, seed, signs))
        return list(optimizer.estimator.signed_forwards(closure, seed, signs))

    def _exchange_losses(self, own_losses: list[list[float]]) -> list[tuple[float, float]]:
        """Share each rank's forwards with its PertP group: forward ``f = 2 j + sign`` comes from rank ``f % p``."""
        p = self.mesh.pertp_size
        if p == 1:
            return [(plus, minus) for plus, minus in own_losses]
        flat = [loss for pair in own_losses for loss in pair]
        mine = torch.tensor(flat[self.mesh.pertp_rank :: p], dtype=torch.float64)
        gathered = self.collectives.all_gather(mine, self.mesh.pertp_group)
        for f in range(len(flat)):
            flat[f] = float(gathered[f % p, f // p])
        return [(flat[2 * j], flat[2 * j + 1]) for j in range(len(own_losses))]

    # ------------------------------------------------------------------ step

    def gather_records(self, optimizer: ZOOptimizer, records: list[ZORecord]) -> list[ZORecord]:
        """All the step's records of every DP group, in global micro-batch order (what one process would hold).

        Two all-gathers over the DP group: the record counts, then the records (padded to the longest), with their
        curvatures when the optimizer uses them.
        """
        index_of_seed, self._index_of_seed = self._index_of_seed, {}
        if self.mesh.dp_size == 1:
            return records
        group = self.mesh.dp_group
        curvatures = optimizer.needs_center_loss
        counts = self.collectives.all_gather(torch.tensor([len(records)], dtype=torch.int64), group)
        if not int(counts.max()):  # a step discarded on every rank (`ZOOptimizer.discard_step`)
            return []
        rows = torch.zeros((int(counts.max()), _RECORD_FIELDS + curvatures), dtype=torch.int64)
        for i, record in enumerate(records):
            values = [record.projected_grad, record.loss_plus, record.loss_minus]
            values += [record.curvature] if curvatures else []
            rows[i, 0] = index_of_seed[record.seed]
            rows[i, 1] = record.seed
            rows[i, 2:] = torch.tensor(values, dtype=torch.float64).view(torch.int64)
        gathered = self.collectives.all_gather(rows, group)
        indexed = []
        for rank_rows, count in zip(gathered, counts.view(-1).tolist()):
            for row in rank_rows[:count]:
                values = row[2:].clone().view(torch.float64).tolist()
                indexed.append((int(row[0]), ZORecord(int(row[1]), *values)))
        return [record for _, record in sorted(indexed, key=lambda item: item[0])]
