"""`ChunkwiseZOOptimizer`: the base of ZO optimizers whose update sweeps the weights chunk by chunk with a state."""

from __future__ import annotations

from abc import abstractmethod

import torch

from ..estimator import ZORecord
from ..noise import NoiseUpdate
from .base import ZOOptimizer, mean_projected_grads


class ChunkwiseZOOptimizer(ZOOptimizer):
    """Base of the ZO optimizers with per-element state (momentum, Adam's moments, HiZOO's curvature).

    Their update cannot wait in the pending move, so each step is one sweep over the trainable tensors that applies
    the pending move, regenerates ``g = mean_i(g_i z_i)`` chunk by chunk, and hands each chunk, its gradient and its
    state to :meth:`_update_chunk`. A subclass names its state tensors in `state_keys` (created as zeros) and
    implements :meth:`_update_chunk`; :meth:`_begin_step` runs once per step before the sweep."""

    state_keys: tuple[str, ...] = ()

    def _state_tensors(self, param: torch.Tensor) -> list[torch.Tensor]:
        state = self.state[param]
        for key in self.state_keys:
            if key not in state:
                state[key] = torch.zeros_like(param, memory_format=torch.contiguous_format)
        return [state[key].view(-1) for key in self.state_keys]

    def _begin_step(self) -> None:
        """Hook run once per step before the sweep (e.g. to advance bias-correction counters)."""

    @abstractmethod
    def _update_chunk(self, chunk: torch.Tensor, grad: torch.Tensor, state: list[torch.Tensor], group: dict) -> None:
        """Update one chunk of a parameter in place from its gradient chunk and its state chunks."""

    def _apply_records(self, records: list[ZORecord]) -> None:
        self._begin_step()
        pending = self.params.take_pending()
        weights = mean_projected_grads(records)
        tensors = self.params.tensors
        states = [self._state_tensors(p) for _, p in tensors]

        def visit(position, start, chunk, scratch):
            z, grad = scratch
            self._restore_and_average(chunk, z, grad, tensors[position][0], start, pending[position], weights)
            stop = start + chunk.numel()
            group = self.param_groups[self._group_of[position]]
            self._update_chunk(chunk, grad, [s[start:stop] for s in states[position]], group)

        self.noise.map_chunks(tensors, visit, num_scratch=2)

    def _restore_and_average(
        self,
        chunk: torch.Tensor,
        z: torch.Tensor,
        grad: torch.Tensor,
        index: int,
        start: int,
        update: NoiseUpdate,
        weights: list[tuple[int, float]],
    ) -> None:
        """Apply the pending `update` to `chunk` and write ``g = sum_i w_i z_i`` of the same elements into `grad`
        (`z` is scratch for the noise), for ``(seed_i, w_i)`` in `weights`."""
        self.noise.update_chunk_(chunk, z, index, start, update.decay, list(update.terms.items()))
        grad.zero_()
        self.noise.update_chunk_(grad, z, index, start, 1.0, weights)
