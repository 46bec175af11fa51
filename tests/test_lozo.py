"""LOZO: low-rank counter-based noise, unbiased estimates, descent, bitwise replay and resume, clear errors."""

from __future__ import annotations

import copy

import pytest
import torch

from hf_zo import TRAJECTORY_NAME, ZOConfig, ZOTrainer, replay
from hf_zo.noise import NOISE_BLOCK_NUMEL, Noise, NoiseUpdate
from hf_zo.optim import LOZO, LowRankNoise

from tiny_models import classification_dataset, lm_dataset, tiny_bert_classifier, tiny_causal_lm


def _matrix_problem(seed=0):
    target = torch.randn(12, 10, generator=torch.Generator().manual_seed(seed))
    weight = torch.nn.Parameter(torch.zeros(12, 10))
    bias = torch.nn.Parameter(torch.zeros(3))
    return weight, bias, lambda: ((weight - target) ** 2).sum() + ((bias - 1.0) ** 2).sum()


def test_matrix_noise_has_the_rank_and_vectors_stay_full_rank():
    optimizer = LOZO([torch.nn.Parameter(torch.zeros(12, 10)), torch.nn.Parameter(torch.zeros(7))], lr=0.1, rank=3)
    seed = optimizer.perturbation_seed(0, 0)
    z = optimizer.noise.sample(seed, 0, (12, 10))
    assert torch.linalg.matrix_rank(z) == 3
    second_moment = sum(
        optimizer.noise.sample(s, 0, (12, 10)).pow(2).mean() for s in range(1 << 32, 301 << 32, 1 << 32)
    )
    assert second_moment / 300 == pytest.approx(1.0, abs=0.1)  # unit variance per element: the 1 / sqrt(rank)
    vector = optimizer.noise.sample(seed, 1, (7,))
    assert torch.equal(vector, Noise().sample(seed, 1, (7,)))  # vectors keep the full-rank noise


def test_noise_does_not_depend_on_how_a_parameter_is_cut():
    noise = LowRankNoise(2, shapes={4: (300, 500)}, chunk_numel=NOISE_BLOCK_NUMEL)
    whole = noise.sample(12345, 4, (300, 500)).view(-1)
    for start in range(0, whole.numel(), NOISE_BLOCK_NUMEL):
        chunk = torch.empty(min(NOISE_BLOCK_NUMEL, whole.numel() - start))
        assert torch.equal(noise.fill_(chunk, 12345, 4, start), whole[start : start + chunk.numel()])


def test_steps_of_one_subspace_period_share_the_right_factor():
    optimizer = LOZO([torch.nn.Parameter(torch.zeros(12, 10))], lr=0.1, rank=2, subspace_steps=4)
    noises = [optimizer.noise.sample(optimizer.perturbation_seed(step, 0), 0, (12, 10)) for step in range(5)]
    assert torch.linalg.matrix_rank(torch.cat(noises[:4])) == 2  # the same row space (span of V) for 4 steps
    assert torch.linalg.matrix_rank(torch.cat(noises)) == 4  # the fifth step draws a new V
    assert len({optimizer.perturbation_seed(step, 0) for step in range(5)}) == 5  # U is new at every step


def test_the_estimate_is_unbiased_over_the_noise():
    weight = torch.nn.Parameter(torch.randn(6, 5, generator=torch.Generator().manual_seed(0)))
    optimizer = LOZO([weight], lr=0.0, eps=1e-3, rank=2, subspace_steps=1)
    gradient = 2 * weight.detach()  # of sum(w ** 2)
    total = torch.zeros_like(weight)
    samples = 4000
    for step in range(samples):
        z = optimizer.noise.sample(optimizer.perturbation_seed(step, 0), 0, weight.shape)
        total += (gradient * z).sum() * z  # the projected gradient of a quadratic is exact: z . grad
    error = (total / samples - gradient).norm() / gradient.norm()
    assert error < 0.15


def test_plain_loop_descends_on_a_matrix_quadratic():
    weight, bias, loss = _matrix_problem()
    optimizer = LOZO([weight, bias], lr=2e-3, eps=1e-3, seed=1, rank=2, subspace_steps=10)
    start = loss().item()
    for _ in range(600):
        optimizer.step(loss)
    optimizer.flush()
    assert loss().item() < 0.5 * start


