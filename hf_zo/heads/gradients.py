"""The first-order head's gradient sum over a (dp, pertp) mesh, added in the order one process adds it.

One process accumulating ``k * dp`` micro-batches adds the gradients of each micro-batch's forward passes left to
right (autograd's accumulation into ``.grad``), then the micro-batch totals left to right. On the mesh, forward
``f = 2 j + sign`` of global micro-batch ``m = i * dp + d`` (the ``i``-th micro-batch of DP group ``d``) runs on
rank ``d * pertp + f % pertp``, as that rank's ``(f // pertp)``-th forward of its ``i``-th micro-batch (the
assignment of :class:`~hf_zo.parallel.ParallelEstimation`). Every rank gathers every forward's gradients (head-sized
tensors) and adds them in that order, so all ranks hold the single process's bits, in any layout: DP, PertP or both.

Without perturbation parallelism a rank runs every forward of its micro-batches and sends one sum per micro-batch
(autograd added its forwards in the single process's order already).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from ..parallel.mesh import ZOMesh

Gradients = list[torch.Tensor | None]  # a gradient of each head parameter (None: it got none)
MicroBatch = list[Gradients]  # one rank's part of a micro-batch: its forwards in order (PertP), or their sum

__all__ = ["Gradients", "MicroBatch", "sum_in_single_process_order"]


def sum_in_single_process_order(
    micro_batches: list[MicroBatch], num_forwards: int, params: Sequence[torch.Tensor], mesh: ZOMesh
) -> tuple[Gradients, int]:
    """Sum this step's head gradients over every rank of `mesh`, in the order of one process (module docstring).

    Args:
        micro_batches (`list[MicroBatch]`): this rank's micro-batches of the step: under perturbation parallelism
            the gradients of each forward it ran, in order; otherwise one sum per micro-batch.
        num_forwards (`int`): the forwards these gradients come from, on this rank.
        params (`Sequence[torch.Tensor]`): the head parameters (shapes, dtypes and device of the gradients).
        mesh (`ZOMesh`): this rank's place in the layout; a single process needs no collective.

    Returns:
        `tuple[Gradients, int]`: the summed gradient of each parameter (`None` where no forward gave one) and the
        number of forwards summed, on every rank.
    """
    if mesh.world_size == 1:
        ranks, count = [micro_batches], num_forwards
    else:
        ranks, count = _all_gather_micro_batches(micro_batches, num_forwards, params)
    p = mesh.pertp_size
    totals: Gradients = [None] * len(params)
    for i in range(max(len(rank) for rank in ranks)):
        for d in range(mesh.dp_size):
            shares = [rank[i] if i < len(rank) else [] for rank in ranks[d * p : (d + 1) * p]]
            entries = [shares[f % p][f // p] for f in range(sum(map(len, shares)))]
            totals = _add(totals, _fold(entries, len(params)))
    return totals, count


def _fold(entries: list[Gradients], num_params: int) -> Gradients:
    """Left-to-right sum of the entries, parameter by parameter."""
    total: Gradients = [None] * num_params
    for gradients in entries:
        total = _add(total, gradients)
    return total


def _add(a: Gradients, b: Gradients) -> Gradients:
    return [y if x is None else x if y is None else x + y for x, y in zip(a, b)]


def _all_gather_micro_batches(
    micro_batches: list[MicroBatch], num_forwards: int, params: Sequence[torch.Tensor]
) -> tuple[list[list[MicroBatch]], int]:
    """Every rank's `micro_batches`, in rank order, with the gradients' exact bits; and the forwards of all ranks.

    Three all-gathers on the default group: the sizes, the layout (entries per micro-batch and which parameters got
    a gradient), and the gradients flattened into one tensor of the parameters' promoted dtype (a lossless widening).
    """
    device = params[0].device
    dtype = params[0].dtype
    for p in params[1:]:
        dtype = torch.promote_types(dtype, p.dtype)
    numels = [p.numel() for p in params]
    entries = [gradients for micro_batch in micro_batches for gradients in micro_batch]
    local_sizes = [len(micro_batches), len(entries), num_forwards]
    sizes = _all_gather(torch.tensor(local_sizes, dtype=torch.int64, device=device))
    max_micro_batches, max_entries, _ = (int(size) for size in sizes.max(dim=0).values)

    layout = torch.zeros(max_micro_batches + max_entries * len(params), dtype=torch.int64, device=device)
    values = torch.zeros(max_entries, sum(numels), dtype=dtype, device=device)
    layout[: len(micro_batches)] = torch.tensor([len(mb) for mb in micro_batches], dtype=torch.int64)
    present = layout[max_micro_batches:].view(max_entries, len(params))
    for row, gradients in enumerate(entries):
        for index, gradient in enumerate(gradients):
            if gradient is not None:
                present[row, index] = 1
                start = sum(numels[:index])
                values[row, start : start + numels[index]] = gradient.reshape(-1)
    layouts, all_values = _all_gather(layout), _all_gather(values)

    ranks = []
    for (num_micro_batches, _, _), rank_layout, rank_values in zip(sizes.tolist(), layouts, all_values):
        rank_present = rank_layout[max_micro_batches:].view(max_entries, len(params)).tolist()
        row, rank = 0, []
        for length in rank_layout[:num_micro_batches].tolist():
            micro_batch = []
            for _ in range(length):
                pieces = rank_values[row].split(numels)
                micro_batch.append(
                    [
                        piece.view(p.shape).to(p.dtype) if rank_present[row][index] else None
                        for index, (piece, p) in enumerate(zip(pieces, params))
                    ]
                )
                row += 1
            rank.append(micro_batch)
        ranks.append(rank)
    return ranks, int(sizes[:, 2].sum())


def _all_gather(tensor: torch.Tensor) -> torch.Tensor:
    gathered = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, tensor.contiguous())
    return torch.stack(gathered)
