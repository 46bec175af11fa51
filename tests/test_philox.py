"""The 'philox' noise algorithm: the standard generator, the compiled kernel against its torch reference, the
distribution, independence from chunking and threads, the fused sweep, and the fallback when the kernel is missing."""

import logging
import math
import os
import subprocess
import sys

import pytest
import torch

from hf_zo.noise import Noise, NoiseUpdate, perturb_
from hf_zo.philox import extension, load_kernel, philox4x32_10, philox_noise


@pytest.fixture(scope="module")
def kernel():
    # `make install` builds the kernel, so its absence is a defect to see, not a reason to skip; the fallback without
    # a compiler has its own tests (`no_kernel`).
    compiled = load_kernel()
    if compiled is None:
        pytest.fail(
            f"the compiled noise kernel is unavailable: {extension.kernel_error()}; build it with "
            "`python -m hf_zo.philox --build` (run by `make install`)."
        )
    return compiled


@pytest.fixture
def no_kernel(monkeypatch):
    """Simulate a machine where the kernel cannot be built (no compiler)."""

    def failing_build(verbose):
        raise RuntimeError("Error building extension 'hf_zo_philox_v1': c++: command not found")

    monkeypatch.setattr(extension, "_build", failing_build)
    monkeypatch.setattr(extension, "_kernel", None)
    monkeypatch.setattr(extension, "_error", None)
    monkeypatch.setattr("hf_zo.noise._warned", set())


def _params(seed=0):
    generator = torch.Generator().manual_seed(seed)
    shapes = [(70_001,), (300, 700), (5,), (1,), (2048,)]
    return [(i, torch.randn(s, generator=generator)) for i, s in enumerate(shapes)]


@pytest.mark.parametrize(
    "counter, key, expected",
    [  # Random123's known-answer tests for philox4x32_10 (kat_vectors)
        ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
        ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
        (
            (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344),
            (0xA4093822, 0x299F31D0),
            (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1),
        ),
    ],
)
def test_philox_is_the_standard_philox4x32_10(counter, key, expected):
    words = philox4x32_10(tuple(torch.tensor([c]) for c in counter), key)
    assert tuple(int(w) for w in words) == expected


@pytest.mark.parametrize("gaussian", [True, False])
@pytest.mark.parametrize(
    "seed, index, start, numel",
    [
        (123, 4, 0, 5000),
        (2**63 - 5, 7, 1000, 3001),
        (99, 2**40 + 3, 2**33 + 17, 4099),
        (5, 1, 2**34 - 1000, 3000),  # the block counter carries into its high word
    ],
)
def test_compiled_kernel_is_bitwise_the_torch_reference(kernel, gaussian, seed, index, start, numel):
    out = torch.empty(numel)
    kernel.fill(out, seed, index, start, gaussian)
    assert torch.equal(out, philox_noise(seed, index, start, numel, gaussian))


SIMD_LEVELS = ("portable", "avx2", "avx512")


def _run_kernel_in_child(kernel, script: str, simd: str, *args: str) -> subprocess.CompletedProcess:
    """Run `script` in a child process that loads the very library this process uses (importing only torch, not
    hf_zo and transformers) as `kernel`, with ``HF_ZO_PHILOX_SIMD=simd``."""
    loader = (
        "import importlib.util, sys, torch\n"
        "spec = importlib.util.spec_from_file_location(sys.argv[1], sys.argv[2])\n"
        "kernel = importlib.util.module_from_spec(spec)\n"
        "spec.loader.exec_module(kernel)\n"
    )
    env = {**os.environ, "HF_ZO_PHILOX_SIMD": simd}
    command = [sys.executable, "-c", loader + script, kernel.__name__, kernel.__file__, *args]
    return subprocess.run(command, env=env, capture_output=True, text=True)


