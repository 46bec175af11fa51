"""ZO optimizers in a plain PyTorch loop: convergence, schedulers, state_dict round trips."""

import pytest
import torch

from hf_zo.noise import Noise
from hf_zo.optim import ZO_OPTIMIZERS, ZOSGD

from tiny_models import OPTIMIZER_HYPERPARAMETERS


def _problem(seed=0):
    generator = torch.Generator().manual_seed(seed)
    target = torch.randn(8, generator=generator)
    weight = torch.nn.Parameter(torch.zeros(8))
    bias = torch.nn.Parameter(torch.zeros(3))
    return weight, bias, lambda: ((weight - target) ** 2).sum() + (bias**2).sum()


@pytest.mark.parametrize("name", sorted(ZO_OPTIMIZERS))
def test_plain_loop_decreases_the_loss(name):
    weight, bias, loss = _problem()
    optimizer = ZO_OPTIMIZERS[name]([weight, bias], eps=1e-3, seed=1, **OPTIMIZER_HYPERPARAMETERS[name])
    start = loss().item()
    for _ in range(300):
        optimizer.step(loss)
    optimizer.flush()
    assert loss().item() < 0.3 * start


@pytest.mark.parametrize("name", sorted(ZO_OPTIMIZERS))
def test_state_dict_round_trip_resumes_bitwise(name):
    def run(split):
        weight, bias, loss = _problem()
        optimizer = ZO_OPTIMIZERS[name](
            [weight, bias], eps=1e-3, seed=3, num_perturbations=2, **OPTIMIZER_HYPERPARAMETERS[name]
        )
        for step in range(12):
            if step == split:
                optimizer.flush()
                state = optimizer.state_dict()
                saved = (weight.detach().clone(), bias.detach().clone())
                weight, bias, loss = _problem()
                with torch.no_grad():
                    weight.copy_(saved[0])
                    bias.copy_(saved[1])
                optimizer = ZO_OPTIMIZERS[name](
                    [weight, bias], eps=1e-3, seed=99, num_perturbations=2, **OPTIMIZER_HYPERPARAMETERS[name]
                )
                optimizer.load_state_dict(state)
            optimizer.step(loss)
        optimizer.flush()
        return weight.detach(), bias.detach()

    uninterrupted = run(split=-1)
    resumed = run(split=5)
    assert torch.equal(uninterrupted[0], resumed[0]) and torch.equal(uninterrupted[1], resumed[1])


def test_lr_scheduler_drives_the_update():
    weight, _, loss = _problem()
    optimizer = ZOSGD([weight], lr=0.1, eps=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 if step == 0 else 0.0)
    before = weight.detach().clone()
    optimizer.step(loss)
    optimizer.flush()
    assert not torch.equal(before, weight)  # first step uses lr=0.1
    scheduler.step()
    assert optimizer.param_groups[0]["lr"] == 0.0
    after_first = weight.detach().clone()
    optimizer.step(loss)
    optimizer.flush()
    torch.testing.assert_close(weight.detach(), after_first, rtol=1e-6, atol=1e-6)


