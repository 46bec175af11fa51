"""A forward that raises (Ctrl-C, CUDA out of memory, any error) on perturbed weights leaves them unperturbed."""

import math

import pytest
import torch

from hf_zo import ZOTrainer
from hf_zo.estimator import LazyParameters, SPSAEstimator
from hf_zo.noise import Noise
from hf_zo.optim import ZO_OPTIMIZERS, ZOSGD

from tiny_models import OPTIMIZER_HYPERPARAMETERS, lm_dataset, tiny_causal_lm, zo_args

FORWARDS_PER_STEP = {"hizoo": 3, "zo_sgd_cons": 5, "fzoo": 5}  # theta first; conservative: + three candidates; fzoo:
# theta and its four one-sided forwards
CASES = [(name, k) for name in sorted(ZO_OPTIMIZERS) for k in range(1, FORWARDS_PER_STEP.get(name, 2) + 1)]


def _failing_on(call: int, closure, error: BaseException):
    """`closure`, except that its `call`-th call (counted from 1) raises `error`."""
    calls = [0]

    def wrapped(*args, **kwargs):
        calls[0] += 1
        if calls[0] == call:
            raise error
        return closure(*args, **kwargs)

    return wrapped


def _problem():
    generator = torch.Generator().manual_seed(0)
    target = torch.randn(8, generator=generator)
    weight = torch.nn.Parameter(torch.randn(8, generator=generator))
    bias = torch.nn.Parameter(torch.zeros(3))
    return weight, bias, lambda: ((weight - target) ** 2).sum() + (bias**2).sum()


@pytest.mark.parametrize("name, failing_forward", CASES, ids=[f"{n}-forward{k}" for n, k in CASES])
def test_a_failed_step_leaves_the_weights_where_they_were_and_training_goes_on(name, failing_forward):
    def make():
        weight, bias, loss = _problem()
        return (
            weight,
            bias,
            loss,
            ZO_OPTIMIZERS[name]([weight, bias], eps=1e-3, seed=1, **OPTIMIZER_HYPERPARAMETERS[name]),
        )

    # Reference: one step, whose update (and restore) is still pending when the next step starts.
    weight, bias, loss, optimizer = make()
    optimizer.step(loss)
    optimizer.flush()
    expected = [weight.detach().clone(), bias.detach().clone()]

    weight, bias, loss, optimizer = make()
    optimizer.step(loss)
    with pytest.raises(KeyboardInterrupt):
        optimizer.step(_failing_on(failing_forward, loss, KeyboardInterrupt()))
    optimizer.flush()
    # The tolerance of the other restore tests: a perturbation and its undo round like the normal restore.
    torch.testing.assert_close(weight.detach(), expected[0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(bias.detach(), expected[1], rtol=1e-6, atol=1e-6)

    start = loss().item()
    for _ in range(300):
        optimizer.step(loss)
    optimizer.flush()
    assert loss().item() < 0.3 * start


@pytest.mark.parametrize("failing_forward", [1, 2])
def test_an_out_of_memory_error_in_an_estimate_restores_the_weights(failing_forward):
    weight = torch.nn.Parameter(torch.randn(6))
    before = weight.detach().clone()
    optimizer = ZOSGD([weight], lr=1e-3, eps=1e-3)
    closure = _failing_on(failing_forward, lambda: (weight**2).sum(), torch.OutOfMemoryError("CUDA out of memory"))
    with pytest.raises(torch.OutOfMemoryError):
        optimizer.estimate(closure)
    assert optimizer.records == []
    optimizer.flush()
    torch.testing.assert_close(weight.detach(), before, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("failing_forward", [1, 2])
def test_exact_restore_undoes_a_failed_estimate_bit_for_bit(failing_forward):
    weight = torch.randn(4096).to(torch.bfloat16)
    before = weight.clone()
    params = LazyParameters([(0, weight)], Noise())
    estimator = SPSAEstimator(params, eps=1e-2, exact_restore=True)
    with pytest.raises(RuntimeError, match="boom"):
        estimator.estimate(_failing_on(failing_forward, lambda: weight.float().sum(), RuntimeError("boom")), seed=3)
    params.flush()
    assert torch.equal(weight, before)


def test_the_sweeps_of_an_estimate_do_not_depend_on_which_forwards_run():
    """A rank that runs none of an estimate's forwards (`signs=()`) moves its replica as the one that runs both."""
    both = torch.randn(1000)
    neither = both.clone()
    estimators = [SPSAEstimator(LazyParameters([(0, t)], Noise()), eps=1e-3) for t in (both, neither)]
    assert all(math.isfinite(loss) for loss in estimators[0].signed_forwards(lambda: both.sum(), seed=5))
    assert all(math.isnan(loss) for loss in estimators[1].signed_forwards(None, seed=5, signs=()))
    for estimator in estimators:
        estimator.params.flush()
    assert torch.equal(both, neither)


@pytest.mark.parametrize("failing_forward", [3, 4])  # the + and the - forward of the second step
def test_ctrl_c_during_training_leaves_the_model_unperturbed(tmp_path, failing_forward):
    model = tiny_causal_lm()
    trainer = ZOTrainer(
        model=model, args=zo_args(tmp_path, max_steps=3, learning_rate=0.0), train_dataset=lm_dataset()
    )
    before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    forward = model.forward
    model.forward = _failing_on(failing_forward, forward, KeyboardInterrupt())
    with pytest.raises(KeyboardInterrupt):
        trainer.train()
    model.forward = forward
    for name, tensor in model.state_dict().items():
        torch.testing.assert_close(tensor, before[name], rtol=1e-6, atol=1e-6, msg=name)
    trainer.train()  # and training can start again
    for name, tensor in model.state_dict().items():
        torch.testing.assert_close(tensor, before[name], rtol=1e-6, atol=1e-6, msg=name)
