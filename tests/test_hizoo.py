"""HiZOO: preconditioned counter-based noise, the update against a hand computation, curvature learning, descent,
bitwise resume and replay through ZOTrainer, clear errors."""

from __future__ import annotations

import copy
import shutil

import pytest
import torch

from hf_zo import TRAJECTORY_NAME, ZOConfig, ZOTrainer, ZOTrajectory, replay
from hf_zo.noise import NOISE_BLOCK_NUMEL, Noise, NoiseUpdate
from hf_zo.optim import ZOSGD, HiZOO, PreconditionedNoise

from tiny_models import lm_dataset, tiny_causal_lm


def _quadratic(curvatures: torch.Tensor, dtype=torch.float64):
    target = torch.randn(len(curvatures), generator=torch.Generator().manual_seed(0), dtype=dtype)
    x = torch.nn.Parameter(torch.zeros(len(curvatures), dtype=dtype))
    return x, lambda: (curvatures.to(dtype) * (x - target) ** 2).sum()


def test_noise_is_z_over_sqrt_h_whatever_the_chunking_and_cache():
    hessian = torch.rand(3 * NOISE_BLOCK_NUMEL + 5, generator=torch.Generator().manual_seed(0)) + 0.5
    noise = PreconditionedNoise(chunk_numel=NOISE_BLOCK_NUMEL)
    noise.hessians = {7: hessian}
    expected = Noise().sample(42, 7, hessian.shape) / hessian.sqrt()
    assert torch.equal(noise.sample(42, 7, hessian.shape), expected)
    for start in range(0, hessian.numel(), NOISE_BLOCK_NUMEL):
        chunk = torch.empty(min(NOISE_BLOCK_NUMEL, hessian.numel() - start))
        assert torch.equal(noise.fill_(chunk, 42, 7, start), expected[start : start + chunk.numel()])
    # Sweeps generate through fill_: neither the compiled kernel (no cache) nor the cache serves plain z.
    for cache_numel in (0, 1 << 20):
        noise.enable_cache(cache_numel)
        swept = torch.zeros_like(hessian)
        noise.apply_([(7, swept)], [NoiseUpdate(terms={42: 1.0})])
        assert torch.allclose(swept, expected, rtol=1e-6, atol=0)


def test_update_matches_a_hand_computation():
    curvatures = torch.tensor([1.0, 4.0, 9.0, 100.0, 0.5])
    x, loss = _quadratic(curvatures)
    lr, wd, eps, smooth = 1e-3, 0.1, 1e-2, 0.5
    optimizer = HiZOO([x], lr=lr, eps=eps, weight_decay=wd, hessian_smooth=smooth, num_perturbations=2, seed=3)
    hessian = torch.ones(5, dtype=torch.float64)
    theta = x.detach().clone()
    for _ in range(2):  # the second step perturbs along z / sqrt(H) with H != 1
        records = optimizer.estimate(loss)
        optimizer.step()
        zs = [Noise().sample(r.seed, 0, (5,)).double() for r in records]
        us = [z / hessian.sqrt() for z in zs]
        for record, u in zip(records, us):  # the curvature of a quadratic along u is exactly sum(a * u^2)
            assert record.curvature == pytest.approx((curvatures * u**2).sum().item(), rel=1e-6)
        theta = (1 - lr * wd) * theta - lr * sum(r.projected_grad * u for r, u in zip(records, us)) / 2
        hessian = hessian * (1 - smooth + smooth * sum(r.curvature * z**2 for r, z in zip(records, zs)) / 2)
        assert torch.allclose(x.detach(), theta, rtol=1e-6, atol=1e-9)
        assert torch.allclose(optimizer.state[x]["hessian"].double(), hessian, rtol=1e-5)
    assert optimizer.state[x]["hessian"].dtype == torch.float32


