"""The two-point estimate: unbiased direction, correct directional derivative, non-finite handling."""

import math

import torch

from hf_zo.estimator import LazyParameters, SPSAEstimator
from hf_zo.noise import Noise, mix_seed

from tiny_models import tiny_causal_lm


def _quadratic(dim=16, seed=0):
    generator = torch.Generator().manual_seed(seed)
    a = torch.randn(dim, dim, generator=generator, dtype=torch.float64)
    a = a @ a.t() / dim + torch.eye(dim, dtype=torch.float64)
    b = torch.randn(dim, generator=generator, dtype=torch.float64)
    theta = torch.randn(dim, generator=generator, dtype=torch.float64)
    return a, b, theta


def test_projected_grad_is_the_directional_derivative_on_a_quadratic():
    a, b, theta = _quadratic()
    noise = Noise()
    params = LazyParameters([(0, theta)], noise)
    estimator = SPSAEstimator(params, eps=1e-4)
    record = estimator.estimate(lambda: 0.5 * theta @ a @ theta - b @ theta, seed=9)
    params.flush()
    grad = a @ theta - b
    z = noise.sample(9, 0, theta.shape).double()
    assert math.isclose(record.projected_grad, float(grad @ z), rel_tol=1e-6)


def test_mean_estimate_approaches_the_gradient_on_a_quadratic():
    a, b, theta = _quadratic()
    noise = Noise()
    params = LazyParameters([(0, theta)], noise)
    estimator = SPSAEstimator(params, eps=1e-3)
    total = torch.zeros_like(theta)
    for k in range(2000):
        seed = mix_seed(1, k)
        record = estimator.estimate(lambda: 0.5 * theta @ a @ theta - b @ theta, seed)
        total += record.projected_grad * noise.sample(seed, 0, theta.shape).double()
    params.flush()
    cosine = torch.nn.functional.cosine_similarity(total, a @ theta - b, dim=0)
    assert cosine > 0.9


def _tiny_model_loss():
    model = tiny_causal_lm("opt").double().eval()
    model.requires_grad_(False)
    trainable = [model.model.decoder.final_layer_norm.weight, model.model.decoder.final_layer_norm.bias]
    for p in trainable:
        p.requires_grad_(True)
    batch = torch.arange(2, 34).view(2, 16)

    def loss():  # computed here in float64 (the model's own loss function upcasts only to float32)
        logits = model(input_ids=batch).logits[:, :-1]
        return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))

    return model, trainable, loss


def test_tiny_model_projected_grad_matches_autograd_and_mean_direction():
    model, trainable, loss = _tiny_model_loss()
    grads = torch.autograd.grad(loss(), trainable)
    gradient = torch.cat([g.reshape(-1) for g in grads])
    noise = Noise()
    params = LazyParameters(list(enumerate(trainable)), noise)
    estimator = SPSAEstimator(params, eps=1e-5)
    total = torch.zeros_like(gradient)
    with torch.no_grad():
        for k in range(600):
            seed = mix_seed(2, k)
            record = estimator.estimate(loss, seed)
            z = torch.cat([noise.sample(seed, i, p.shape).double().reshape(-1) for i, p in enumerate(trainable)])
            if k == 0:
                assert math.isclose(record.projected_grad, float(gradient @ z), rel_tol=1e-4)
            total += record.projected_grad * z
        params.flush()
    assert torch.nn.functional.cosine_similarity(total, gradient, dim=0) > 0.9


def test_non_finite_loss_is_dropped_and_parameters_restored(caplog):
    theta = torch.randn(100)
    before = theta.clone()
    params = LazyParameters([(0, theta)], Noise())
    estimator = SPSAEstimator(params, eps=1e-3)
    losses = iter([1.0, float("nan")])
    with caplog.at_level("WARNING"):
        record = estimator.estimate(lambda: next(losses), seed=4)
    params.flush()
    assert record is None
    assert "Non-finite loss" in caplog.text
    torch.testing.assert_close(theta, before, rtol=1e-6, atol=1e-6)


def test_estimates_inside_one_autocast_region_read_the_moved_weights():
    """A loop that wraps several steps in one `torch.autocast` gets the estimates of a loop that leaves autocast's
    weight cache off: every forward reads the weights as the sweeps left them, not a cast cached before them."""
    from hf_zo.optim import ZOSGD

    batch = torch.arange(2, 18).view(2, 8)

    def records(cache_enabled):
        model = tiny_causal_lm("opt").eval()
        optimizer = ZOSGD(model.parameters(), lr=1e-2, eps=1e-2)
        seen = []
        optimizer.register_update_hook(lambda opt, step, seeds, records: seen.extend(records))
        with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=cache_enabled):
            for _ in range(3):
                optimizer.step(lambda: model(input_ids=batch, labels=batch).loss)
        return [(r.loss_plus, r.loss_minus) for r in seen]

    assert records(cache_enabled=True) == records(cache_enabled=False)
