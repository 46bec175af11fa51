"""ZOTrainer end to end: training, logging, exact resume, model cards."""

import math
import shutil

import pytest
import torch
from peft import LoraConfig, get_peft_model

from hf_zo import ZOConfig, ZOTrainer

from tiny_models import lm_dataset, pad_lm_batch, ragged_lm_dataset, tiny_causal_lm
from tiny_models import zo_args as _args


def _lora(model):
    return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "fc1", "fc2"]))


@pytest.mark.parametrize(
    "use_lora, noise", [(False, "gaussian"), (False, "table"), (True, "gaussian")], ids=["full", "full-table", "lora"]
)
def test_training_loss_decreases(tmp_path, use_lora, noise):
    model = tiny_causal_lm("opt")
    if use_lora:
        model = _lora(model)
    data = lm_dataset(16)
    hyper = dict(learning_rate=0.1, zo_eps=1e-2) if use_lora else dict(learning_rate=3e-3)
    args = _args(tmp_path, max_steps=300, logging_steps=50, zo_noise=noise, **hyper)
    trainer = ZOTrainer(model=model, args=args, train_dataset=data)
    before = trainer.evaluate(data)["eval_loss"]
    trainer.train()
    after = trainer.evaluate(data)["eval_loss"]
    assert after < before - (0.1 if use_lora else 0.5), (before, after)
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert all("projected_grad" in h and "learning_rate" in h and "zo_skipped" in h for h in logs)


def _train_and_resume(tmp_path, common: dict, data, checkpoint: str, **trainer_kwargs):
    """Train uninterrupted, then resume a copy of its `checkpoint` into a fresh output directory, from another initial
    model; returns both trainers (the resumed one writes under ``tmp_path / "b" / "out"``)."""
    first = ZOTrainer(
        model=tiny_causal_lm("opt"), args=_args(tmp_path / "a", **common), train_dataset=data, **trainer_kwargs
    )
    first.train()
    resumed_dir = tmp_path / "b" / "out"
    resumed_dir.mkdir(parents=True)
    shutil.copytree(tmp_path / "a" / "out" / checkpoint, resumed_dir / checkpoint)
    second = ZOTrainer(
        model=tiny_causal_lm("opt", seed=5), args=_args(tmp_path / "b", **common), train_dataset=data, **trainer_kwargs
    )
    second.train(resume_from_checkpoint=str(resumed_dir / checkpoint))
    return first, second


@pytest.mark.parametrize("optimizer", ["zo_sgd", "zo_adam"])
def test_resume_from_checkpoint_is_bitwise(tmp_path, optimizer):
    data, eval_data = lm_dataset(24, seed=1), lm_dataset(4, seed=2)
    common = dict(
        max_steps=8,
        save_strategy="steps",
        save_steps=4,
        eval_strategy="steps",
        eval_steps=3,
        gradient_accumulation_steps=2,
        zo_num_perturbations=2,
        zo_optimizer=optimizer,
        per_device_train_batch_size=2,
        learning_rate=1e-3,
        weight_decay=0.1,
    )
    first, second = _train_and_resume(tmp_path, common, data, "checkpoint-4", eval_dataset=eval_data)

    uninterrupted = first.model.state_dict()
    for name, value in second.model.state_dict().items():
        assert torch.equal(value, uninterrupted[name]), name
    state = torch.load(tmp_path / "b" / "out" / "checkpoint-8" / "optimizer.pt", weights_only=True)
    assert state["zo"]["step"] == 8 and state["zo"]["optimizer"] == first.zo_optimizer.__class__.__name__
    # Checkpoints are staged, then published: nothing of the staging stays in the run folder.
    assert {p.name for p in (tmp_path / "b" / "out").iterdir()} == {"checkpoint-4", "checkpoint-8"}


def test_resume_in_a_later_epoch_of_length_grouped_batches_is_bitwise(tmp_path):
    """Checkpoint in the second epoch of ragged examples (12 examples, 3 per step: 4 steps an epoch), resume, and end
    where the uninterrupted run ends: `ZOConfig`'s length-grouped order of every epoch is drawn again."""
    common = dict(max_steps=9, save_strategy="steps", save_steps=6, per_device_train_batch_size=3)
    first, second = _train_and_resume(
        tmp_path, common, ragged_lm_dataset(12, seed=1), "checkpoint-6", data_collator=pad_lm_batch
    )

    uninterrupted = first.model.state_dict()
    for name, value in second.model.state_dict().items():
        assert torch.equal(value, uninterrupted[name]), name


def test_gradient_accumulation_adds_perturbations(tmp_path):
    args = _args(tmp_path, max_steps=2, gradient_accumulation_steps=3, zo_num_perturbations=2)
    trainer = ZOTrainer(model=tiny_causal_lm("opt"), args=args, train_dataset=lm_dataset(24))
    seen = []
    original = trainer.create_optimizer

    def create_and_watch(model=None):
        optimizer = original(model)
        apply = optimizer._apply_records
        optimizer._apply_records = lambda records: (seen.append(len(records)), apply(records))
        return optimizer

    trainer.create_optimizer = create_and_watch
    trainer.train()
    assert seen == [6, 6]


