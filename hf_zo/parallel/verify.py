"""Replica verification: every few steps, ranks compare a checksum of their trainable parameters (one scalar)."""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from transformers import TrainerCallback

from .collectives import ScalarCollectives

_INTEGER_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def parameter_checksum(tensors: Iterable[torch.Tensor], chunk_numel: int = 1 << 22) -> int:
    """A position-sensitive checksum of the exact bits of `tensors` (equal bits give equal checksums).

    Computed where the tensors live, a chunk at a time, so it costs one read of the parameters and no transfer.
    """
    checksum = None
    for position, tensor in enumerate(tensors):
        bits = tensor.detach().contiguous().view(-1).view(_INTEGER_OF_SIZE[tensor.element_size()])
        for start in range(0, bits.numel(), chunk_numel):
            part = bits[start : start + chunk_numel].to(torch.int64)
            weights = torch.arange(start, start + part.numel(), device=part.device) % 65521 + 1 + position
            term = (part * weights).sum()
            checksum = term if checksum is None else checksum + term
    return 0 if checksum is None else int(checksum)


class ReplicaCheckCallback(TrainerCallback):
    """Stops training with a clear error when the ranks' trainable parameters stop being bit-identical.

    Every `every_steps` optimizer steps each rank flushes its pending update, computes :func:`parameter_checksum` of
    its trainable parameters and all-gathers it (8 bytes per rank).

    Args:
        every_steps (`int`): check interval in optimizer steps (`zo_verify_replicas_steps`).
        collectives (`ScalarCollectives`): the plugin's counted collectives.
        optimizer_of: a function returning the `ZOOptimizer` of the run.
    """

    def __init__(self, every_steps: int, collectives: ScalarCollectives, optimizer_of):
        if every_steps < 1:
            raise ValueError(f"every_steps must be >= 1, got {every_steps}.")
        self.every_steps = every_steps
        self.collectives = collectives
        self.optimizer_of = optimizer_of

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step % self.every_steps:
            return
        optimizer = self.optimizer_of()
        optimizer.flush()
        local = parameter_checksum(tensor for _, tensor in optimizer.params.tensors)
        gathered = self.collectives.all_gather(torch.tensor([local], dtype=torch.int64), dist.group.WORLD)
        checksums = gathered.flatten().tolist()
        if len(set(checksums)) > 1:
            by_rank = ", ".join(f"rank {rank}: {value:#x}" for rank, value in enumerate(checksums))
            raise RuntimeError(
                f"hf_zo: the replicas' trainable parameters differ after step {state.global_step} ({by_rank}). "
                "Replicas stay identical only when every process runs the same torch build, hardware type and "
                "thread count (OMP_NUM_THREADS) and nothing outside the ZO optimizer changes the weights; resume "
                "from the last checkpoint after fixing the difference."
            )