def test_hessian_learns_the_curvature_ordering():
    # With lr = 0 the weights stay put, so only H moves: towards (d + 2) * diag(A) for a quadratic x^T A x.
    curvatures = torch.logspace(0, 3, 16)
    x, loss = _quadratic(curvatures)
    optimizer = HiZOO([x], lr=0.0, eps=1e-3, hessian_smooth=1e-2, seed=1)
    for _ in range(600):
        optimizer.step(loss)
    log_h = optimizer.state[x]["hessian"].log()
    assert log_h[-4:].mean() - log_h[:4].mean() > 2.0  # the stiffest quarter's H is over e^2 times the flattest's


def test_descends_on_an_ill_conditioned_quadratic():
    curvatures = torch.logspace(0, 3, 16)
    x, loss = _quadratic(curvatures)
    optimizer = HiZOO([x], lr=1e-4, eps=1e-3, hessian_smooth=1e-4, seed=1)
    start = loss().item()
    for _ in range(600):
        optimizer.step(loss)
    optimizer.flush()
    assert loss().item() < 0.5 * start


def test_smooth_zero_is_mezo_with_a_third_forward():
    def run(cls, **kwargs):
        x, loss = _quadratic(torch.tensor([1.0, 2.0, 3.0]), dtype=torch.float32)
        calls = []

        def closure():
            calls.append(1)
            return loss()

        optimizer = cls([x], lr=1e-2, eps=1e-3, seed=5, **kwargs)
        for _ in range(5):
            optimizer.step(closure)
        optimizer.flush()
        return x.detach(), len(calls)

    (mezo, mezo_forwards), (hizoo, hizoo_forwards) = run(ZOSGD), run(HiZOO, hessian_smooth=0.0)
    assert torch.allclose(mezo, hizoo, rtol=1e-4, atol=1e-5)  # same noise and update, rounding aside
    assert (mezo_forwards, hizoo_forwards) == (10, 15)


def test_non_finite_center_loss_drops_the_estimate():
    x, loss = _quadratic(torch.tensor([1.0, 2.0]), dtype=torch.float32)
    optimizer = HiZOO([x], lr=1e-2)
    losses = iter([float("nan"), 1.0, 1.0])
    assert optimizer.estimate(lambda: next(losses)) == []
    assert optimizer.num_skipped == 1


def _args(output_dir, **overrides) -> ZOConfig:
    values = dict(
        output_dir=str(output_dir),
        zo_optimizer="hizoo",
        zo_hizoo_smooth=1e-3,
        zo_eps=1e-2,
        zo_num_perturbations=2,
        gradient_accumulation_steps=2,
        per_device_train_batch_size=2,
        learning_rate=1e-3,
        weight_decay=0.1,
        max_steps=6,
        save_strategy="steps",
        save_steps=3,
        logging_steps=1,
        report_to=[],
        disable_tqdm=True,
        use_cpu=True,
    )
    values.update(overrides)
    return ZOConfig(**values)


def _trainable(model):
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def test_trainer_run_trains_resumes_and_replays_bitwise(tmp_path):
    data = lm_dataset(24, length=8, seed=1)
    base = tiny_causal_lm("opt")
    first = ZOTrainer(model=copy.deepcopy(base), args=_args(tmp_path / "a"), train_dataset=data)
    first.train()
    first.save_model()
    trained = _trainable(first.model)
    losses = [h["loss"] for h in first.state.log_history if "loss" in h]
    assert len(losses) == 6 and all(loss == loss for loss in losses)
    assert any(not torch.equal(trained[n], p) for n, p in _trainable(base).items())
    hessians = [first.zo_optimizer.state[p]["hessian"] for _, p in first.zo_optimizer.params.tensors]
    assert not all(torch.equal(h, torch.ones_like(h)) for h in hessians)

    # Resume from the step-3 checkpoint: H comes back from optimizer.pt, in fp32.
    shutil.copytree(tmp_path / "a" / "checkpoint-3", tmp_path / "b" / "checkpoint-3")
    second = ZOTrainer(model=tiny_causal_lm("opt", seed=5), args=_args(tmp_path / "b"), train_dataset=data)
    second.train(resume_from_checkpoint=str(tmp_path / "b" / "checkpoint-3"))
    resumed = _trainable(second.model)
    for name, value in trained.items():
        assert torch.equal(resumed[name], value), name

    # The trajectory records every estimate's curvature, so replay rebuilds H and the weights bitwise.
    trajectory = ZOTrajectory.load(tmp_path / "a" / TRAJECTORY_NAME)
    assert trajectory.format_version == 3
    steps = list(trajectory.steps())
    assert all(step.curvatures is not None and len(step.curvatures) == 4 for step in steps)
    assert all(c > 0 for step in steps for c in step.curvatures)
    replay(base, trajectory)
    replayed = _trainable(base)
    for name, value in trained.items():
        assert torch.equal(replayed[name], value), name


