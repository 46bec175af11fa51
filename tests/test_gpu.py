"""The CUDA paths: counter-based noise, exact bf16 restore, engines and offload tiers, and ZOTrainer on a GPU.

Every test here carries the `gpu` marker and is skipped without a CUDA device (`pytest -m gpu` runs them;
`benchmarks/gpu_check.sh` runs them on a lent GPU). They check on CUDA the invariants the rest of the suite checks
on the CPU.
"""

import pytest
import torch

from hf_zo import ZOConfig, ZOTrainer
from hf_zo.engine import DualEngine, offload_model
from hf_zo.noise import NOISE_BLOCK_NUMEL, Noise, perturb_
from hf_zo.optim import ZOSGD

from tiny_models import VOCAB, lm_dataset, tiny_causal_lm

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _cuda_params():
    generator = torch.Generator().manual_seed(0)
    shapes = [(3 * NOISE_BLOCK_NUMEL + 17,), (300, 700), (5,)]
    return [(i, torch.randn(s, generator=generator).cuda()) for i, s in enumerate(shapes)]


@pytest.mark.parametrize("distribution", ["gaussian", "rademacher", "table"])
def test_cuda_noise_depends_only_on_seed_and_index(distribution):
    """DESIGN invariant 1 on CUDA: z is the same whatever the chunk size, the order, the other parameters or the
    instance, and the global CPU and CUDA generators are left untouched."""
    cpu_state, cuda_state = torch.get_rng_state(), torch.cuda.get_rng_state()
    reference = dict(_cuda_params())
    perturb_(list(reference.items()), seed=7, scale=0.5, noise=Noise(distribution, chunk_numel=NOISE_BLOCK_NUMEL))

    shuffled = dict(_cuda_params())
    order = [(i, shuffled[i]) for i in (2, 0, 1)]
    perturb_(order, seed=7, scale=0.5, noise=Noise(distribution, chunk_numel=4 * NOISE_BLOCK_NUMEL))

    alone = _cuda_params()[1][1]
    perturb_([(1, alone)], seed=7, scale=0.5, noise=Noise(distribution))

    for i in reference:
        assert torch.equal(reference[i], shuffled[i]), i
    assert torch.equal(reference[1], alone)
    assert not torch.equal(reference[1], _cuda_params()[1][1])  # the noise was applied
    assert torch.equal(torch.get_rng_state(), cpu_state)
    assert torch.equal(torch.cuda.get_rng_state(), cuda_state)


def test_cuda_noise_has_the_right_moments():
    z = Noise("gaussian").sample(3, 0, (400_000,), device="cuda")
    assert z.device.type == "cuda"
    assert abs(z.mean().item()) < 0.01 and abs(z.std().item() - 1.0) < 0.01
    r = Noise("rademacher").sample(3, 0, (100_000,), device="cuda")
    assert set(r.unique().tolist()) == {-1.0, 1.0} and abs(r.mean().item()) < 0.02


def _closure(model):
    ids = torch.randint(2, VOCAB, (2, 8), generator=torch.Generator().manual_seed(0)).cuda()
    return lambda: model(input_ids=ids, labels=ids).loss


@pytest.mark.parametrize("engine", ["sequential", "dual"])
def test_cuda_exact_restore_in_bf16(engine):
    """With lr=0, restoring bf16 weights by subtraction drifts; exact restore brings them back bit for bit."""
    drift = {}
    for exact in (False, True):
        model = tiny_causal_lm("llama").to("cuda", torch.bfloat16)
        before = [p.detach().clone() for p in model.parameters()]
        if engine == "sequential":
            optimizer = ZOSGD(model.parameters(), lr=0.0, eps=1e-2, seed=1, exact_restore=exact)
        else:
            optimizer = ZOSGD(model.parameters(), lr=0.0, eps=1e-2, seed=1)
            optimizer.attach_engine(DualEngine(model, exact_restore=exact))
        for _ in range(3):
            optimizer.step(_closure(model))
        optimizer.flush()
        drift[exact] = max((p.float() - b.float()).abs().max().item() for p, b in zip(model.parameters(), before))
    assert drift[True] == 0.0
    assert 0.0 < drift[False] < 0.05, drift