def test_every_simd_level_gives_the_same_bits(kernel, tmp_path):
    """Each narrower code this CPU can run (the portable loops for CPUs without AVX2, AVX2 on an AVX-512 CPU), in a
    process with HF_ZO_PHILOX_SIMD set, against the torch reference and, for a fused sweep, against this process's
    widest code (which the other tests check against the reference)."""
    native = kernel.simd()
    narrower = SIMD_LEVELS[: SIMD_LEVELS.index(native)]
    cases = [(123, 4, 0, 5000), (2**63 - 5, 7, 1000, 3001), (99, 2**40 + 3, 2**33 + 17, 4099)]
    script = (
        "level = kernel.simd()\n"
        "outs = []\n"
        f"for seed, index, start, numel in {cases!r}:\n"
        "    for gaussian in (True, False):\n"
        "        out = torch.empty(numel)\n"
        "        kernel.fill(out, seed, index, start, gaussian)\n"
        "        outs.append(out)\n"
        "x = torch.linspace(-1, 1, 70_001)\n"
        "kernel.apply([x], [3], [0.5], [[11, 12]], [[0.25, -2.0]], True)\n"
        "outs.append(x)\n"
        "torch.save((level, outs), sys.argv[3])\n"
    )
    expected = [philox_noise(*case, gaussian) for case in cases for gaussian in (True, False)]
    x = torch.linspace(-1, 1, 70_001)
    kernel.apply([x], [3], [0.5], [[11, 12]], [[0.25, -2.0]], True)
    assert "portable" in narrower or native == "portable"
    for simd in narrower:
        saved = tmp_path / f"{simd}.pt"
        child = _run_kernel_in_child(kernel, script, simd, str(saved))
        assert child.returncode == 0, child.stderr
        level, outs = torch.load(saved)
        assert level == simd
        for got, want in zip(outs, expected + [x], strict=True):
            assert torch.equal(got, want)


def test_unknown_simd_level_is_a_clear_error(kernel):
    child = _run_kernel_in_child(kernel, "kernel.simd()\n", "sse9")
    assert child.returncode != 0
    assert "HF_ZO_PHILOX_SIMD must be 'portable', 'avx2' or 'avx512', got 'sse9'" in child.stderr


def test_unknown_simd_level_in_a_sweep_is_a_python_error(kernel):
    """A fused sweep (whose work the kernel splits over threads) with a bad HF_ZO_PHILOX_SIMD raises a RuntimeError
    that names the variable, instead of aborting the interpreter (std::terminate, exit status 134); on one thread
    and on two."""
    script = (
        "import sys, torch\n"
        "from hf_zo.noise import Noise, perturb_\n"
        "p = torch.zeros(1 << 20)\n"
        "for threads in (1, 2):\n"
        "    torch.set_num_threads(threads)\n"
        "    try:\n"
        "        perturb_([(0, p)], seed=1, scale=1.0, noise=Noise('gaussian', algorithm='philox'))\n"
        "    except RuntimeError as error:\n"
        "        print(threads, 'RuntimeError:', error)\n"
        "    else:\n"
        "        sys.exit(4)\n"
        "sys.exit(3)\n"
    )
    env = {**os.environ, "HF_ZO_PHILOX_SIMD": "avx3"}
    child = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True)
    assert child.returncode == 3, (child.returncode, child.stdout[-2000:], child.stderr[-2000:])
    for threads in (1, 2):
        expected = f"{threads} RuntimeError: HF_ZO_PHILOX_SIMD must be 'portable', 'avx2' or 'avx512', got 'avx3'"
        assert expected in child.stdout, child.stdout[-2000:]


