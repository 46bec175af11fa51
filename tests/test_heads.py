"""Head options: linear probing and the first-order head."""

from __future__ import annotations

import pytest
import torch
from transformers import TrainerCallback

from hf_zo import ZOConfig, ZOTrainer
from hf_zo.heads import (
    PROBE_L2_GRID,
    FirstOrderHead,
    ZOHeads,
    collect_head_inputs,
    cross_validated_l2,
    find_head_modules,
    fit_linear_probe,
    fit_logistic_regression,
    head_parameter_names,
    probe_examples,
    resolve_head_options,
    schedule_scale,
)

from tiny_models import classification_dataset, tiny_bert_classifier, tiny_causal_lm


def batches_of(dataset, size=8):
    for start in range(0, len(dataset), size):
        rows = dataset[start : start + size]
        yield {"labels" if k == "label" else k: torch.tensor(v) for k, v in rows.items()}


def lora(model):
    from peft import LoraConfig, TaskType, get_peft_model

    return get_peft_model(model, LoraConfig(task_type=TaskType.SEQ_CLS, r=2, target_modules=["query", "value"]))


def test_auto_options_apply_to_sequence_classifiers_only():
    assert resolve_head_options(tiny_bert_classifier(), "auto", "auto") == ("linear_probe", "first_order")
    assert resolve_head_options(lora(tiny_bert_classifier()), "auto", "auto") == ("linear_probe", "first_order")
    assert resolve_head_options(tiny_causal_lm("opt"), "auto", "auto") == ("none", "zeroth_order")
    assert resolve_head_options(tiny_bert_classifier(), "none", "zeroth_order") == ("none", "zeroth_order")


def test_find_head_modules_plain_peft_and_by_name():
    assert list(find_head_modules(tiny_bert_classifier())) == ["classifier"]
    # Several names come back in model order: the last one produces the logits (and gets the linear probe).
    assert list(find_head_modules(tiny_bert_classifier(), ["classifier", "pooler"])) == ["bert.pooler", "classifier"]
    peft_model = lora(tiny_bert_classifier())
    found = find_head_modules(peft_model)
    assert list(found) == ["base_model.model.classifier.modules_to_save.default"]
    by_name = find_head_modules(peft_model, ["classifier"])
    assert list(by_name) == ["base_model.model.classifier"]
    # Only the trainable copy of a modules_to_save head is trained.
    assert head_parameter_names(peft_model, by_name) == [
        "base_model.model.classifier.modules_to_save.default.weight",
        "base_model.model.classifier.modules_to_save.default.bias",
    ]
    with pytest.raises(ValueError, match="zo_head_modules names 'scorer'"):
        find_head_modules(peft_model, ["scorer"])


def test_logistic_regression_separates_separable_features():
    generator = torch.Generator().manual_seed(0)
    features = torch.randn(200, 5, generator=generator) * torch.tensor([1.0, 10.0, 0.1, 3.0, 1.0]) + 4.0
    labels = (features @ torch.tensor([1.0, -0.2, 5.0, 0.5, 0.0]) > 4.0 * 6.3).long()
    weight, bias = fit_logistic_regression(features, labels, num_classes=2)
    assert ((features @ weight.T + bias).argmax(-1) == labels).all()


def test_logistic_regression_gives_a_near_constant_feature_no_large_weight():
    """A feature switched off upstream (spread 1e-9, e.g. behind a LayerNorm scale of ~0) is not standardised up to
    the others' scale, even when its tiny variations follow the labels: its weight stays small, so the logits do not
    hinge on it."""
    generator = torch.Generator().manual_seed(0)
    informative = torch.randn(400, 3, generator=generator, dtype=torch.float64)
    noise = 2.0 * torch.randn(400, generator=generator, dtype=torch.float64)
    labels = (informative @ torch.tensor([1.0, -1.0, 0.5], dtype=torch.float64) + noise > 0).long()
    switched_off = 0.3 + 1e-9 * (2.0 * labels.double() - 1.0)
    weight, bias = fit_logistic_regression(torch.cat([informative, switched_off[:, None]], 1), labels, num_classes=2)
    assert weight[:, 3].abs().max() < 1.0, weight
    assert weight[:, :3].abs().max() > 0.1, weight  # the informative features are still used