def _train(model, engine, steps=3, offloader=None):
    """ZO-SGD with weight decay and two perturbations per step; returns the records and the flushed weights."""
    optimizer = ZOSGD(model.parameters(), lr=1e-3, eps=1e-2, weight_decay=0.1, seed=3, num_perturbations=2)
    if engine == "dual":
        optimizer.attach_engine(DualEngine(model, offloader=offloader))
    records = []
    for _ in range(steps):
        records += optimizer.estimate(_closure(model))
        optimizer.step()
    optimizer.flush()
    return records, [p.detach().cpu().clone() for p in model.parameters()]


@pytest.mark.parametrize("family", ["opt", "llama"])
def test_cuda_dual_matches_sequential(family):
    """DESIGN invariant 4 on CUDA, fp32. The kernels of a doubled batch may round differently from two single
    batches, so the check is a stated tolerance: losses within 1e-5 (relative), projected gradients within 1e-3
    (a loss difference d moves g by d / (2 eps)), final weights within 5% of how far training moved them."""
    initial = [p.detach().clone() for p in tiny_causal_lm(family).parameters()]
    sequential = _train(tiny_causal_lm(family).cuda(), "sequential")
    dual = _train(tiny_causal_lm(family).cuda(), "dual")
    assert [r.seed for r in dual[0]] == [r.seed for r in sequential[0]]
    for name in ("loss_plus", "loss_minus"):
        expected = torch.tensor([getattr(r, name) for r in sequential[0]])
        torch.testing.assert_close(torch.tensor([getattr(r, name) for r in dual[0]]), expected, rtol=1e-5, atol=0)
    grads = [torch.tensor([r.projected_grad for r in run[0]]) for run in (dual, sequential)]
    torch.testing.assert_close(*grads, rtol=0, atol=1e-3)
    for start, expected, got in zip(initial, sequential[1], dual[1]):
        moved = (expected - start).abs().max().item()
        assert (got - expected).abs().max().item() <= 0.05 * moved + 1e-7


@pytest.mark.parametrize("tier", ["cpu", "disk"])
def test_cuda_offload_tiers_match_resident_blocks(tmp_path, tier):
    """Blocks uploaded from pinned host memory or from memory-mapped files on a side stream give the resident dual
    engine's estimates and weights bit for bit: the same kernels run on the same values."""
    resident = _train(tiny_causal_lm("opt").cuda(), "dual")
    model = tiny_causal_lm("opt")
    offloader = offload_model(model, tier, directory=str(tmp_path), device="cuda", prefetch=1)
    model.cuda()  # offloaded blocks stay in storage; only the resident modules move
    offloaded = _train(model, "dual", offloader=offloader)
    assert offloaded[0] == resident[0]
    assert all(torch.equal(a, b) for a, b in zip(offloaded[1], resident[1]))


def test_zo_trainer_trains_in_bf16_on_cuda(tmp_path):
    """The Trainer path on a GPU: the model and every ZO update stay on CUDA, and the loss falls."""
    model = tiny_causal_lm("opt").to(torch.bfloat16)
    data = lm_dataset(16)
    args = ZOConfig(
        output_dir=str(tmp_path),
        max_steps=200,
        per_device_train_batch_size=4,
        learning_rate=3e-3,
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
    )
    trainer = ZOTrainer(model=model, args=args, train_dataset=data)
    start = trainer.evaluate(data)["eval_loss"]
    trainer.train()
    assert all(p.device.type == "cuda" and p.dtype == torch.bfloat16 for p in trainer.model.parameters())
    assert trainer.evaluate(data)["eval_loss"] < start - 0.3