def test_weight_decay_applies_per_group_only():
    decayed = torch.nn.Parameter(torch.ones(4))
    exempt = torch.nn.Parameter(torch.ones(4))
    optimizer = ZOSGD(
        [{"params": [decayed], "weight_decay": 0.5}, {"params": [exempt], "weight_decay": 0.0}], lr=0.1, eps=1e-3
    )
    optimizer.step(lambda: torch.tensor(1.0))  # constant loss: projected gradient 0, only decay acts
    optimizer.flush()
    torch.testing.assert_close(decayed.detach(), torch.full((4,), 0.95), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(exempt.detach(), torch.ones(4), rtol=1e-6, atol=1e-6)


def test_step_returns_mean_perturbed_loss_and_accumulates_records():
    weight, _, loss = _problem()
    optimizer = ZOSGD([weight], lr=0.01, eps=1e-3, num_perturbations=3)
    first = optimizer.estimate(loss)
    second = optimizer.estimate(loss)
    assert len(first) == len(second) == 3 and len(optimizer.records) == 6
    assert len({r.seed for r in first + second}) == 6
    value = optimizer.step()
    assert value == pytest.approx(sum(r.loss for r in first + second) / 6)
    assert optimizer.records == [] and optimizer.zo_step == 1


def test_consecutive_non_finite_losses_stop_training():
    weight, _, _ = _problem()
    optimizer = ZOSGD([weight], lr=0.01, max_consecutive_skips=3)
    for _ in range(2):
        optimizer.step(lambda: torch.tensor(float("nan")))
    with pytest.raises(FloatingPointError, match="3 consecutive ZO estimates had a non-finite loss"):
        optimizer.step(lambda: torch.tensor(float("nan")))


def test_load_state_dict_rejects_other_optimizers():
    weight, _, loss = _problem()
    adam = ZO_OPTIMIZERS["zo_adam"]([weight], lr=0.01)
    adam.step(loss)
    with pytest.raises(ValueError, match="written by ZOAdam but this run uses ZOSGD"):
        ZOSGD([weight], lr=0.01).load_state_dict(adam.state_dict())
    with pytest.raises(ValueError, match="not saved by a ZO optimizer"):
        ZOSGD([weight], lr=0.01).load_state_dict(torch.optim.SGD([weight], lr=0.1).state_dict())


def test_resume_keeps_the_noise_algorithm_of_the_checkpoint():
    """A checkpoint written before 'philox' existed (no algorithm recorded) resumes with its 'torch' noise; an explicit
    other algorithm is refused instead of silently changing the noise."""

    def run(split, algorithm="auto"):
        weight, bias, loss = _problem()
        optimizer = ZOSGD([weight, bias], lr=0.02, seed=3, noise=Noise(algorithm="torch"))
        for step in range(8):
            if step == split:
                optimizer.flush()
                state = optimizer.state_dict()
                del state["zo"]["noise_algorithm"]  # as hf_zo wrote it before 'philox' existed
                optimizer = ZOSGD([weight, bias], lr=0.02, seed=3, noise=Noise(algorithm=algorithm))
                optimizer.load_state_dict(state)
                assert optimizer.noise.algorithm == "torch"
            optimizer.step(loss)
        optimizer.flush()
        return torch.cat([weight.detach(), bias.detach()])

    assert torch.equal(run(split=-1), run(split=4))
    with pytest.raises(ValueError, match="generated by the 'torch' algorithm but this run asks for .*'philox'"):
        run(split=4, algorithm="philox")


@pytest.mark.parametrize("name", ["zo_sgd", "zo_adam", "hizoo"])
def test_noise_cache_is_bitwise_equal_to_regeneration(name):
    results = []
    for cache in (False, True):
        weight, bias, loss = _problem()
        optimizer = ZO_OPTIMIZERS[name](
            [weight, bias], eps=1e-3, num_perturbations=2, cache_noise=cache, **OPTIMIZER_HYPERPARAMETERS[name]
        )
        for _ in range(6):
            optimizer.step(loss)
        optimizer.flush()
        assert bool(optimizer.noise.cache_numel) == cache
        results.append(torch.cat([weight.detach(), bias.detach()]))
    assert torch.equal(*results)


@pytest.mark.parametrize("name", sorted(ZO_OPTIMIZERS))
def test_frozen_parameters_are_left_alone_and_numbered_out(name):
    """`model.parameters()` with frozen tensors among them trains what filtering them out first trains."""

    def run(pass_frozen):
        weight, bias, loss = _problem()
        frozen = [torch.nn.Parameter(torch.ones(5), requires_grad=False) for _ in range(2)]
        params = [frozen[0], weight, frozen[1], bias] if pass_frozen else [weight, bias]
        optimizer = ZO_OPTIMIZERS[name](params, eps=1e-3, seed=1, **OPTIMIZER_HYPERPARAMETERS[name])
        for _ in range(5):
            optimizer.step(lambda: loss() + frozen[0].sum() + frozen[1].sum())
        optimizer.flush()
        assert all(torch.equal(f, torch.ones(5)) for f in frozen)
        return weight.detach(), bias.detach()

    with_frozen, filtered = run(pass_frozen=True), run(pass_frozen=False)
    assert all(torch.equal(a, b) for a, b in zip(with_frozen, filtered))


def test_saving_with_a_pending_update_is_refused():
    weight, bias, loss = _problem()
    optimizer = ZOSGD([weight, bias], lr=0.02, eps=1e-3)
    optimizer.step(loss)
    assert optimizer.params.has_pending()  # a fused update waits for the next forward's perturbation
    with pytest.raises(RuntimeError, match="while an update is pending.*Call flush\\(\\) first"):
        optimizer.state_dict()
    optimizer.flush()
    assert optimizer.state_dict()["zo"]["step"] == 1


def test_a_step_with_nothing_to_apply_warns_once_and_a_model_output_is_named(caplog):
    from transformers.modeling_outputs import SequenceClassifierOutput

    weight, bias, loss = _problem()
    optimizer = ZOSGD([weight, bias], lr=0.02, eps=1e-3)
    with caplog.at_level("WARNING"):
        optimizer.step()
        optimizer.step()
    assert caplog.text.count("was called without a closure and with no estimate since the last step") == 1
    with pytest.raises(TypeError, match="got SequenceClassifierOutput \\(a model output: return its .loss\\)"):
        optimizer.step(lambda: SequenceClassifierOutput(loss=loss(), logits=weight))


def test_adding_a_group_under_an_update_hook_is_refused_before_any_step():
    weight, bias, loss = _problem()
    optimizer = ZOSGD([weight], lr=0.02, eps=1e-3)
    handle = optimizer.register_update_hook(lambda *args: None)
    with pytest.raises(RuntimeError, match="while an update hook .* is attached"):
        optimizer.add_param_group({"params": [bias]})
    handle.remove()
    optimizer.add_param_group({"params": [bias]})
    optimizer.step(loss)
    optimizer.flush()
    assert optimizer.zo_step == 1 and not torch.equal(bias, torch.zeros(3))


def test_an_optimizer_registers_and_describes_itself():
    """A new optimizer is one class: its name puts it in ZO_OPTIMIZERS, and its declarations are what the config
    checks, the trainer (`config_kwargs`), the parallel layouts and trajectories read."""
    from hf_zo.optim import ZOOptimizer

    class HalfStepSGD(ZOSGD, name="half_step_sgd"):
        supports_offload = False
        supports_data_parallel = False
        limitations = {"data_parallel": "half_step_sgd is a test optimizer"}

        @classmethod
        def config_kwargs(cls, args) -> dict:
            return {}

    try:
        assert ZO_OPTIMIZERS["half_step_sgd"] is HalfStepSGD and HalfStepSGD.stateless
        with pytest.raises(ValueError, match="zo_offload needs zo_optimizer='zo_sgd' \\(got 'half_step_sgd'\\)"):
            HalfStepSGD.check_execution(engine="dual", offload=True)
        with pytest.raises(ValueError, match="half_step_sgd is a test optimizer: .* replicas \\(dp=2\\) would"):
            HalfStepSGD.check_execution(dp_size=2)
        with pytest.raises(ValueError, match="'zo_sgd' is taken by ZOSGD"):
            type("Again", (ZOOptimizer,), {}, name="zo_sgd")
    finally:
        del ZO_OPTIMIZERS["half_step_sgd"]
    assert list(ZO_OPTIMIZERS)[:4] == ["zo_sgd", "zo_sgd_momentum", "zo_sgd_sign", "zo_sgd_cons"]
