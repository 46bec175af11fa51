"""Batches of similar length: training batches from a `LengthGroupedSampler` whose order is the same in every
layout and resume, evaluation batches longest first with the results put back in the data set's order.

A ZO step is two forward passes over a padded batch, and ZO takes many steps: with batches drawn at random, most of
a short-text batch is padding (SST-2 phrases of 2 to 60 tokens). `ZOConfig` therefore defaults to
`train_sampling_strategy="group_by_length"`, served by :class:`ZOLengthGroupedSampler`. The lengths come from
`hf_zo.heads.example_lengths`, which lives below the trainer because the linear probe orders its examples by them too.
Evaluation pads the same way: SST-2's 872 validation prompts are 26,303 tokens, 43,832 once padded in batches of 16
in the data set's order, and 26,720 sorted by length (:class:`LengthSortedSampler`).
"""

from __future__ import annotations

import contextlib
import math

import numpy as np
import torch
from torch.utils.data import RandomSampler, Sampler, SequentialSampler
from transformers import TrainerCallback, TrainingArguments
from transformers.trainer_pt_utils import LengthGroupedSampler, get_length_grouped_indices
from transformers.trainer_utils import has_length
from transformers.utils import logging

from ..heads import example_lengths
from .checks import check_sampling_fits_layout

logger = logging.get_logger(__name__)

__all__ = ["LengthSortedSampler", "SamplerEpochCallback", "ZOLengthGroupedSampler", "ZOSamplingMixin"]


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


class LengthSortedSampler(Sampler[int]):
    """The examples longest first (ties in the data set's order), and the way back to the data set's order.

    Evaluation batches of similar length carry little padding; the first batch is the longest, so that an
    out-of-memory error shows at once. :meth:`restore` puts rows computed in this order back in the data set's order.

    Args:
        lengths (`list[int]`): the length of every example.
    """

    def __init__(self, lengths: list[int]):
        self.order = sorted(range(len(lengths)), key=lengths.__getitem__, reverse=True)

    def __iter__(self):
        return iter(self.order)

    def __len__(self) -> int:
        return len(self.order)

    def restore(self, rows):
        """`rows` (an array, tensor, or a tuple, list or dict of them; `None` passes) whose first dimension
        follows this sampler's order, in the data set's order instead."""
        if rows is None:
            return None
        if isinstance(rows, (tuple, list)):
            return type(rows)(self.restore(r) for r in rows)
        if isinstance(rows, dict):
            return {key: self.restore(r) for key, r in rows.items()}
        if len(rows) != len(self.order):
            raise ValueError(f"Expected {len(self.order)} rows in the sampler's order, got {len(rows)}.")
        inverse = np.argsort(self.order)
        return rows[torch.as_tensor(inverse)] if isinstance(rows, torch.Tensor) else rows[inverse]


class SamplerEpochCallback(TrainerCallback):
    """Tells the training sampler which epoch `Trainer` starts.

    `Trainer` and Accelerate pass the epoch on through the dataloader, but a resumed multi-process run skips its done
    batches through a `SkipBatchSampler` wrapped around Accelerate's `BatchSamplerShard`, and neither reaches the
    sampler below them: the resumed epoch would draw epoch 0's order. The trainer builds its sampler through
    :meth:`build_sampler`, so that this callback knows it; the epoch is the whole part of `state.epoch`, which a
    checkpoint stores.

    Attributes:
        sampler (`ZOLengthGroupedSampler` or `None`): the sampler last built, whose epoch this callback sets.
    """

    def __init__(self):
        self.sampler: ZOLengthGroupedSampler | None = None

    def build_sampler(self, lengths: list[int], global_batch_size: int, seed: int) -> ZOLengthGroupedSampler:
        """A :class:`ZOLengthGroupedSampler` (same arguments), whose epoch this callback then sets."""
        self.sampler = ZOLengthGroupedSampler(lengths, global_batch_size, seed)
        return self.sampler

    def on_epoch_begin(self, args, state, control, **kwargs):
        if self.sampler is not None:
            self.sampler.set_epoch(math.floor(state.epoch or 0))