def test_cross_validated_l2_penalises_few_examples_more_and_draws_nothing():
    """Many noisy features and few examples: a small penalty over-fits, so cross-validation picks a larger one than
    for many examples, deterministically and without touching the global random stream."""
    generator = torch.Generator().manual_seed(0)
    features = torch.randn(4000, 60, generator=generator)
    labels = (features[:, :3].sum(1) + 2.0 * torch.randn(4000, generator=generator) > 0).long()
    state = torch.random.get_rng_state()
    few = cross_validated_l2(features[:60], labels[:60], num_classes=2)
    many = cross_validated_l2(features, labels, num_classes=2)
    assert torch.equal(torch.random.get_rng_state(), state)
    assert few in PROBE_L2_GRID and many in PROBE_L2_GRID and few > many, (few, many)
    assert cross_validated_l2(features[:60], labels[:60], num_classes=2) == few
    assert cross_validated_l2(features[:5], labels[:5], num_classes=2) == 1e-2  # too few to hold any out

    # The chosen penalty generalises better than the fixed default on held-out examples.
    def held_out_loss(l2):
        weight, bias = fit_logistic_regression(features[:60], labels[:60], num_classes=2, l2=l2)
        return torch.nn.functional.cross_entropy(features[60:] @ weight.T + bias, labels[60:])

    assert held_out_loss(few) < held_out_loss(1e-2)


@pytest.mark.parametrize("use_peft", [False, True])
def test_linear_probe_fits_the_head_on_frozen_features(use_peft):
    """Labels that are a linear function of the head's input are fitted exactly, and only the head changes."""
    model = tiny_bert_classifier()
    model = lora(model) if use_peft else model
    model.eval()
    head = next(iter(find_head_modules(model).values()))
    dataset = classification_dataset(24, seed=3)
    features, _ = collect_head_inputs(model, head, batches_of(dataset))
    direction = torch.randn(features.shape[1], generator=torch.Generator().manual_seed(1))
    scores = features @ direction
    separable = dataset.remove_columns("label").add_column("label", (scores > scores.median()).long().tolist())
    body = {n: p.clone() for n, p in model.named_parameters() if "classifier" not in n}

    accuracy = fit_linear_probe(model, head, batches_of(separable), l2=1e-5)

    assert accuracy == 1.0
    with torch.no_grad():
        predictions = torch.cat([model(input_ids=b["input_ids"]).logits.argmax(-1) for b in batches_of(separable)])
    assert predictions.tolist() == separable["label"]
    assert all(torch.equal(p, body[n]) for n, p in model.named_parameters() if n in body)


def test_token_level_head_fails_naming_the_fix_whatever_the_padding():
    from transformers import BertForTokenClassification

    from tiny_models import tiny_bert_config

    model = BertForTokenClassification(tiny_bert_config(num_labels=2)).eval()
    # Padded per batch, the batches differ in length: the check must come before the batches are concatenated.
    batches = [
        {"input_ids": torch.randint(5, 50, (2, length)), "labels": torch.zeros(2, length, dtype=torch.long)}
        for length in (4, 6)
    ]
    with pytest.raises(ValueError, match=r"one feature vector per label.*zo_head_init='none'"):
        collect_head_inputs(model, model.classifier, batches)


def test_probe_examples_are_a_seeded_sample_in_the_data_sets_order():
    """The probe draws from the whole set, not its first rows: a set grouped by label gives both labels."""
    from datasets import Dataset
    from torch.utils.data import IterableDataset, Subset, TensorDataset

    grouped = Dataset.from_dict({"index": list(range(40)), "label": [0] * 20 + [1] * 20})

    drawn = probe_examples(grouped, 10, seed=0)

    assert len(drawn) == 10 and set(drawn["label"]) == {0, 1}
    assert drawn["index"] == sorted(drawn["index"])  # the set's order is kept (a length-sorted set stays cheap)
    assert probe_examples(grouped, 10, seed=0)["index"] == drawn["index"]
    assert probe_examples(grouped, 10, seed=1)["index"] != drawn["index"]
    assert probe_examples(grouped, None, seed=0) is grouped and probe_examples(grouped, 40, seed=0) is grouped
    tensors = TensorDataset(torch.arange(40))
    subset = probe_examples(tensors, 10, seed=0)
    assert isinstance(subset, Subset) and subset.indices == drawn["index"]

    class Stream(IterableDataset):
        def __iter__(self):
            return iter(range(40))

    stream = Stream()
    assert probe_examples(stream, 10, seed=0) is stream


