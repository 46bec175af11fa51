"""Property tests (hypothesis): noise regeneration is exact, perturb/restore is tight, optimizer state round-trips."""

import io

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hf_zo.noise import NOISE_BLOCK_NUMEL, Noise, perturb_
from hf_zo.optim import ZO_OPTIMIZERS

shapes = st.lists(st.integers(1, 300), min_size=1, max_size=3).map(tuple)
seeds = st.integers(0, 2**62)
chunks = st.integers(1, 6).map(lambda k: k * NOISE_BLOCK_NUMEL)
distributions = st.sampled_from(["gaussian", "rademacher", "table"])
SETTINGS = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@SETTINGS
@given(shape=shapes, seed=seeds, index=st.integers(0, 10_000), chunk=chunks, distribution=distributions)
def test_noise_regenerates_exactly_whatever_the_chunking(shape, seed, index, chunk, distribution):
    reference = Noise(distribution, table_numel=1 << 18).sample(seed, index, shape)
    tensor = torch.zeros(shape)
    perturb_([(index, tensor)], seed, 1.0, Noise(distribution, chunk_numel=chunk, num_workers=2, table_numel=1 << 18))
    assert torch.equal(tensor, reference)


@SETTINGS
@given(
    shape=shapes,
    seed=seeds,
    eps=st.floats(1e-5, 1e-1),
    dtype=st.sampled_from([torch.float32, torch.float64]),
    scale=st.floats(1e-3, 1e2),
)
def test_perturb_then_restore_is_within_rounding(shape, seed, eps, dtype, scale):
    generator = torch.Generator().manual_seed(seed % 2**32)
    tensor = (torch.randn(shape, generator=generator) * scale).to(dtype)
    original = tensor.clone()
    noise = Noise()
    perturb_([(0, tensor)], seed, eps, noise)
    perturb_([(0, tensor)], seed, -2 * eps, noise)
    perturb_([(0, tensor)], seed, eps, noise)
    z = noise.sample(seed, 0, shape).to(dtype)
    bound = 4 * torch.finfo(dtype).eps * (original.abs() + 2 * eps * z.abs())
    assert bool(((tensor - original).abs() <= bound).all())


@SETTINGS
@given(name=st.sampled_from(sorted(ZO_OPTIMIZERS)), steps=st.integers(1, 4), seed=seeds, q=st.integers(1, 3))
def test_optimizer_state_dict_round_trips(name, steps, seed, q):
    def make():
        weight = torch.nn.Parameter(torch.linspace(-1, 1, 50))
        perturbations = max(q, 2) if name == "fzoo" else q  # FZOO's step needs the spread of two losses at least
        optimizer = ZO_OPTIMIZERS[name]([weight], lr=0.01, eps=1e-3, seed=seed, num_perturbations=perturbations)
        return weight, optimizer

    weight, optimizer = make()
    loss = lambda: (weight**2).sum()  # noqa: E731
    for _ in range(steps):
        optimizer.step(loss)
    optimizer.flush()
    buffer = io.BytesIO()
    torch.save(optimizer.state_dict(), buffer)  # as a checkpoint does: the reloaded state shares no tensor
    buffer.seek(0)
    state = torch.load(buffer, weights_only=True)

    clone_weight, clone = make()
    with torch.no_grad():
        clone_weight.copy_(weight)
    clone.load_state_dict(state)
    reloaded = clone.state_dict()
    assert reloaded["zo"] == state["zo"]
    assert reloaded["param_groups"] == state["param_groups"]
    for key, value in state["state"].items():
        for name_, tensor in value.items():
            assert torch.equal(torch.as_tensor(tensor), torch.as_tensor(reloaded["state"][key][name_]))

    optimizer.step(loss)
    clone.step(lambda: (clone_weight**2).sum())
    optimizer.flush()
    clone.flush()
    assert torch.equal(weight, clone_weight)
