"""Perturbation-parallel and ZO data-parallel estimation: how the replicas of a mesh split one optimizer step.

Every rank follows the same sequence of parameter sweeps, the one a single process would follow with gradient
accumulation over all the micro-batches of the step (DP rank ``r``'s ``m``-th micro-batch of a step is global
micro-batch ``m * dp + r``, as Accelerate's batch sharding hands them out). Only the forwards are split: DP rank
``r`` runs those of its own micro-batches, and within a PertP group the ``2q`` signed forwards of a micro-batch
go round-robin to its ``p`` ranks. The losses are then exchanged as scalars, so every rank builds the same records,
applies them in the same order and holds bitwise the same parameters as every other rank, and as the single
process doing all the forwards itself (same intra-op thread count assumed, since a forward's rounding depends on
it). The price: each rank also sweeps the perturbations whose forwards other ranks run (memory-bound, no forward).

The sweeps and forwards themselves run through the optimizer's estimator slot. With the dual engine
(`zo_engine="dual"`, with or without offload) the engine replays block by block the sweeps of the forwards this
rank does not run (for a DP peer's micro-batch: every block visited, no forward), so the replicas stay bitwise
identical as well; under offload each rank streams the blocks from its own storage (or, with sliced upload, its
slice of them: see `hf_zo.parallel.sliced`).
"""

from __future__ import annotations

from dataclasses import replace

import torch

from ..estimator import EstimateLosses, ZORecord
from ..optim.base import Closure, ZOOptimizer
from .collectives import ScalarCollectives
from .fsdp import ShardedForwards
from .mesh import ZOMesh

_RECORD_FIELDS = 5  # (k, seed, projected_grad bits, loss_plus bits, loss_minus bits), as int64; + curvature bits


def check_perturbation_parallel_size(pertp_size: int, num_perturbations: int) -> None:
    """Raise unless `pertp_size` divides the ``2 * num_perturbations`` signed forwards of a micro-batch, which the
    ranks of a perturbation-parallel group split between them."""
    forwards = 2 * num_perturbations
    if forwards % pertp_size:
        raise ValueError(
            f"zo_perturbation_parallel_size ({pertp_size}) must divide the {forwards} signed forwards of a "
            f"micro-batch (2 * zo_num_perturbations = 2 * {num_perturbations}); use a divisor of {forwards} or raise "
            "zo_num_perturbations."
        )


class ParallelEstimation:
    """The parallel layout of a `ZOOptimizer` on a (dp, pertp) mesh (given to it in a `hf_zo.optim.ZOExecution`).

    It decides which micro-batches' estimates and which of their forwards this rank runs, and calls the optimizer's
    own :meth:`~hf_zo.optim.ZOOptimizer.run_forwards` for each micro-batch (without a closure for a DP peer's: the
    sweeps only); the optimizer counts its estimates and builds and keeps its records.

    Args:
        mesh (`ZOMesh`): this rank's place in the layout.
        collectives (`ScalarCollectives`): the counted collectives to exchange losses and records with.
        sharded_model (`torch.nn.Module`, *optional*): the model when its parameters are FSDP2-sharded
            (`hf_zo.parallel.fsdp`), which the optimizer must support; its forwards are then hooked to see this
            rank's point of the step (`ShardedForwards`, for the optimizer whose forwards run).
    """

    def __init__(self, mesh: ZOMesh, collectives: ScalarCollectives, sharded_model: torch.nn.Module | None = None):
        self.mesh = mesh
        self.collectives = collectives
        self.sharded_model = sharded_model
        self._sharded_forwards: ShardedForwards | None = None
        self._index_of_seed: dict[int, int] = {}

    def check(self, optimizer: ZOOptimizer) -> None:
        """Raise if `optimizer` cannot run on this mesh (called when the layout is given to it): its declarations
        (:meth:`~hf_zo.optim.ZOOptimizer.check_execution`), and a PertP size that divides a micro-batch's forwards."""
        check_perturbation_parallel_size(self.mesh.pertp_size, optimizer.num_perturbations)
        type(optimizer).check_execution(
            dp_size=self.mesh.dp_size, pertp_size=self.mesh.pertp_size, fsdp=self.sharded_model is not None
        )

    # ------------------------------------------------------------------ estimate

    @torch.no_grad()
    def run_forwards(self, optimizer: ZOOptimizer, closure: Closure, micro_batch: int) -> list[EstimateLosses]:
        """This rank's share of the forwards of its `micro_batch`-th micro-batch of the step: see the module
        docstring.

        Returns the losses of this rank's micro-batch, complete (identical on the ranks of its PertP group).
        """
        q, dp = optimizer.num_perturbations, self.mesh.dp_size
        self._hook_sharded_forwards(optimizer)
        own = []
        for dp_rank in range(dp):
            mine = dp_rank == self.mesh.dp_rank
            first = (micro_batch * dp + dp_rank) * q
            losses = optimizer.run_forwards(closure if mine else None, first, self._signs_of_forwards)
            if mine:
                own = losses
                self._index_of_seed.update((e.seed, first + j) for j, e in enumerate(losses))
        return self._exchange_losses(own)

    def _hook_sharded_forwards(self, optimizer: ZOOptimizer) -> None:
        """Under FSDP2, make the model's forwards see this rank's point of `optimizer`'s step (once per optimizer)."""
        if self.sharded_model is None:
            return
        current = self._sharded_forwards
        if current is None or current.params is not optimizer.params:
            if current is not None:
                current.remove()
            self._sharded_forwards = ShardedForwards(self.sharded_model, optimizer.params)

    def _signs_of_forwards(self, j: int) -> tuple[int, ...]:
        """The forwards of estimate `j` of a micro-batch that this rank runs: forward ``f = 2 j + (0 for +, 1 for
        -)`` goes to PertP rank ``f % p``."""
        p, rank = self.mesh.pertp_size, self.mesh.pertp_rank
        return tuple(sign for f, sign in enumerate((+1, -1)) if (2 * j + f) % p == rank)

    def _exchange_losses(self, own: list[EstimateLosses]) -> list[EstimateLosses]:
        """Share each rank's forwards with its PertP group: forward ``f = 2 j + sign`` comes from rank ``f % p``."""
        p = self.mesh.pertp_size
        if p == 1:
            return own
        flat = [loss for e in own for loss in (e.loss_plus, e.loss_minus)]
        mine = torch.tensor(flat[self.mesh.pertp_rank :: p], dtype=torch.float64)
        gathered = self.collectives.all_gather(mine, self.mesh.pertp_group)
        for f in range(len(flat)):
            flat[f] = float(gathered[f % p, f // p])
        return [replace(e, loss_plus=flat[2 * j], loss_minus=flat[2 * j + 1]) for j, e in enumerate(own)]

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
