"""The core equivalences on every tiny model family, as PEFT parametrises its core checks: OPT, Llama, Qwen2 and
GPT-2 causal LMs and a BERT sequence classifier (its head trained zeroth-order with the body).

Each family trains 4 `ZOTrainer` steps (2 micro-batches of 2 perturbations, weight decay, a linear schedule), saving
at step 2; that run is the reference for: CPU offload through the dual engine (offload = resident), a resume from
step 2 (resume = uninterrupted) and the replay of its trajectory on the untrained model (replay = training), each
bitwise. Dual = sequential is `test_engines.py`'s, DP = accumulation `test_distributed.py`'s, both on the same five
families. Last, a run written by the code before the restructuring of issue 43 resumes and replays today (bitwise
where the bits are promised: see the test).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from fixtures.write_pre_restructure_run import ARGS as PRE_RESTRUCTURE_ARGS
from safetensors.torch import load_file

from hf_zo import ZOConfig, ZOTrainer, ZOTrajectory, replay

from tiny_models import classification_dataset, lm_dataset, tiny_bert_classifier, tiny_causal_lm, zo_args

FAMILIES = ["opt", "llama", "qwen2", "gpt2", "bert"]


def _model(family: str) -> torch.nn.Module:
    return tiny_bert_classifier() if family == "bert" else tiny_causal_lm(family)


def _train(family: str, out, resume: str | None = None, **overrides) -> dict[str, torch.Tensor]:
    """Train a fresh `family` model for 4 steps (from `resume` when given); its trainable weights afterwards."""
    head = dict(zo_head_init="none", zo_head_training="zeroth_order") if family == "bert" else {}
    data = classification_dataset(16) if family == "bert" else lm_dataset(16, length=8)
    args = zo_args(
        out,
        output_dir=str(out),  # not zo_args' out / "out": a resume copies the checkpoint in here
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        zo_num_perturbations=2,
        max_steps=4,
        weight_decay=0.1,
        lr_scheduler_type="linear",
        save_strategy="steps",
        save_steps=2,
        **head,
        **overrides,
    )
    trainer = ZOTrainer(model=_model(family), args=args, train_dataset=data)
    trainer.train(resume_from_checkpoint=resume)
    trainer.save_model()  # with the trajectory of the whole run
    return {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}


def _assert_bitwise(actual: dict, expected: dict) -> None:
    assert actual.keys() == expected.keys()
    for name, value in expected.items():
        assert torch.equal(actual[name], value), f"{name} differs by {(actual[name] - value).abs().max()}"


@pytest.fixture(scope="module", params=FAMILIES)
def trained(request, tmp_path_factory):
    """The reference run of one family: its name, output folder and trained weights."""
    out = tmp_path_factory.mktemp(request.param)
    return request.param, out, _train(request.param, out)


def test_training_moves_every_family(trained):
    family, _, weights = trained
    start = {n: p for n, p in _model(family).named_parameters() if p.requires_grad}
    assert any(not torch.equal(weights[n], start[n]) for n in weights)


def test_cpu_offload_equals_resident(trained, tmp_path):
    family, _, weights = trained
    _assert_bitwise(_train(family, tmp_path, zo_engine="dual", zo_offload="cpu"), weights)


def test_resume_equals_the_uninterrupted_run(trained, tmp_path):
    family, out, weights = trained
    shutil.copytree(out / "checkpoint-2", tmp_path / "checkpoint-2")
    _assert_bitwise(_train(family, tmp_path, resume=str(tmp_path / "checkpoint-2")), weights)


def test_trajectory_replays_the_training(trained):
    family, out, weights = trained
    model = _model(family)
    replay(model, ZOTrajectory.load(out))
    _assert_bitwise({n: p.detach() for n, p in model.named_parameters() if p.requires_grad}, weights)


# ------------------------------------------------------------------ a run written before the restructuring

PRE_RESTRUCTURE = Path(__file__).resolve().parent / "fixtures" / "pre_restructure_run"


def _pre_restructure_weights() -> dict[str, torch.Tensor]:
    return load_file(str(PRE_RESTRUCTURE / "model.safetensors"))


def test_a_checkpoint_written_before_the_restructuring_resumes_bitwise(tmp_path):
    """tests/fixtures/pre_restructure_run was written by the code of commit 40d7f28 (its script says how).

    Its checkpoint resumes under today's code as the uninterrupted run would have continued: the resumed run's
    trajectory keeps the old run's first two steps as written and takes the old run's seeds, rates and weight decays
    for the next two, and replayed on the untrained model it gives the resumed weights bitwise. Steps 3-4 run their
    forwards here, and float kernels round differently on another CPU, so their projected gradients (and the final
    weights) are compared with the fixture's to a few float32 roundings of the loss, not bitwise: the bits this
    machine computes are compared with what this machine computes.
    """
    shutil.copytree(PRE_RESTRUCTURE / "checkpoint-2", tmp_path / "checkpoint-2")
    args = ZOConfig(output_dir=str(tmp_path), **PRE_RESTRUCTURE_ARGS)
    trainer = ZOTrainer(model=tiny_causal_lm("opt"), args=args, train_dataset=lm_dataset(16, length=8))
    trainer.train(resume_from_checkpoint=str(tmp_path / "checkpoint-2"))
    trainer.save_model()  # as the run that wrote the fixture, with the trajectory of the whole run
    expected = _pre_restructure_weights()
    resumed = {n: p.detach().clone() for n, p in trainer.model.state_dict().items() if n in expected}

    old, new = list(ZOTrajectory.load(PRE_RESTRUCTURE).steps()), list(ZOTrajectory.load(tmp_path).steps())
    assert [s.step for s in new] == [s.step for s in old] == [0, 1, 2, 3]
    assert new[:2] == old[:2]  # the checkpoint's steps, as the old code wrote them
    for here, there in zip(new[2:], old[2:]):
        assert (here.seeds, here.lrs, here.weight_decays) == (there.seeds, there.lrs, there.weight_decays)
        # One float32 rounding of a loss near 4 moves (L+ - L-) / (2 * 1e-3) by about 2.4e-4.
        assert here.projected_grads == pytest.approx(there.projected_grads, abs=1e-3)

    replayed = replay(tiny_causal_lm("opt"), ZOTrajectory.load(tmp_path))
    _assert_bitwise({n: p.detach() for n, p in replayed.state_dict().items() if n in expected}, resumed)
    for name, value in expected.items():
        torch.testing.assert_close(resumed[name], value, rtol=0, atol=1e-5, msg=name)


def test_a_trajectory_written_before_the_restructuring_replays_bitwise():
    model = replay(tiny_causal_lm("opt"), ZOTrajectory.load(PRE_RESTRUCTURE))
    expected = _pre_restructure_weights()
    _assert_bitwise({n: p.detach() for n, p in model.state_dict().items() if n in expected}, expected)