def test_probe_examples_are_ordered_by_length_when_tokenized():
    """A tokenized set's probe examples come shortest first (little padding per batch), and they are the same
    examples, in a deterministic order, as the seeded draw of an untokenized set."""
    from datasets import Dataset

    lengths = [(7 * i) % 13 + 1 for i in range(40)]
    tokenized = Dataset.from_dict({"index": list(range(40)), "input_ids": [[5] * n for n in lengths]})

    drawn = probe_examples(tokenized, 10, seed=0)

    untokenized = probe_examples(tokenized.remove_columns("input_ids"), 10, seed=0)
    assert sorted(drawn["index"]) == untokenized["index"]
    assert [len(ids) for ids in drawn["input_ids"]] == sorted(lengths[i] for i in untokenized["index"])
    assert drawn["index"] == probe_examples(tokenized, 10, seed=0)["index"]
    whole = probe_examples(tokenized, None, seed=0)
    assert [len(ids) for ids in whole["input_ids"]] == sorted(lengths)
    ties = [i for i in whole["index"] if lengths[i] == 1]
    assert ties == sorted(ties)  # equal lengths keep the set's order


def test_linear_probe_of_a_trainer_samples_a_set_grouped_by_label():
    """`ZOTrainer`'s probe on a training set sorted by label, fitted on fewer examples than the first label has,
    still learns both labels (the first rows alone would give a head that predicts one label)."""
    model = tiny_bert_classifier().eval()
    dataset = classification_dataset(64, seed=3)
    head = next(iter(find_head_modules(model).values()))
    features, _ = collect_head_inputs(model, head, batches_of(dataset))
    direction = torch.randn(features.shape[1], generator=torch.Generator().manual_seed(1))
    scores = features @ direction
    labels = (scores > scores.median()).long().tolist()
    grouped = dataset.remove_columns("label").add_column("label", labels).sort("label")
    trainer = ZOTrainer(
        model=model,
        args=ZOConfig(
            output_dir="unused",
            max_steps=1,
            learning_rate=0.0,
            zo_head_learning_rate=1e-12,
            zo_head_init_max_samples=24,
            report_to=[],
            save_strategy="no",
            use_cpu=True,
            disable_tqdm=True,
        ),
        train_dataset=grouped,
    )
    trainer.train()

    with torch.no_grad():
        predictions = torch.cat([model(input_ids=b["input_ids"]).logits.argmax(-1) for b in batches_of(grouped)])
    assert (predictions == torch.tensor(grouped["label"])).float().mean() > 0.8


def test_linear_probe_and_evaluation_keep_their_own_data_with_persistent_workers(monkeypatch):
    """With `dataloader_persistent_workers`, Trainer caches the evaluation loader: the probe must neither be fitted on
    that cached loader (evaluation data) nor leave its own loader there for `evaluate()` to reuse."""
    import hf_zo.heads.callback

    probed = []

    def recording_probe(model, head, batches, **kwargs):
        rows = list(batches)
        probed.append(sum(len(batch["labels"]) for batch in rows))
        return fit_linear_probe(model, head, rows, **kwargs)

    monkeypatch.setattr(hf_zo.heads.callback, "fit_linear_probe", recording_probe)
    train, evaluation = classification_dataset(40, seed=1), classification_dataset(7, seed=2)
    trainer = ZOTrainer(
        model=tiny_bert_classifier(),
        args=ZOConfig(
            output_dir="unused",
            max_steps=1,
            per_device_eval_batch_size=4,
            dataloader_num_workers=1,
            dataloader_persistent_workers=True,
            report_to=[],
            save_strategy="no",
            use_cpu=True,
            disable_tqdm=True,
        ),
        train_dataset=train,
        eval_dataset=evaluation,
    )
    trainer.evaluate()  # caches the evaluation loader before the probe runs
    trainer.train()

    assert probed == [40]
    assert len(trainer.get_eval_dataloader().dataset) == 7


