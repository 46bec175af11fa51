"""The dual engine: both perturbed forwards of a ZO estimate in one pass over the blocks (ZO2's schedule).

For a seed ``s`` the sequential engine perturbs every trainable tensor to ``theta + eps z``, runs the loss closure,
moves every tensor to ``theta - eps z`` and runs it again: each tensor is swept twice and, under offload, every block
would cross the bus twice. The dual engine runs the two forwards together (the two halves of a doubled batch, each
half a full forward of the unchanged closure) in lockstep, block by block (see :mod:`hf_zo.engine.lockstep`): when
both passes reach block ``i``, the block's pending update and ``+eps z`` are applied in one sweep, the ``+`` pass runs
the block, ``-2 eps z`` is applied, the ``-`` pass runs it, and ``+eps z`` (the restore) is left pending. With an
offloader the block is fetched once, used by both passes, written back and released.

Trainable tensors outside the blocks (embeddings, final norm, head, PEFT prompt encoders, adapters on embeddings,
``logit_scale``-like scalars) are moved by the coordinator, not by the modules that use them: before a pass starts or
resumes, every one of them is put in that pass's state. Which module reads a tensor, and when, therefore never
matters (a tensor read through an attribute, a tensor in an ``nn.ParameterDict``, one read by the head but owned by
the outer model, whose forward begins before the blocks). While both passes run, each keeps its ``+eps`` state in a
second buffer and the passes switch between the two states by swapping storage: exact, and without sweeps beyond
the sequential engine's (memory: one copy of the trainable tensors outside the blocks).

Every tensor therefore goes through exactly the sweeps of the sequential engine, in the same order, and every
forward runs the same kernels on the same shapes: in fp32 the losses, projected gradients and weights are bitwise
those of the sequential engine.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ..estimator import LazyParameters, SPSAEstimator, loss_value
from ..noise import NoiseUpdate
from .blocks import find_blocks
from .lockstep import Arrival, LockstepPass, current_pass

if TYPE_CHECKING:
    from ..offload import BlockOffloader


class _Unit:
    """Tensors moved together (a block, or all trainable tensors outside the blocks) and their perturbation state.

    `sign` is 0 while the tensors hold their unperturbed values with the update still pending, +1 at
    ``theta + eps z`` and -1 at ``theta - eps z``.
    """

    def __init__(self, positions: list[int], block: int | None = None):
        self.positions = positions
        self.block = block
        self.sign = 0
        self.visited = False  # blocks: reached by the passes in the current estimate
        self.alternate: list[torch.Tensor] | None = None
        self.base_copy: list[torch.Tensor] | None = None


class DualEngine:
    """Runs the two forwards of each ZO estimate together, block by block, optionally with offloaded blocks.

    Give it to an optimizer in its execution (``ZOExecution(engine=engine)``, or ``optimizer.attach_engine(engine)``):
    the optimizer then calls :meth:`wrap` on its sequential estimator (`hf_zo.estimator.SPSAEstimator`), and the
    engine becomes its estimator slot: :meth:`center_forward`, :meth:`signed_forwards` and :meth:`flush` run the
    estimator's sweeps block by block. Works with the optimizers that declare `supports_dual_engine`; with an
    offloader, with those that declare `supports_offload` (`ZOSGD`, whose updates wait in the pending moves until
    each block arrives).

    Args:
        model (`nn.Module`): the model whose loss the closures compute.
        blocks (`list[nn.Module]`, *optional*): its repeated blocks; found with `find_blocks` by default.
        offloader (`hf_zo.offload.BlockOffloader`, *optional*): streams offloaded blocks (its blocks are used).
        exact_restore (`bool`, *optional*):
            Keep a copy of each block (and of the tensors outside the blocks) between the pending update and the
            perturbation, and restore from it after the ``-`` pass instead of leaving ``+eps z`` pending: exact
            restore in bf16/fp16 for the memory of one block, at the cost of bitwise agreement with the
            sequential engine's fp32 sweep order. By default the engine follows the optimizer it is attached to
            (`ZOOptimizer(exact_restore=...)`, whose default turns it on for trainable fp16/bf16 sets of up to 4M
            elements and warns about the drift otherwise).
    """

    def __init__(
        self,
        model: nn.Module,
        blocks: list[nn.Module] | None = None,
        offloader: BlockOffloader | None = None,
        exact_restore: bool | None = None,
    ):
        self.model = model
        self.offloader = offloader
        self.blocks = list(offloader.blocks if offloader is not None else (blocks or find_blocks(model)))
        self.exact_restore = exact_restore
        self._params: LazyParameters | None = None
        self.sequential: SPSAEstimator | None = None
        self._block_units: list[_Unit] = []
        self._rest_units: list[_Unit] = []
        self._write_back: list[list[int]] = []
        self._seed = 0
        self._eps = 0.0
        self._active = False
        self._plus_pass: LockstepPass | None = None
        self._block_hooks = [
            block.register_forward_pre_hook(self._block_pre_hook(b)) for b, block in enumerate(self.blocks)
        ]

    # ------------------------------------------------------------------ the estimator slot

    def wrap(self, estimator: SPSAEstimator) -> DualEngine:
        """Run the estimates of `estimator` (its parameters and eps) from now on; returns the engine, which is then
        the optimizer's estimator slot. An `exact_restore` of `None` follows the estimator's. The blocks are mapped
        to its parameters (:meth:`bind`) when the first estimate or flush runs."""
        self.sequential = estimator
        if self.exact_restore is None:
            self.exact_restore = estimator.exact_restore
        return self

    @property
    def eps(self) -> float:
        """The perturbation scale, that of the wrapped estimator."""
        return self.sequential.eps

    @torch.no_grad()
    def center_forward(self, closure: Callable[[], Any] | None) -> float:
        """The loss at ``theta``: every pending move applied (offloaded blocks fetched and written back), then the
        wrapped estimator's forward on the true weights."""
        self.flush()
        return self.sequential.center_forward(closure)

    # ------------------------------------------------------------------ binding to the optimizer's tensors

    def bind(self, params: LazyParameters) -> None:
        """Map the optimizer's tensors to the blocks; the others form the unit outside the blocks."""
        if params is self._params:
            return
        if self.offloader is not None and params.has_pending():
            raise RuntimeError("Cannot bind offloaded blocks while an update is pending; flush() first.")
        position_of = {id(tensor): k for k, (_, tensor) in enumerate(params.tensors)}
        in_blocks = set()
        self._block_units, self._write_back = [], []
        for b, block in enumerate(self.blocks):
            block_params = list(block.parameters())
            if self.offloader is not None:
                if {id(p) for p in block_params} != {id(p) for p in self.offloader.params[b]}:
                    raise RuntimeError(
                        f"Block {b} has parameters that were not offloaded: the model changed after offload_model "
                        "(e.g. get_peft_model was applied afterwards). Wrap the model first, then offload it."
                    )
                block_params = self.offloader.params[b]
            found = [(k, position_of[id(p)]) for k, p in enumerate(block_params) if id(p) in position_of]
            self._block_units.append(_Unit([pos for _, pos in found], block=b))
            self._write_back.append([k for k, _ in found])
            in_blocks.update(pos for _, pos in found)
        # Everything else is moved as one unit by the coordinator before each pass runs (see `_enter`), so nothing
        # depends on which module owns a tensor or whether its forward is ever called.
        rest = [k for k in range(len(params.tensors)) if k not in in_blocks]
        self._rest_units = [_Unit(rest)] if rest else []
        self._params = params

    # ------------------------------------------------------------------ hooks

    def _block_pre_hook(self, b: int):
        def hook(module, args):
            active = current_pass()
            if self._active and active is not None:
                active.checkpoint(b)

        return hook

    def _enter(self, lockstep: LockstepPass, run: Callable[[], Arrival]) -> Arrival:
        """Put every tensor outside the blocks in the state of `lockstep`'s pass, then let it run (`run` is its
        `start` or `resume`) to its next stop."""
        for unit in self._rest_units:
            self._move(unit, lockstep.sign)
        return _checked(run())

    # ------------------------------------------------------------------ estimate

    @torch.no_grad()
    def signed_forwards(
        self,
        closure: Callable[[], Any] | None,
        seed: int,
        signs: tuple[int, ...] = (+1, -1),
        points: tuple[int, ...] = (+1, -1),
    ) -> tuple[float, float]:
        """The sweeps of one two-point estimate, running only the forwards of `signs` (a subset of ``(+1, -1)``):
        `SPSAEstimator.signed_forwards`, block by block. `points` must be ``(+1, -1)``: both passes run together.

        Every tensor goes through the same sweeps, in the same order, whichever forwards run: with `signs` empty
        (and `closure` unused) each block is visited, perturbed, moved and restored without a forward. This is
        how the ranks of a multi-process layout that run one forward, or none, of an estimate keep their replicas
        bitwise identical to the rank that runs it (`hf_zo.parallel.ParallelEstimation`).

        Returns:
            `tuple[float, float]`: the losses at ``theta + eps z`` and ``theta - eps z``; NaN for a pass not run.
        """
        if tuple(points) != (+1, -1):
            raise ValueError(
                f"The dual engine runs both points of a two-point estimate together, not points={tuple(points)} (a "
                "one-sided estimate); use zo_engine='sequential'."
            )
        self.bind(self.sequential.params)
        self._seed, self._eps = seed, self.eps
        for unit in self._block_units:
            unit.visited = False
        passes = {sign: LockstepPass(sign, closure) for sign in (+1, -1) if sign in signs}
        self._plus_pass = passes.get(+1)
        arrivals: dict[int, Arrival] = {}
        self._active = True
        if self.offloader is not None:
            self.offloader.managed = True
            self.offloader.prefetch_from(0)
        try:
            for sign, lockstep in passes.items():
                arrivals[sign] = self._enter(lockstep, lockstep.start)
            while any(arrival.block is not None for arrival in arrivals.values()):
                reached = [arrival.block for arrival in arrivals.values()]
                if len(set(reached)) > 1:
                    raise RuntimeError(
                        f"The two forward passes of the dual engine reached different blocks ({reached[0]} and "
                        f"{reached[1]}): the model's forward must run the same blocks in the same order for both. "
                        "Use zo_engine='sequential' for this model."
                    )
                unit = self._block_units[reached[0]]
                if unit.visited:
                    raise RuntimeError(
                        f"Block {unit.block} ran twice in one forward (layers shared across depth?); the dual "
                        "engine needs each block to run once per forward. Use zo_engine='sequential'."
                    )
                unit.visited = True
                for sign in (+1, -1):
                    self._move(unit, sign)
                    if sign in passes:
                        arrivals[sign] = self._enter(passes[sign], passes[sign].resume)
                self._finish(unit)
        except BaseException:
            for lockstep in passes.values():
                lockstep.abort()
            for unit in self._block_units + self._rest_units:
                self._abort(unit)
            if self.offloader is not None:
                self.offloader.synchronize()  # drop prefetched copies: storage may change before the next estimate
            raise
        finally:
            self._active = False
            self._plus_pass = None
            if self.offloader is not None:
                self.offloader.managed = False
        # Tensors outside the blocks, and blocks no pass ran, still get the sequential engine's sweeps (bitwise).
        for unit in self._rest_units + [u for u in self._block_units if not u.visited]:
            self._finish(unit)
        # The sequential engine's conversion: float64 losses stay float64, a model output gets its hint.
        losses = {sign: loss_value(arrival.result) for sign, arrival in arrivals.items()}
        return losses.get(+1, math.nan), losses.get(-1, math.nan)

    # ------------------------------------------------------------------ moves of one unit

    def _apply(self, unit: _Unit, updates: list[NoiseUpdate]) -> None:
        params = self._params
        # A perturbation that the saved copy will undo keeps none of its rounding: to nearest, the cheaper way.
        stochastic = False if unit.base_copy is not None else None
        params.noise.apply_([params.tensors[k] for k in unit.positions], updates, stochastic_rounding=stochastic)

    def _tensors(self, unit: _Unit) -> list[torch.Tensor]:
        return [self._params.tensors[k][1] for k in unit.positions]

    def _move(self, unit: _Unit, sign: int) -> None:
        """Bring `unit` to ``theta + sign * eps z``, with exactly the sweeps the sequential engine makes."""
        if unit.sign == sign:
            return
        seed, eps, pending = self._seed, self._eps, self._params.pending
        if unit.sign == 0:
            if unit.block is not None and self.offloader is not None:
                self.offloader.acquire(unit.block)
            updates = [pending[k] for k in unit.positions]
            for k in unit.positions:
                pending[k] = NoiseUpdate()
            if self.exact_restore:
                self._apply(unit, updates)
                unit.base_copy = [t.detach().clone() for t in self._tensors(unit)]
                updates = [NoiseUpdate() for _ in unit.positions]
            for update in updates:
                update.add(seed, eps)
            self._apply(unit, updates)
            unit.sign = +1
            if sign == +1:
                return
        if unit.sign == +1:
            if unit.alternate is not None:
                self._swap(unit)
            else:
                if unit.block is None and self._plus_pass is not None and not self._plus_pass.ended:
                    # The + pass will run again and must find these tensors exactly at +eps, not moved back by
                    # +2 eps z (exact only up to rounding): keep the + state in a second buffer.
                    unit.alternate = [t.detach().clone() for t in self._tensors(unit)]
                self._apply(unit, [NoiseUpdate(terms={seed: -2.0 * eps}) for _ in unit.positions])
            unit.sign = -1
            return
        # Back to +1: only the tensors outside the blocks come back, and they kept their + state above.
        self._swap(unit)
        unit.sign = +1

    def _swap(self, unit: _Unit) -> None:
        """Exchange the tensors' storage with the saved state of the other sign (the tensors' own storage always
        holds the ``-`` state, so a unit finishes in it)."""
        current = [t.data for t in self._tensors(unit)]
        for tensor, saved in zip(self._tensors(unit), unit.alternate):
            tensor.data = saved
        unit.alternate = current

    def _finish(self, unit: _Unit) -> None:
        """After both passes: restore (pending ``+eps z``, or from the exact copy) and return the block to storage."""
        self._move(unit, -1)
        if unit.base_copy is not None:
            for tensor, saved in zip(self._tensors(unit), unit.base_copy):
                tensor.data.copy_(saved)
        else:
            for k in unit.positions:
                self._params.pending[k].add(self._seed, self._eps)
        self._release(unit)

    def _abort(self, unit: _Unit) -> None:
        """After a failure: leave `unit` at its unperturbed values (pending), whatever state it was in."""
        if unit.sign == +1 and unit.alternate is not None:  # back to the tensors' own storage, at the - state
            self._swap(unit)
            unit.sign = -1
        if unit.sign != 0:
            if unit.base_copy is not None:
                for tensor, saved in zip(self._tensors(unit), unit.base_copy):
                    tensor.data.copy_(saved)
            else:
                for k in unit.positions:
                    self._params.pending[k].add(self._seed, -unit.sign * self._eps)
        self._release(unit)

    def _release(self, unit: _Unit) -> None:
        unit.sign = 0
        unit.alternate = unit.base_copy = None
        if unit.block is not None and self.offloader is not None:
            self.offloader.release(unit.block, self._write_back[unit.block])

    # ------------------------------------------------------------------ flush

    @torch.no_grad()
    def flush(self) -> None:
        """Apply every pending update; offloaded blocks are fetched, updated and written back to storage."""
        params = self.sequential.params
        if self.offloader is None:
            params.flush()
            return
        self.bind(params)
        pending = params.pending
        for unit in self._rest_units:
            self._apply_pending(params, unit.positions)
        todo = [u for u in self._block_units if any(not pending[k].is_identity() for k in u.positions)]
        if todo:
            self.offloader.prefetch_from(todo[0].block)
        for unit in todo:
            self.offloader.acquire(unit.block)
            self._apply_pending(params, unit.positions)
            self.offloader.release(unit.block, self._write_back[unit.block])
        self.offloader.synchronize()

    @staticmethod
    def _apply_pending(params: LazyParameters, positions: list[int]) -> None:
        updates = [params.pending[k] for k in positions]
        for k in positions:
            params.pending[k] = NoiseUpdate()
        params.noise.apply_([params.tensors[k] for k in positions], updates)

    def close(self) -> None:
        """Remove the engine's hooks from the model."""
        for hook in self._block_hooks:
            hook.remove()
        self._block_hooks = []


def _checked(arrival: Arrival) -> Arrival:
    if arrival.error is not None:
        raise arrival.error
    return arrival