class ZOSamplingMixin:
    """The `Trainer` hooks that choose the order of the examples under ZO: length-grouped training batches over the
    global batch (`ZOConfig`'s default `train_sampling_strategy="group_by_length"`), evaluation batches longest
    first under the same strategy with `predict`'s rows in the data set's order, and the global batch counted over
    data-parallel groups only.

    Mixed into `ZOTrainerMixin`, ahead of a `transformers.Trainer`; reads the trainer's `zo_plugin` (the layout) and
    `zo_sampler_epoch` (a :class:`SamplerEpochCallback` added as a callback).
    """

    def _get_train_sampler(self, train_dataset=None):
        """`Trainer`'s sampler, except with `train_sampling_strategy="group_by_length"` (`ZOConfig`'s default): a
        :class:`ZOLengthGroupedSampler` over the global batch, or random sampling with a warning when the examples'
        lengths cannot be read."""
        check_sampling_fits_layout(self.args, self.zo_plugin.setup())
        dataset = self.train_dataset if train_dataset is None else train_dataset
        if self.args.train_sampling_strategy != "group_by_length" or dataset is None or not has_length(dataset):
            return super()._get_train_sampler(train_dataset)
        lengths = self._zo_example_lengths(dataset)
        if lengths is None:
            logger.warning(
                "train_sampling_strategy='group_by_length' (ZOConfig's default) needs each training example's "
                f"length: a '{self.args.length_column_name}' column or '{self._zo_input_name()}' in every example, "
                f"which this {type(dataset).__name__} lacks. Batches are drawn at random instead; set "
                "train_sampling_strategy='random' to silence this, or add the column."
            )
            return RandomSampler(dataset)
        seed = self.args.data_seed if self.args.data_seed is not None else self.args.seed
        return self.zo_sampler_epoch.build_sampler(lengths, self.get_total_train_batch_size(self.args), seed)

    def _zo_input_name(self) -> str:
        """The model input whose length counts: the tokenizer's first input, else ``input_ids``."""
        return (getattr(self.processing_class, "model_input_names", None) or ["input_ids"])[0]

    def _zo_example_lengths(self, dataset) -> list[int] | None:
        """Each example's length (:func:`~hf_zo.heads.example_lengths`), or `None` when it cannot be read."""
        return example_lengths(dataset, self.args.length_column_name, self._zo_input_name())

    def _get_eval_sampler(self, eval_dataset):
        """With `train_sampling_strategy="group_by_length"` on one process, a :class:`LengthSortedSampler` (as
        `Trainer` groups evaluation batches under that strategy, but in a fixed order that
        :meth:`evaluation_loop` undoes); otherwise, or with `eval_do_concat_batches=False` (predictions kept as
        one array per batch) or within :meth:`zo_in_dataset_order`, the data set's order (several processes:
        Accelerate shards it)."""
        if eval_dataset is None or not has_length(eval_dataset) or self.args.world_size > 1:
            return None
        in_order = getattr(self, "_zo_in_dataset_order", False) or not self.args.eval_do_concat_batches
        if self.args.train_sampling_strategy == "group_by_length" and not in_order:
            lengths = self._zo_example_lengths(eval_dataset)
            if lengths is not None:
                return LengthSortedSampler(lengths)
        return SequentialSampler(eval_dataset)

    @contextlib.contextmanager
    def zo_in_dataset_order(self):
        """Within it, the evaluation and test dataloaders built keep the data set's order on one process, as they do
        on several: the linear probe orders its examples itself and must collect them in the same order in every
        layout, so that one process and a distributed run fit the same head bit for bit."""
        self._zo_in_dataset_order = True
        try:
            yield
        finally:
            self._zo_in_dataset_order = False

    def evaluation_loop(self, dataloader, *args, **kwargs):
        """`Trainer.evaluation_loop`, whose predictions and labels come back in the data set's order when the
        batches ran longest first (`compute_metrics` sees them in the batches' order, each prediction beside its
        label), so that `predict` returns one row per example in order whatever the strategy is."""
        output = super().evaluation_loop(dataloader, *args, **kwargs)
        sampler = getattr(getattr(dataloader, "batch_sampler", None), "sampler", None)
        if not isinstance(sampler, LengthSortedSampler):
            return output
        return output._replace(
            predictions=sampler.restore(output.predictions), label_ids=sampler.restore(output.label_ids)
        )

    def get_total_train_batch_size(self, args: TrainingArguments) -> int:
        """Examples per optimizer step: the ranks of a perturbation-parallel group share theirs, so only the
        data-parallel groups multiply the batch."""
        return self._train_batch_size * args.gradient_accumulation_steps * self.zo_plugin.setup().dp_size
