"""Stochastic rounding of bfloat16 sweeps (`zo_stochastic_rounding`): updates far below half a unit in the last place
are lost when rounded to the nearest and kept in expectation when rounded stochastically, with random bits that make
the result independent of chunking and threads, so that a trained bf16 model resumes and replays bitwise."""

import copy
import shutil

import pytest
import torch

from hf_zo import ZOSGD, ZOConfig, ZOTrainer, ZOTrajectory, replay
from hf_zo.noise import Noise, NoiseUpdate, kept_update, round_stochastically_, update_of

from tiny_models import lm_dataset, tiny_causal_lm

NUMEL = 1 << 20


def _weights_near_002() -> torch.Tensor:
    """bf16 weights in [0.016, 0.031): one ulp is 2^-13 (1.2e-4), so an update of 1e-6 * z is below half of it."""
    generator = torch.Generator().manual_seed(0)
    return (0.016 + 0.015 * torch.rand(NUMEL, generator=generator)).to(torch.bfloat16)


SMALL_UPDATE = NoiseUpdate(terms={1234: -1e-6})


@pytest.mark.parametrize(
    "distribution, algorithm", [("gaussian", "philox"), ("rademacher", "philox"), ("gaussian", "torch")]
)
def test_an_update_below_half_an_ulp_is_lost_to_nearest_rounding_and_kept_by_stochastic_rounding(
    distribution, algorithm
):
    weights = _weights_near_002()
    for stochastic in (False, True):
        noise = Noise(distribution, algorithm=algorithm, stochastic_rounding=stochastic)
        updated = weights.clone()
        noise.apply_([(0, updated)], [copy.deepcopy(SMALL_UPDATE)])
        kept = kept_update([weights], [updated], [update_of(noise, 0, weights, SMALL_UPDATE)])
        if stochastic:
            assert 0.9 < kept < 1.1, kept
            assert 0.001 < (updated != weights).float().mean() < 0.1  # some elements move one ulp, most stay
        else:
            assert torch.equal(updated, weights)
            assert kept == 0.0


@pytest.mark.parametrize("chunk_numel, num_workers", [(1 << 16, 1), (1 << 18, 2), (1 << 20, 2)])
def test_stochastic_rounding_depends_on_neither_chunking_nor_threads(chunk_numel, num_workers):
    weights = _weights_near_002().view(1024, 1024)
    update = NoiseUpdate(decay=1.0 - 1e-3, terms={7: -1e-6, 8: 2e-6})
    reference = weights.clone()
    Noise(stochastic_rounding=True, num_workers=1).apply_([(3, reference)], [copy.deepcopy(update)])
    noise = Noise(stochastic_rounding=True, chunk_numel=chunk_numel, num_workers=num_workers)
    for _ in range(2):
        updated = weights.clone()
        noise.apply_([(3, updated)], [copy.deepcopy(update)])
        assert torch.equal(updated, reference)
    transposed = weights.t().clone().t()  # not contiguous: swept through a contiguous copy, same elements
    noise.apply_([(3, transposed)], [copy.deepcopy(update)])
    assert torch.equal(transposed, reference)


def test_operations_round_alike_however_they_are_grouped_into_sweeps():
    """Each operation rounds on its own, as rounding to the nearest does: a pending update flushed early (a
    checkpoint, an evaluation) gives the bits of the same update fused with the next perturbation (a replay)."""
    weights = _weights_near_002()
    noise = Noise(stochastic_rounding=True)
    fused, split = weights.clone(), weights.clone()
    update = NoiseUpdate(decay=0.999, terms={1: -1e-6})
    later = copy.deepcopy(update)
    later.add(2, 1e-3)
    noise.apply_([(0, fused)], [later])
    noise.apply_([(0, split)], [copy.deepcopy(update)])
    noise.apply_([(0, split)], [NoiseUpdate(terms={2: 1e-3})])
    assert torch.equal(fused, split)


@pytest.mark.parametrize("value", [1 + 2**-10, -(1 + 2**-10), 2 - 2**-9, -(2 - 2**-9), 3e-40, 0.02 + 1e-6])
def test_rounding_is_unbiased_for_either_sign_across_binades_and_for_subnormals(value):
    """Over every one of the 2^16 random integers the mean result is the value itself, exactly."""
    bits = torch.arange(1 << 16, dtype=torch.int32)
    out = torch.empty(1 << 16, dtype=torch.bfloat16)
    round_stochastically_(out, torch.full((1 << 16,), value, dtype=torch.float32), bits)
    assert out.double().mean().item() == pytest.approx(torch.tensor(value).item(), rel=1e-12, abs=1e-45)
    assert len(out.unique()) <= 2


