"""Batches grouped by length (`ZOConfig`'s default): what each training step sees (resume: tests/test_trainer.py;
layouts: tests/test_distributed.py), and evaluation batches longest first with results in the data set's order."""

import logging

import numpy as np
import pytest
import torch
from torch.utils.data import RandomSampler, SequentialSampler, TensorDataset

from hf_zo import ZOTrainer
from hf_zo.heads import example_lengths
from hf_zo.training import LengthSortedSampler, ZOLengthGroupedSampler

from tiny_models import pad_lm_batch as pad
from tiny_models import ragged_lm_dataset, tiny_causal_lm, zo_args


def test_example_lengths_read_a_column_or_the_examples():
    data = ragged_lm_dataset(12)
    expected = [len(ids) for ids in data["input_ids"]]

    assert example_lengths(data) == expected
    assert example_lengths(data.add_column("length", [7] * 12)) == [7] * 12
    assert example_lengths(data.to_list()) == expected
    assert example_lengths(data.remove_columns("input_ids")) is None
    assert example_lengths(TensorDataset(torch.zeros(4, 3))) is None


def test_the_sampler_draws_a_seeded_permutation_per_epoch_in_batches_of_similar_length():
    lengths = [len(ids) for ids in ragged_lm_dataset(400)["input_ids"]]
    sampler = ZOLengthGroupedSampler(lengths, global_batch_size=8, seed=3)

    first = list(sampler)
    assert sorted(first) == list(range(400)) and list(sampler) == first
    sampler.set_epoch(1)
    second = list(sampler)
    assert sorted(second) == list(range(400)) and second != first
    assert list(ZOLengthGroupedSampler(lengths, 8, seed=3)) == first  # no hidden state: a resumed run draws the same

    def padding(order):
        batches = [order[i : i + 8] for i in range(0, len(order), 8)]
        return sum(max(lengths[i] for i in b) * len(b) - sum(lengths[i] for i in b) for b in batches)

    shuffled = torch.randperm(400, generator=torch.Generator().manual_seed(0)).tolist()
    assert padding(first) < padding(shuffled) / 4


def test_zo_trainer_groups_training_batches_by_the_global_batch_and_keeps_evaluation_order(tmp_path):
    data = ragged_lm_dataset(40)
    trainer = ZOTrainer(
        model=tiny_causal_lm("opt"),
        args=zo_args(tmp_path, per_device_train_batch_size=2, gradient_accumulation_steps=3, data_seed=11),
        train_dataset=data,
        data_collator=pad,
    )

    sampler = trainer._get_train_sampler()
    assert isinstance(sampler, ZOLengthGroupedSampler)
    assert (sampler.batch_size, sampler.seed) == (6, 11)  # 2 per device x 3 accumulated x 1 data-parallel group
    evaluation = trainer._get_eval_sampler(data)
    assert isinstance(evaluation, LengthSortedSampler)  # evaluation batches longest first, restored in order
    assert [len(data[i]["input_ids"]) for i in evaluation] == sorted((len(r) for r in data["input_ids"]), reverse=True)
    predictions = trainer.predict(data).predictions
    for index in (0, 5, 39):
        alone = trainer.model(**pad([data[index]])).logits[0]
        assert torch.allclose(torch.as_tensor(predictions[index, : len(data[index]["input_ids"])]), alone, atol=1e-5)

    probe_batches = trainer._zo_probe_dataloader(data)  # the linear probe's loader keeps the order it is given
    assert isinstance(probe_batches.batch_sampler.sampler, SequentialSampler)
    assert isinstance(trainer._get_eval_sampler(data), LengthSortedSampler)  # and evaluation sorts again after it
    trainer.args.eval_do_concat_batches = False  # predictions kept per batch: nothing to put back in order
    assert isinstance(trainer._get_eval_sampler(data), SequentialSampler)
    trainer.args.eval_do_concat_batches = True
    trainer.args.train_sampling_strategy = "random"
    assert isinstance(trainer._get_train_sampler(), RandomSampler)
    assert isinstance(trainer._get_eval_sampler(data), SequentialSampler)


def test_length_sorted_sampler_restores_nested_rows_and_refuses_a_wrong_count():
    sampler = LengthSortedSampler([2, 5, 3, 5])
    assert list(sampler) == [1, 3, 2, 0]  # longest first, ties in the data set's order
    rows = np.array([10, 30, 20, 0])  # row k belongs to example sampler.order[k]
    restored = sampler.restore({"scores": (rows, torch.as_tensor(rows)), "none": None})
    assert restored["scores"][0].tolist() == [0, 10, 20, 30] and restored["scores"][1].tolist() == [0, 10, 20, 30]
    assert restored["none"] is None
    with pytest.raises(ValueError, match="Expected 4 rows"):
        sampler.restore(rows[:3])


def test_without_lengths_training_batches_are_drawn_at_random_with_a_warning(tmp_path, caplog):
    data = ragged_lm_dataset(8)
    trainer = ZOTrainer(model=tiny_causal_lm("opt"), args=zo_args(tmp_path), train_dataset=data, data_collator=pad)

    with caplog.at_level(logging.WARNING, logger="hf_zo"):
        sampler = trainer._get_train_sampler(data.remove_columns("input_ids"))

    assert isinstance(sampler, RandomSampler)
    assert "group_by_length" in caplog.text and "train_sampling_strategy='random'" in caplog.text