def test_the_head_is_probed_once_per_model_across_train_calls(monkeypatch):
    """A second `train()` goes on from the head trained so far; a model rebuilt by `model_init` is probed anew."""
    import hf_zo.heads.callback

    probes = []
    monkeypatch.setattr(hf_zo.heads.callback, "fit_linear_probe", lambda *args, **kwargs: probes.append(1) or 1.0)
    args = ZOConfig(
        output_dir="unused", max_steps=1, report_to=[], save_strategy="no", use_cpu=True, disable_tqdm=True
    )
    trainer = ZOTrainer(model=tiny_bert_classifier(), args=args, train_dataset=classification_dataset(8))
    trainer.train()
    trainer.train()
    assert len(probes) == 1
    rebuilt = ZOTrainer(model_init=lambda: tiny_bert_classifier(), args=args, train_dataset=classification_dataset(8))
    rebuilt.train()
    rebuilt.train()
    assert len(probes) == 3


def test_first_order_head_gets_exact_gradients_and_body_none():
    model = tiny_bert_classifier().eval()
    batch = next(batches_of(classification_dataset(8)))
    heads = find_head_modules(model)
    params = [p for n, p in model.named_parameters() if n.startswith("classifier.")]
    expected = torch.autograd.grad(model(**batch).loss, params)

    trainer = FirstOrderHead(heads, params, lr=1e-2)
    with torch.no_grad(), trainer.capture():
        loss = trainer.backward(model(**batch).loss)
    assert not loss.requires_grad
    for p, g in zip(params, expected):
        torch.testing.assert_close(p.grad, g)
    assert all(p.grad is None for n, p in model.named_parameters() if not n.startswith("classifier."))
    # Outside capture() the hooks are inert: a no-grad forward builds no graph.
    with torch.no_grad():
        assert not model(**batch).loss.requires_grad
    trainer.close()


def test_a_discarded_step_leaves_the_first_order_head_as_it_was():
    """A stop between two optimizer steps drops the head's gradients of that partial step, as the ZO records."""
    model = tiny_bert_classifier().eval()
    batch = next(batches_of(classification_dataset(8)))
    params = [p for n, p in model.named_parameters() if n.startswith("classifier.")]
    before = [p.detach().clone() for p in params]
    trainer = FirstOrderHead(find_head_modules(model), params, lr=1e-2)
    with torch.no_grad(), trainer.capture():
        trainer.backward(model(**batch).loss)
    trainer.end_micro_batch()
    ZOHeads(["classifier"], first_order=trainer).on_epoch_end(None, None, None)
    trainer.step()
    assert all(torch.equal(p, b) for p, b in zip(params, before))
    trainer.close()


def build_trainer(model, steps, **options):
    """A `ZOTrainer` on 16 labelled examples, batch 4; `options` override the `ZOConfig` fields."""
    fields = dict(
        output_dir="unused",
        max_steps=steps,
        per_device_train_batch_size=4,
        learning_rate=1e-2,
        zo_eps=1e-2,
        report_to=[],
        save_strategy="no",
        use_cpu=True,
        disable_tqdm=True,
    )
    return ZOTrainer(model=model, args=ZOConfig(**{**fields, **options}), train_dataset=classification_dataset(16))


def run_trainer(model, steps, **options):
    trainer = build_trainer(model, steps, **options)
    trainer.train()
    return trainer


def test_first_order_head_trains_head_while_body_follows_the_zo_update():
    """The head leaves the ZO set; the body's ZO update is unchanged (same noise indices and seeds)."""
    model = tiny_bert_classifier()
    head_before = model.classifier.weight.clone()
    trainer = run_trainer(model, 1, zo_head_init="none", zo_head_training="first_order", zo_head_learning_rate=0.1)

    reference = tiny_bert_classifier()
    reference.classifier.requires_grad_(False)  # last in named_parameters: body indices stay the same
    run_trainer(reference, 1, zo_head_init="none", zo_head_training="zeroth_order")

    zo_params = {id(p) for _, p in trainer.zo_optimizer.params.tensors}
    assert id(model.classifier.weight) not in zo_params and id(model.classifier.bias) not in zo_params
    assert not torch.equal(model.classifier.weight, head_before)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        if not name.startswith("classifier."):
            assert torch.equal(p, q), name
            assert p.grad is None, name