def test_gaussian_moments_and_kolmogorov_smirnov():
    z = Noise("gaussian", algorithm="philox").sample(3, 0, (200_000,)).double()
    n = z.numel()
    assert abs(z.mean().item()) < 5 / math.sqrt(n)
    assert abs(z.var().item() - 1.0) < 5 * math.sqrt(2 / n)
    assert abs((z**4).mean().item() - 3.0) < 5 * math.sqrt(96 / n)
    assert abs((z**3).mean().item()) < 5 * math.sqrt(15 / n)
    ordered = z.sort().values
    cdf = torch.special.ndtr(ordered)
    steps = torch.arange(1, n + 1, dtype=torch.float64) / n
    ks = torch.maximum(steps - cdf, cdf - (steps - 1 / n)).max().item()
    assert ks < 1.63 / math.sqrt(n)  # the 1% critical value
    r = Noise("rademacher", algorithm="philox").sample(3, 0, (100_000,))
    assert set(r.unique().tolist()) == {-1.0, 1.0} and abs(r.mean().item()) < 0.02


@pytest.mark.parametrize("distribution", ["gaussian", "rademacher"])
def test_noise_independent_of_chunk_size_threads_and_order(distribution):
    expected = {
        i: t + 0.5 * philox_noise(7, i, 0, t.numel(), distribution == "gaussian").view_as(t) for i, t in _params()
    }
    threads = torch.get_num_threads()
    try:
        for num_threads, chunk_numel, order in [(1, 1 << 16, (0, 1, 2, 3, 4)), (2, 1 << 18, (4, 2, 0, 3, 1))]:
            torch.set_num_threads(num_threads)
            params = dict(_params())
            noise = Noise(distribution, chunk_numel=chunk_numel, num_workers=num_threads, algorithm="philox")
            perturb_([(i, params[i]) for i in order], seed=7, scale=0.5, noise=noise)
            for i, tensor in params.items():
                assert torch.equal(tensor, expected[i]), (num_threads, chunk_numel, i)
    finally:
        torch.set_num_threads(threads)


def test_fused_sweep_equals_chunked_sweep(kernel):
    """The kernel's in-place sweep (z never stored) gives the bits of generating z chunks and adding them."""
    update = NoiseUpdate()
    update.add(1, 0.3)
    update.scale(0.9)
    update.add(2, -0.2)
    fused, chunked = _params(), _params()
    Noise(algorithm="philox").apply_(fused, [update] * len(fused))
    Noise(algorithm="philox", cache_numel=1 << 20).apply_(chunked, [update] * len(chunked))  # cached: chunk path
    expected = []
    for index, tensor in _params():
        z1, z2 = (philox_noise(s, index, 0, tensor.numel()).view_as(tensor) for s in (1, 2))
        expected.append(((tensor * 0.9) + z1 * (0.3 * 0.9)) + z2 * -0.2)
    for (_, a), (_, b), c in zip(fused, chunked, expected):
        assert torch.equal(a, b) and torch.equal(a, c)


def test_without_the_kernel_auto_falls_back_to_torch_with_one_warning(no_kernel, caplog):
    with caplog.at_level(logging.WARNING, logger="hf_zo.noise"):
        first, second = Noise("gaussian"), Noise("gaussian")
    assert first.algorithm == second.algorithm == "torch"
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1
    assert "c++: command not found" in warnings[0] and "falls back to 'torch'" in warnings[0]
    assert "python -m hf_zo.philox --build" in warnings[0]


def test_without_the_kernel_philox_keeps_its_bits(no_kernel, caplog):
    with caplog.at_level(logging.WARNING, logger="hf_zo.noise"):
        noise = Noise("gaussian", algorithm="philox")
    assert noise.algorithm == "philox" and "same bits" in caplog.text
    params = _params()
    perturb_(params, seed=9, scale=0.1, noise=noise)
    for (index, tensor), (_, before) in zip(params, _params()):
        assert torch.equal(tensor, before + philox_noise(9, index, 0, before.numel()).view_as(before) * 0.1)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_philox_noise_is_the_same_on_cuda():
    for gaussian in (True, False):
        on_gpu = Noise("gaussian" if gaussian else "rademacher", algorithm="philox").sample(5, 3, (70_001,), "cuda")
        assert torch.equal(on_gpu.cpu(), philox_noise(5, 3, 0, 70_001, gaussian))