def test_descends_on_a_tiny_model():
    model = tiny_bert_classifier()
    batch = classification_dataset(16)[:16]
    inputs = {k: torch.tensor(v) for k, v in batch.items()}
    inputs["labels"] = inputs.pop("label")
    optimizer = LOZO(list(model.parameters()), lr=1e-2, eps=1e-3, seed=0, rank=2, subspace_steps=20)
    model.eval()

    def loss():
        return model(**inputs).loss

    with torch.no_grad():
        start = loss().item()
        for _ in range(40):
            optimizer.step(loss)
        optimizer.flush()
        assert loss().item() < start - 0.003  # 0.693 -> 0.686 here; a random direction would not descend


def test_resume_from_state_dict_is_bitwise():
    def run(split):
        weight, bias, loss = _matrix_problem()
        optimizer = LOZO([weight, bias], lr=2e-3, eps=1e-3, seed=3, num_perturbations=2, subspace_steps=3)
        for step in range(10):
            if step == split:
                optimizer.flush()
                state, saved = optimizer.state_dict(), (weight.detach().clone(), bias.detach().clone())
                weight, bias, loss = _matrix_problem()
                with torch.no_grad():
                    weight.copy_(saved[0])
                    bias.copy_(saved[1])
                optimizer = LOZO([weight, bias], lr=2e-3, eps=1e-3, seed=99, num_perturbations=2, subspace_steps=3)
                optimizer.load_state_dict(state)
            optimizer.step(loss)
        optimizer.flush()
        return torch.cat([weight.detach().view(-1), bias.detach()])

    assert torch.equal(run(split=-1), run(split=4))


def test_trainer_run_replays_bitwise(tmp_path):
    base = tiny_causal_lm("opt")
    args = ZOConfig(
        output_dir=str(tmp_path),
        zo_optimizer="lozo",
        zo_lozo_rank=2,
        zo_lozo_subspace_steps=2,
        per_device_train_batch_size=2,
        zo_num_perturbations=2,
        learning_rate=1e-3,
        max_steps=5,
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
        use_cpu=True,
    )
    trainer = ZOTrainer(model=copy.deepcopy(base), args=args, train_dataset=lm_dataset(16, length=8))
    trainer.train()
    trainer.save_model()
    assert (trainer.zo_optimizer.defaults["rank"], trainer.zo_optimizer.defaults["subspace_steps"]) == (2, 2)
    replay(base, tmp_path / TRAJECTORY_NAME)
    trained = dict(trainer.model.named_parameters())
    changed = 0
    for name, param in base.named_parameters():
        assert torch.equal(param, trained[name]), name
        changed += not torch.equal(param, dict(tiny_causal_lm("opt").named_parameters())[name])
    assert changed


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("zo_lozo_rank", 0, "zo_lozo_rank must be an integer >= 1, got 0"),
        ("zo_lozo_subspace_steps", 0, "zo_lozo_subspace_steps must be an integer >= 1, got 0"),
        ("zo_noise", "table", "zo_optimizer='lozo' .* cannot use zo_noise='table'"),
    ],
)
def test_bad_settings_fail_at_construction_naming_the_field(tmp_path, field, value, message):
    with pytest.raises(ValueError, match=message):
        ZOConfig(output_dir=str(tmp_path), zo_optimizer="lozo", **{field: value})
    with pytest.raises(ValueError, match="rank must be an integer >= 1"):
        LOZO([torch.nn.Parameter(torch.zeros(3, 3))], lr=0.1, rank=0)


def test_sweeps_without_the_noise_cache_keep_the_low_rank_noise():
    # The compiled Philox kernel generates plain z inside the sweep; LowRankNoise must not be swept by it.
    noise = LowRankNoise(2, shapes={0: (40, 30)})
    assert not noise.cache_numel
    swept = torch.zeros(40, 30)
    noise.apply_([(0, swept)], [NoiseUpdate(terms={5: 1.0})])
    assert torch.linalg.matrix_rank(swept) == 2
    assert torch.equal(swept, noise.sample(5, 0, (40, 30)))


@pytest.mark.parametrize("algorithm", ["torch", "philox"])
def test_the_chosen_noise_algorithm_generates_the_factors(algorithm):
    weight = torch.nn.Parameter(torch.zeros(40, 30))
    optimizer = LOZO([weight], lr=1e-3, noise=Noise("gaussian", algorithm=algorithm))
    assert optimizer.noise.algorithm == algorithm and not optimizer.noise.algorithm_is_automatic
    assert optimizer.state_dict()["zo"]["noise_algorithm"] == algorithm
