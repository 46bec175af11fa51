"""Data-parallel sharding of a prepared dataloader by DP rank: the ranks of one PertP group see the same batches."""

from __future__ import annotations

from accelerate.data_loader import BatchSamplerShard, DataLoaderDispatcher, IterableDatasetShard
from torch.utils.data import DataLoader

from .mesh import ZOMesh


def shard_by_dp_rank(dataloader: DataLoader, mesh: ZOMesh) -> DataLoader:
    """Re-shard a dataloader that `Accelerator.prepare` sharded by global rank so that it is sharded by DP rank.

    DP rank ``r`` gets the batches ``r, r + dp, r + 2 dp, ...`` of the underlying sampler, the same on every rank
    of its PertP group. Nothing changes without perturbation parallelism (the DP rank is then the global rank).

    Args:
        dataloader (`DataLoader`): a dataloader returned by `Accelerator.prepare` (a map-style or iterable dataset).
        mesh (`ZOMesh`): this rank's place in the layout.

    Returns:
        `DataLoader`: the same dataloader, re-sharded in place.
    """
    if mesh.pertp_size == 1:
        return dataloader
    if isinstance(dataloader, DataLoaderDispatcher):
        raise ValueError(
            "Perturbation parallelism needs every rank to load its own batches, but this dataloader dispatches "
            "batches from rank 0 (Accelerate does this for iterable datasets by default). Pass "
            "accelerator_config={'dispatch_batches': False} in ZOConfig, or use a map-style dataset."
        )
    shard = getattr(dataloader, "batch_sampler", None)
    if not isinstance(shard, BatchSamplerShard):
        shard = getattr(dataloader, "dataset", None)
    if not isinstance(shard, (BatchSamplerShard, IterableDatasetShard)):
        raise ValueError(
            f"Cannot shard {type(dataloader).__name__} by DP rank: expected a dataloader prepared by Accelerate "
            "with a BatchSamplerShard or an IterableDatasetShard (a streaming `datasets` dataset with at least as "
            "many shards as processes is split by file instead). Use a map-style dataset, or "
            "zo_perturbation_parallel_size=1."
        )
    shard.num_processes = mesh.dp_size
    shard.process_index = mesh.dp_rank
    return dataloader
