"""Trajectories: recording, bitwise replay (full, LoRA, stateful, across a resume), file integrity, CLI, Hub push."""

import copy
import hashlib
import json
import math
import shutil
import struct

import pytest
import torch
from peft import LoraConfig, get_peft_model

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
    push_trajectory_to_hub,
    replay,
)
from hf_zo.cli import main as cli_main

from tiny_models import lm_dataset, tiny_causal_lm


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
    with pytest.raises(ValueError, match="cannot be replayed: ZOSGDConservative picks each update"):
        replay(base, trajectory)


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
    magic, _, header_size, body_size = struct.unpack_from("<8sIIQ", data)
    header = json.loads(data[24 : 24 + header_size])
    del header["optimizer"]["noise"]["algorithm"]
    header["format_version"] = 1
    header_bytes = json.dumps(header).encode()
    old = struct.pack("<8sIIQ", magic, 1, len(header_bytes), body_size) + header_bytes + data[24 + header_size : -32]
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
