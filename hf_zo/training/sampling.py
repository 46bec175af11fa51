"""Training batches of similar length: a `LengthGroupedSampler` whose order is the same in every layout and resume.

A ZO step is two forward passes over a padded batch, and ZO takes many steps: with batches drawn at random, most of
a short-text batch is padding (SST-2 phrases of 2 to 60 tokens). `ZOConfig` therefore defaults to
`train_sampling_strategy="group_by_length"`, served by :class:`ZOLengthGroupedSampler`. The lengths come from
`hf_zo.heads.example_lengths`, which lives below the trainer because the linear probe orders its examples by them too.
"""

from __future__ import annotations

import math

import torch
from transformers import TrainerCallback
from transformers.trainer_pt_utils import LengthGroupedSampler, get_length_grouped_indices

__all__ = ["SamplerEpochCallback", "ZOLengthGroupedSampler"]


class ZOLengthGroupedSampler(LengthGroupedSampler):
    """`transformers.LengthGroupedSampler` whose order depends only on `seed`, the epoch and the global batch.

    Each epoch draws a permutation from a generator seeded with `seed + epoch` (as Accelerate's
    `SeedableRandomSampler` does), cuts it into mega-batches of 50 global batches (fewer on a small set) and sorts
    each by length, longest first, so consecutive batches have similar lengths (the batch holding the longest
    example comes first, so that an out-of-memory error shows at once).

    Grouping by the global batch (per-device batch x gradient accumulation x data-parallel groups) gives every
    layout of the same global batch the same sequence of examples: two data-parallel processes see what one process
    accumulating two micro-batches sees. Seeding by epoch makes a resumed run draw what the uninterrupted run drew,
    and every process draw the same order without communication.

    Args:
        lengths (`list[int]`): the length of every example.
        global_batch_size (`int`): examples per optimizer step over all data-parallel groups.
        seed (`int`): seed of the draw (`data_seed`, else `seed`).
    """

    def __init__(self, lengths: list[int], global_batch_size: int, seed: int):
        super().__init__(global_batch_size, lengths=lengths)
        self.seed = seed
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        """Draw the order of epoch `epoch` next (called by `Trainer` and Accelerate at the start of each epoch)."""
        self.epoch = epoch

    def __iter__(self):
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        return iter(get_length_grouped_indices(self.lengths, self.batch_size, generator=generator))


class SamplerEpochCallback(TrainerCallback):
    """Tells the training sampler which epoch `Trainer` starts.

    `Trainer` and Accelerate pass the epoch on through the dataloader, but a resumed multi-process run skips its done
    batches through a `SkipBatchSampler` wrapped around Accelerate's `BatchSamplerShard`, and neither reaches the
    sampler below them: the resumed epoch would draw epoch 0's order. `ZOTrainer` sets :attr:`sampler` when it builds
    one; the epoch is the whole part of `state.epoch`, which a checkpoint stores.
    """

    def __init__(self):
        self.sampler: ZOLengthGroupedSampler | None = None

    def on_epoch_begin(self, args, state, control, **kwargs):
        if self.sampler is not None:
            self.sampler.set_epoch(math.floor(state.epoch or 0))
