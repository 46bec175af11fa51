"""Training batches grouped by length (`ZOConfig`'s default): what each step sees (resume: tests/test_trainer.py;
layouts: tests/test_distributed.py)."""

import logging

import torch
from torch.utils.data import RandomSampler, SequentialSampler, TensorDataset

from hf_zo import ZOTrainer
from hf_zo.heads import example_lengths
from hf_zo.training import ZOLengthGroupedSampler

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
    assert isinstance(trainer._get_eval_sampler(data), SequentialSampler)
    predictions = trainer.predict(data).predictions
    first = trainer.model(**pad([data[5]])).logits[0]
    assert torch.allclose(torch.as_tensor(predictions[5, : len(data[5]["input_ids"])]), first, atol=1e-5)

    trainer.args.train_sampling_strategy = "random"
    assert isinstance(trainer._get_train_sampler(), RandomSampler)


def test_without_lengths_training_batches_are_drawn_at_random_with_a_warning(tmp_path, caplog):
    data = ragged_lm_dataset(8)
    trainer = ZOTrainer(model=tiny_causal_lm("opt"), args=zo_args(tmp_path), train_dataset=data, data_collator=pad)

    with caplog.at_level(logging.WARNING, logger="hf_zo"):
        sampler = trainer._get_train_sampler(data.remove_columns("input_ids"))

    assert isinstance(sampler, RandomSampler)
    assert "group_by_length" in caplog.text and "train_sampling_strategy='random'" in caplog.text