def test_exact_values_infinities_and_nan_survive_stochastic_rounding():
    values = torch.tensor([0.0, -0.0, 1.0, -0.5, float("inf"), float("-inf"), float("nan")])
    out = torch.empty(len(values), dtype=torch.bfloat16)
    round_stochastically_(out, values.clone(), torch.full((len(values),), 0xFFFF, dtype=torch.int32))
    assert torch.equal(out[:-1].float(), values[:-1]) and out[-1].isnan()


def test_fp32_sweeps_are_unaffected_and_fp16_is_refused():
    weights = torch.randn(NUMEL // 4)
    update = NoiseUpdate(decay=0.99, terms={5: -1e-3})
    plain, rounded = weights.clone(), weights.clone()
    Noise().apply_([(0, plain)], [copy.deepcopy(update)])
    Noise(stochastic_rounding=True).apply_([(0, rounded)], [copy.deepcopy(update)])
    assert torch.equal(plain, rounded)

    half = torch.nn.Linear(4, 4).half()
    with pytest.raises(ValueError, match="rounds bfloat16 weights only, but some trainable weights are float16"):
        ZOSGD(half.parameters(), lr=1e-3, noise=Noise(stochastic_rounding=True))
    with pytest.raises(ValueError, match="float16"):
        Noise(stochastic_rounding=True).apply_([(0, weights.half())], [copy.deepcopy(update)])


def _bf16_llama():
    return tiny_causal_lm("llama").to(torch.bfloat16)


def _last_kept_update(stochastic: bool) -> float:
    """MeZO steps at lr 1e-6 on a bf16 Llama; the fraction of the last step's update that the weights kept."""
    model = _bf16_llama()
    data = lm_dataset(4, length=8)
    batch = {key: torch.tensor([row[key] for row in data]) for key in ("input_ids", "labels")}
    noise = Noise(stochastic_rounding=stochastic)
    optimizer = ZOSGD(model.parameters(), lr=1e-6, eps=1e-3, exact_restore=True, noise=noise)
    tensors = optimizer.params.tensors
    measured = {}

    def measure(optimizer, step, seeds, records):  # ZO-SGD's update of this step, pending until the flush
        measured["before"] = [t.detach().clone() for _, t in tensors]
        lr, wd = optimizer.param_groups[0]["lr"], optimizer.param_groups[0]["weight_decay"]
        update = NoiseUpdate(decay=1.0 - lr * wd)
        for record in records:
            update.add(record.seed, -lr * record.projected_grad / len(records))
        measured["intended"] = [update_of(noise, index, t, update) for index, t in tensors]

    optimizer.register_update_hook(measure)
    for _ in range(3):
        optimizer.step(lambda: model(**batch).loss)
    optimizer.flush()
    return kept_update(measured["before"], [t for _, t in tensors], measured["intended"])


def test_kept_update_of_a_bf16_model_is_about_0_rounded_to_nearest_and_about_1_stochastically():
    assert abs(_last_kept_update(stochastic=False)) < 0.2
    assert 0.8 < _last_kept_update(stochastic=True) < 1.2


def _args(output_dir, **overrides):
    values = dict(
        output_dir=str(output_dir),
        per_device_train_batch_size=2,
        learning_rate=1e-6,
        zo_eps=1e-3,
        zo_engine="dual",
        zo_exact_restore=True,
        zo_stochastic_rounding=True,
        max_steps=4,
        save_strategy="steps",
        save_steps=2,
        logging_steps=2,
        report_to=[],
        disable_tqdm=True,
        use_cpu=True,
    )
    values.update(overrides)
    return ZOConfig(**values)


def _train(model, output_dir, resume_from_checkpoint=None, **overrides):
    trainer = ZOTrainer(model=model, args=_args(output_dir, **overrides), train_dataset=lm_dataset(16, length=8))
    trainer.train(resume_from_checkpoint=resume_from_checkpoint)
    trainer.save_model()
    return trainer


def _weights(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _assert_bitwise(actual, expected):
    assert actual.keys() == expected.keys()
    for name in expected:
        assert torch.equal(actual[name], expected[name]), name


def test_a_bf16_run_with_stochastic_rounding_learns_resumes_and_replays_bitwise(tmp_path):
    base = _bf16_llama()
    trained = _weights(_train(copy.deepcopy(base), tmp_path / "a").model)
    nearest = _weights(_train(copy.deepcopy(base), tmp_path / "nearest", zo_stochastic_rounding=False).model)

    def changed(weights):  # of magnitude >= 2^-6, whose half ulp (6e-5) no step's 1e-6 * g * z reaches
        return sum(int(((weights[n] != p) & (p.abs() >= 2**-6)).sum()) for n, p in _weights(base).items())

    assert changed(nearest) == 0
    assert changed(trained) > 100

    trajectory = ZOTrajectory.load(tmp_path / "a")
    assert trajectory.header["optimizer"]["noise"]["stochastic_rounding"] is True
    replayed = replay(copy.deepcopy(base), trajectory)
    _assert_bitwise(_weights(replayed), trained)

    shutil.copytree(tmp_path / "a" / "checkpoint-2", tmp_path / "b" / "checkpoint-2")
    resumed = _train(copy.deepcopy(base), tmp_path / "b", str(tmp_path / "b" / "checkpoint-2"))
    _assert_bitwise(_weights(resumed.model), trained)

    with pytest.raises(ValueError, match="resume with the same zo_stochastic_rounding"):
        _train(copy.deepcopy(base), tmp_path / "c", str(tmp_path / "b" / "checkpoint-2"), zo_stochastic_rounding=False)


@pytest.mark.parametrize("exact_restore", [False, True])
def test_a_plain_loop_replays_bitwise_with_the_restore_it_chose(tmp_path, exact_restore):
    """The replay restores as the run did, also where its own default would choose otherwise (a small bf16 set
    defaults to the exact restore)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)).to(torch.bfloat16)
    base = copy.deepcopy(model)
    noise = Noise(stochastic_rounding=True)
    optimizer = ZOSGD(model.parameters(), lr=1e-4, weight_decay=0.1, exact_restore=exact_restore, noise=noise)
    trajectory = ZOTrajectory.start(model, optimizer)
    trajectory.attach(optimizer)
    data = torch.randn(32, 16, dtype=torch.bfloat16)
    for _ in range(4):
        optimizer.step(lambda: model(data).float().square().mean())
    optimizer.flush()
    replay(base, trajectory.save(tmp_path, model))
    _assert_bitwise(_weights(base), _weights(model))


@pytest.mark.parametrize("algorithm", ["philox", "torch"])
def test_a_range_cut_anywhere_rounds_as_the_whole_tensor(algorithm):
    """An FSDP2 shard's range may begin and end inside a noise block: its elements round as in the whole tensor."""
    weights = _weights_near_002()[: 3 * (1 << 16) + 5]
    update = NoiseUpdate(decay=1.0 - 1e-3, terms={7: -1e-6})
    noise = Noise(algorithm=algorithm, stochastic_rounding=True)
    whole = weights.clone()
    noise.apply_([(2, whole)], [copy.deepcopy(update)])
    start, stop = 1000, 2 * (1 << 16) + 17
    shard = weights[start:stop].clone()
    terms = list(update.terms.items())
    noise.update_chunk_(shard, torch.empty(len(shard)), 2, start, update.decay, terms, len(weights))
    assert torch.equal(shard, whole[start:stop])


def test_perturbations_undone_from_a_copy_round_to_nearest(tmp_path):
    """With exact restore the dual engine undoes each block's perturbation from a saved copy, so the perturbation's
    rounding is never kept: it rounds to nearest, and the first step's losses are those of rounding to nearest."""
    base = _bf16_llama()
    overrides = dict(max_steps=1, logging_steps=1, save_strategy="no")
    losses = {}
    for stochastic in (True, False):
        output_dir = tmp_path / str(stochastic)
        trainer = _train(copy.deepcopy(base), output_dir, zo_stochastic_rounding=stochastic, **overrides)
        losses[stochastic] = [log["loss"] for log in trainer.state.log_history if "loss" in log]
    assert losses[True] == losses[False] and len(losses[True]) == 1