def test_only_trainable_parameters_change_and_lr_zero_is_identity(tmp_path):
    model = tiny_causal_lm("opt")
    model.model.decoder.embed_tokens.requires_grad_(False)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    trainer = ZOTrainer(model=model, args=_args(tmp_path, max_steps=5), train_dataset=lm_dataset(8))
    trainer.train()
    after = model.state_dict()
    assert torch.equal(before["model.decoder.embed_tokens.weight"], after["model.decoder.embed_tokens.weight"])
    assert not torch.equal(before["model.decoder.layers.0.fc1.weight"], after["model.decoder.layers.0.fc1.weight"])

    model = tiny_causal_lm("opt")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    ZOTrainer(model=model, args=_args(tmp_path, max_steps=5, learning_rate=0.0), train_dataset=lm_dataset(8)).train()
    for name, value in model.state_dict().items():
        torch.testing.assert_close(value, before[name], rtol=1e-6, atol=1e-6)


def test_model_card_and_tags(tmp_path):
    trainer = ZOTrainer(model=tiny_causal_lm("opt"), args=_args(tmp_path, max_steps=1), train_dataset=lm_dataset(4))
    trainer.train()
    trainer.create_model_card(model_name="tiny-zo")
    card = (tmp_path / "out" / "README.md").read_text()
    assert "zeroth-order" in card and "hf-zo" in card


def test_plain_training_arguments_are_converted(tmp_path):
    from transformers import TrainingArguments

    args = TrainingArguments(output_dir=str(tmp_path), max_steps=1, report_to=[], use_cpu=True, learning_rate=0.01)
    trainer = ZOTrainer(model=tiny_causal_lm("opt"), args=args, train_dataset=lm_dataset(4))
    assert isinstance(trainer.args, ZOConfig) and trainer.args.learning_rate == 0.01
    assert trainer.args.zo_eps == 1e-3


def test_first_order_defaults_of_plain_training_arguments_are_named(tmp_path, caplog):
    """Values left at `TrainingArguments`' first-order defaults are kept, with a warning naming each and ZO's."""
    import logging

    from transformers import TrainingArguments

    common = dict(output_dir=str(tmp_path), max_steps=1, report_to=[], use_cpu=True)
    with caplog.at_level(logging.WARNING, logger="hf_zo.training.arguments"):
        set_for_zo = TrainingArguments(
            **common,
            learning_rate=1e-6,
            lr_scheduler_type="constant",
            max_grad_norm=0.0,
            train_sampling_strategy="group_by_length",
        )
        ZOTrainer(model=tiny_causal_lm("opt"), args=set_for_zo, train_dataset=lm_dataset(4))
        assert "TrainingArguments' defaults" not in caplog.text
        trainer = ZOTrainer(model=tiny_causal_lm("opt"), args=TrainingArguments(**common), train_dataset=lm_dataset(4))
    assert trainer.args.learning_rate == 5e-5
    for kept in (
        "learning_rate=5e-05",
        "lr_scheduler_type='linear' (ZOConfig's default: 'constant')",
        "max_grad_norm=1.0",
        "train_sampling_strategy='random'",
    ):
        assert kept in caplog.text, kept


def _classifier_run(tmp_path, trainer_class=ZOTrainer, **kwargs):
    from tiny_models import classification_dataset, tiny_bert_classifier

    if "model_init" not in kwargs:
        kwargs["model"] = tiny_bert_classifier(seed=0)
    args = _args(tmp_path, max_steps=4, **kwargs.pop("args", {}))
    trainer = trainer_class(args=args, train_dataset=classification_dataset(16), **kwargs)
    trainer.train()
    return trainer


class _PoppingLossTrainer(ZOTrainer):
    """The `compute_loss` override of transformers' docs: it takes the labels out of the inputs."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        labels = inputs.pop("labels")
        outputs = model(**inputs)
        loss = torch.nn.functional.cross_entropy(outputs.logits, labels)
        return (loss, outputs) if return_outputs else loss


def test_loss_customisations_that_take_the_labels_out_of_the_inputs_train(tmp_path):
    """Trainer's `compute_loss` pops the labels for a label smoother or a `compute_loss_func`; each ZO forward must
    still get them. The cross-entropy written by hand trains the weights the model's own loss does."""
    reference = _classifier_run(tmp_path / "reference").model.state_dict()

    def cross_entropy(outputs, labels, num_items_in_batch=None):
        return torch.nn.functional.cross_entropy(outputs.logits, labels)

    for custom in (
        _classifier_run(tmp_path / "loss_func", compute_loss_func=cross_entropy),
        _classifier_run(tmp_path / "override", trainer_class=_PoppingLossTrainer),
    ):
        assert all(torch.equal(t, reference[n]) for n, t in custom.model.state_dict().items())

    smoothed = _classifier_run(tmp_path / "smoothed", args={"label_smoothing_factor": 0.1})
    assert math.isfinite(smoothed.state.log_history[-1]["train_loss"])
    assert not torch.equal(smoothed.model.classifier.weight, reference["classifier.weight"])


def test_a_model_from_model_init_is_the_one_whose_head_is_probed_and_trained(tmp_path):
    from tiny_models import tiny_bert_classifier

    built = []

    def model_init():
        built.append(tiny_bert_classifier(seed=0))
        return built[-1]

    trainer = _classifier_run(tmp_path / "init", model_init=model_init)
    reference = _classifier_run(tmp_path / "model").model.state_dict()

    assert trainer.model is built[-1]
    untrained = tiny_bert_classifier(seed=0).classifier.weight
    assert not torch.equal(trainer.model.classifier.weight, untrained)
    assert all(torch.equal(t, reference[n]) for n, t in trainer.model.state_dict().items())