def test_trajectories_of_other_optimizers_stay_format_version_2():
    x = torch.nn.Parameter(torch.zeros(3))
    model = torch.nn.Module()
    model.x = x
    assert ZOTrajectory.start(model, ZOSGD([x], lr=0.1)).format_version == 2
    assert ZOTrajectory.start(model, HiZOO([x], lr=0.1)).header["format_version"] == 3


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(zo_hizoo_smooth=-0.1), "zo_hizoo_smooth must be in \\[0, 1\\), got -0.1"),
        (dict(zo_hizoo_smooth=1.0), "zo_hizoo_smooth must be in \\[0, 1\\), got 1.0"),
        (dict(zo_engine="dual"), "zo_optimizer='hizoo' needs three forwards .* use zo_engine='sequential'"),
        (dict(zo_engine="dual", zo_offload="cpu"), "zo_offload needs zo_optimizer='zo_sgd' \\(got 'hizoo'\\)"),
        (dict(zo_perturbation_parallel_size=2), "set zo_perturbation_parallel_size=1"),
        (dict(zo_noise="table"), "zo_optimizer='hizoo' .* cannot use zo_noise='table'"),
    ],
)
def test_bad_settings_fail_at_construction_naming_the_field(tmp_path, overrides, message):
    with pytest.raises(ValueError, match=message):
        ZOConfig(output_dir=str(tmp_path), zo_optimizer="hizoo", **overrides)


def test_bad_optimizer_arguments_fail_clearly():
    params = [torch.nn.Parameter(torch.zeros(3))]
    with pytest.raises(ValueError, match="hessian_smooth must be in \\[0, 1\\), got 1.5"):
        HiZOO(params, lr=0.1, hessian_smooth=1.5)
    with pytest.raises(ValueError, match="cannot use zo_noise='table'|Use zo_noise='gaussian' or 'rademacher'"):
        HiZOO(params, lr=0.1, noise="table")
    with pytest.raises(ValueError, match="use zo_engine='sequential'"):
        HiZOO(params, lr=0.1).attach_engine(object())


def test_state_dict_keeps_h_in_fp32_for_low_precision_weights():
    def make():
        weight = torch.nn.Parameter(torch.linspace(-1, 1, 6, dtype=torch.bfloat16))
        return weight, HiZOO([weight], lr=1e-2, eps=1e-2, hessian_smooth=0.1, seed=2)

    weight, optimizer = make()
    for _ in range(3):
        optimizer.step(lambda: (weight.float() ** 2).sum())
    state = optimizer.state_dict()
    clone_weight, clone = make()
    clone.load_state_dict(state)  # torch.optim would cast the state to bfloat16
    hessian = clone.state[clone_weight]["hessian"]
    assert hessian.dtype == torch.float32 and torch.equal(hessian, optimizer.state[weight]["hessian"])
    assert clone.noise.hessians[0].data_ptr() == hessian.data_ptr()  # the noise scales by the loaded H