@pytest.mark.parametrize("disable_tqdm", [False, True])
def test_linear_probe_shows_progress_unless_tqdm_is_disabled(capsys, disable_tqdm):
    """The probe runs one forward per example before the first step: it shows a bar like evaluation does."""
    model = tiny_bert_classifier()
    args = ZOConfig(
        output_dir="unused",
        max_steps=1,
        per_device_train_batch_size=4,
        per_device_eval_batch_size=4,
        report_to=[],
        save_strategy="no",
        use_cpu=True,
        disable_tqdm=disable_tqdm,
        zo_head_init="linear_probe",
        zo_head_init_max_samples=8,
    )
    ZOTrainer(model=model, args=args, train_dataset=classification_dataset(16)).train()
    err = capsys.readouterr().err
    # 8 examples in eval batches of 4: the bar counts 2 batches
    assert ("Linear probe" in err and "/2 " in err) != disable_tqdm


def test_config_rejects_unknown_head_options():
    with pytest.raises(ValueError, match="Unknown zo_head_init 'probe'"):
        ZOConfig(output_dir="unused", zo_head_init="probe")
    with pytest.raises(ValueError, match="zo_head_learning_rate must be > 0, got 0"):
        ZOConfig(output_dir="unused", zo_head_learning_rate=0)


@pytest.mark.parametrize("learning_rate", [1e-2, 0.0])
def test_first_order_head_follows_the_learning_rate_schedule(learning_rate):
    """The head warms up and decays with the ZO weights, even when the ZO learning rate is 0 (a head-only run)."""
    head_lrs = []

    class RecordHeadLr(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            head_lrs.append(trainer.zo_heads.first_order.optimizer.param_groups[0]["lr"])

    trainer = build_trainer(
        tiny_bert_classifier(),
        4,
        learning_rate=learning_rate,
        lr_scheduler_type="linear",
        warmup_steps=1,
        zo_head_init="none",
        zo_head_training="first_order",
        zo_head_learning_rate=0.08,
    )
    trainer.add_callback(RecordHeadLr())
    trainer.train()
    # linear warm-up over 1 step, then linear decay to 0 at step 4: factors 0, 1, 2/3, 1/3
    torch.testing.assert_close(head_lrs, [0.0, 0.08, 0.08 * 2 / 3, 0.08 / 3])


def test_schedule_scale_of_other_schedulers():
    """A scheduler that is not a `LambdaLR` gives the optimizer's learning rate over the base one."""
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.4)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    assert schedule_scale(scheduler, optimizer, 0.4) == 1.0
    optimizer.step()
    scheduler.step()
    assert schedule_scale(scheduler, optimizer, 0.4) == 0.5
    assert schedule_scale(scheduler, optimizer, 0.0) == 1.0
    assert schedule_scale(None, optimizer, 0.4) == 1.0


@pytest.mark.parametrize("lr_scheduler_type", ["constant", "linear"])
def test_first_order_head_resume_is_exact(tmp_path, lr_scheduler_type):
    """The head's AdamW state travels in the checkpoint and its schedule is the trainer's: resuming reproduces the
    uninterrupted run bitwise."""

    def trainer_for(model, output_dir):
        return build_trainer(
            model,
            4,
            output_dir=str(output_dir),
            save_strategy="steps",
            save_steps=2,
            lr_scheduler_type=lr_scheduler_type,
            zo_head_init="none",
            zo_head_training="first_order",
            zo_head_learning_rate=0.05,
        )

    straight = tiny_bert_classifier()
    trainer_for(straight, tmp_path / "straight").train()
    resumed = tiny_bert_classifier()
    trainer = trainer_for(resumed, tmp_path / "straight")
    trainer.train(resume_from_checkpoint=str(tmp_path / "straight" / "checkpoint-2"))
    for (name, p), q in zip(straight.named_parameters(), resumed.parameters()):
        assert torch.equal(p, q), name
