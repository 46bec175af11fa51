"""Counter-based noise (DESIGN invariant 1) and the fused sweeps."""

import pytest
import torch

from hf_zo.noise import NOISE_ALGORITHMS, NOISE_BLOCK_NUMEL, Noise, NoiseUpdate, perturb_, restore_and_update_


def _params(seed=0):
    generator = torch.Generator().manual_seed(seed)
    shapes = [(3 * NOISE_BLOCK_NUMEL + 17,), (300, 700), (5,), (1,)]
    return [(i, torch.randn(s, generator=generator)) for i, s in enumerate(shapes)]


@pytest.mark.parametrize("distribution", ["gaussian", "rademacher", "table"])
def test_noise_independent_of_chunk_size_and_order(distribution):
    reference = {i: t.clone() for i, t in _params()}
    perturb_(list(reference.items()), seed=7, scale=0.5, noise=Noise(distribution, chunk_numel=NOISE_BLOCK_NUMEL))

    shuffled = {i: t.clone() for i, t in _params()}
    order = [(i, shuffled[i]) for i in (2, 0, 3, 1)]
    perturb_(order, seed=7, scale=0.5, noise=Noise(distribution, chunk_numel=4 * NOISE_BLOCK_NUMEL, num_workers=2))

    alone = _params()[1][1].clone()
    perturb_([(1, alone)], seed=7, scale=0.5, noise=Noise(distribution, num_workers=1))

    for i in reference:
        assert torch.equal(reference[i], shuffled[i])
    assert torch.equal(reference[1], alone)


def test_noise_depends_on_seed_and_index():
    noise = Noise()
    a = noise.sample(1, 0, (1000,))
    assert not torch.equal(a, noise.sample(2, 0, (1000,)))
    assert not torch.equal(a, noise.sample(1, 1, (1000,)))
    assert torch.equal(a, noise.sample(1, 0, (1000,)))


def test_distributions_have_the_right_moments():
    noise = Noise("gaussian")
    z = noise.sample(3, 0, (400_000,))
    assert abs(z.mean().item()) < 0.01 and abs(z.std().item() - 1.0) < 0.01
    r = Noise("rademacher").sample(3, 0, (100_000,))
    assert set(r.unique().tolist()) == {-1.0, 1.0}
    assert abs(r.mean().item()) < 0.02
    t = Noise("table", table_numel=1 << 20).sample(3, 0, (400_000,))
    assert abs(t.mean().item()) < 0.02 and abs(t.std().item() - 1.0) < 0.02


def test_global_rng_untouched():
    state = torch.get_rng_state()
    perturb_(_params(), seed=5, scale=1.0, noise=Noise(num_workers=2))
    assert torch.equal(state, torch.get_rng_state())


def test_perturb_then_restore_returns_fp32_within_tolerance():
    params = _params()
    original = [t.clone() for _, t in params]
    noise = Noise()
    for seed in range(5):
        perturb_(params, seed, 1e-3, noise)
        perturb_(params, seed, -2e-3, noise)
        restore_and_update_(params, seed, eps=1e-3, lr=0.0, projected_grad=3.0, weight_decay=0.1, noise=noise)
    for (_, tensor), before in zip(params, original):
        torch.testing.assert_close(tensor, before, rtol=1e-6, atol=1e-6)


def test_restore_and_update_matches_the_mezo_formula():
    noise = Noise()
    ((index, p),) = [(0, torch.randn(1000, dtype=torch.float64))]
    theta = p.clone()
    z = noise.sample(11, index, p.shape).double()
    perturb_([(index, p)], 11, -1e-3, noise)  # parameters sit at theta - eps z after the second forward
    restore_and_update_([(index, p)], 11, eps=1e-3, lr=0.1, projected_grad=2.0, weight_decay=0.5, noise=noise)
    expected = (1 - 0.1 * 0.5) * theta - 0.1 * 2.0 * z
    torch.testing.assert_close(p, expected, rtol=1e-6, atol=1e-9)


def test_fused_and_separate_sweeps_are_bitwise_equal():
    noise = Noise()
    fused = _params()
    separate = _params()
    update = NoiseUpdate()
    update.add(1, 0.3)
    update.scale(0.9)
    update.add(2, -0.2)
    noise.apply_(fused, [update] * len(fused))
    first = NoiseUpdate()
    first.add(1, 0.3)
    first.scale(0.9)
    noise.apply_(separate, [first] * len(separate))
    noise.apply_(separate, [NoiseUpdate(terms={2: -0.2})] * len(separate))
    for (_, a), (_, b) in zip(fused, separate):
        assert torch.equal(a, b)


def test_non_contiguous_and_low_precision_tensors():
    noise = Noise()
    base = torch.randn(64, 48)
    transposed = base.t()
    expected = base.t().contiguous()
    perturb_([(0, transposed)], 3, 0.1, noise)
    perturb_([(0, expected)], 3, 0.1, noise)
    assert torch.equal(transposed, expected)
    half = torch.zeros(100, dtype=torch.bfloat16)
    perturb_([(0, half)], 3, 1.0, noise)
    torch.testing.assert_close(half.float(), noise.sample(3, 0, (100,)), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("algorithm", NOISE_ALGORITHMS)
def test_any_element_range_has_the_noise_of_the_whole_tensor(algorithm):
    # An FSDP2 shard starts anywhere in its parameter (inside a block of the "torch" algorithm too).
    noise = Noise(algorithm=algorithm, chunk_numel=NOISE_BLOCK_NUMEL)
    whole = noise.sample(5, 2, (3 * NOISE_BLOCK_NUMEL,))
    for start, numel in [(3, 10), (NOISE_BLOCK_NUMEL - 7, 20), (NOISE_BLOCK_NUMEL + 1, 2 * NOISE_BLOCK_NUMEL - 1)]:
        part = noise.fill_(torch.empty(numel), 5, 2, start, total=whole.numel())
        assert torch.equal(part, whole[start : start + numel])


def test_invalid_arguments_are_rejected():
    with pytest.raises(ValueError, match="Unknown noise distribution 'uniform'"):
        Noise("uniform")
    with pytest.raises(ValueError, match="chunk_numel must be >= 1"):
        Noise(chunk_numel=0)
    with pytest.raises(ValueError, match="multiple of"):
        Noise(algorithm="torch").fill_(torch.empty(10), 0, 0, start=3)
    with pytest.raises(ValueError, match="must lie within the parameter's 12 elements"):
        Noise(algorithm="torch").fill_(torch.empty(10), 0, 0, start=3, total=12)
    with pytest.raises(ValueError, match="Unknown noise algorithm 'mt19937'"):
        Noise(algorithm="mt19937")
