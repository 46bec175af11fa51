"""The estimation strategy of the DP/PertP layouts (`ParallelEstimation`) without an engine, in one process: it moves
the weights exactly as a single process does (exact restore in bf16 included) and puts them back when a forward
raises. The multi-process layouts themselves are tested in test_distributed.py."""

import pytest
import torch

from hf_zo.optim import FZOO, ZOSGD, ZOExecution
from hf_zo.parallel import ParallelEstimation, ScalarCollectives, ZOMesh

from tiny_models import VOCAB, tiny_causal_lm


def _batch():
    ids = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(1))
    return {"input_ids": ids, "labels": ids}


def _optimizer(model, parallel: bool, **kwargs) -> ZOSGD:
    # The layout every multi-process run gets; on a 1 x 1 mesh it makes the same sweeps.
    layout = ParallelEstimation(ZOMesh(), ScalarCollectives()) if parallel else None
    return ZOSGD(model.parameters(), eps=1e-2, seed=3, execution=ZOExecution(parallel=layout), **kwargs)


def _failing_on(call: int, closure, error: BaseException):
    """`closure`, except that its `call`-th call (counted from 1) raises `error`."""
    calls = [0]

    def wrapped():
        calls[0] += 1
        if calls[0] == call:
            raise error
        return closure()

    return wrapped


def test_bf16_weights_do_not_drift_at_lr_0():
    """Invariant 6 in bf16: the parallel path honours the exact restore that a single process uses by default for a
    small bf16 trainable set, so five steps at lr = 0 leave every weight bit as it was."""
    model = tiny_causal_lm().to(torch.bfloat16).eval()
    start = {name: p.detach().clone() for name, p in model.named_parameters()}
    batch = _batch()
    optimizer = _optimizer(model, parallel=True, lr=0.0)
    assert optimizer.estimator.exact_restore  # the default for <= 4M bf16 elements
    for _ in range(5):
        optimizer.step(lambda: model(**batch).loss)
    optimizer.flush()
    changed = {name: int((p != start[name]).sum()) for name, p in model.named_parameters()}
    assert sum(changed.values()) == 0, {name: n for name, n in changed.items() if n}


@pytest.mark.parametrize("dtype, exact_restore", [(torch.bfloat16, None), (torch.float32, False)])
def test_same_weights_as_a_single_process(dtype, exact_restore):
    """With a learning rate, the 1 x 1 layout's weights equal the single process's bit for bit after three steps."""

    def build(parallel: bool):
        model = tiny_causal_lm().to(dtype).eval()
        return model, _optimizer(model, parallel, lr=1e-2, exact_restore=exact_restore)

    _assert_layout_trains_as_one_process(build)


def _assert_layout_trains_as_one_process(build) -> None:
    """Three steps with `build(parallel)`'s model and optimizer, with and without the 1 x 1 layout: same bits."""
    batch = _batch()

    def trained(parallel: bool) -> list[torch.Tensor]:
        model, optimizer = build(parallel)
        for _ in range(3):
            optimizer.step(lambda: model(**batch).loss)
        optimizer.flush()
        return [p.detach() for p in model.parameters()]

    for single, layout in zip(trained(parallel=False), trained(parallel=True), strict=True):
        assert torch.equal(single, layout)


@pytest.mark.parametrize("failing_forward", [1, 2, 3, 4])  # + and - of the 1st estimate, + and - of the 2nd
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_failing_forward_leaves_the_weights_where_they_were(dtype, failing_forward):
    """A closure that raises (here Ctrl-C) on perturbed weights: the error propagates, and the weights are back
    where the estimate found them (bit for bit with the exact restore of bf16, to rounding in fp32)."""
    model = tiny_causal_lm().to(dtype).eval()
    batch = _batch()
    optimizer = _optimizer(model, parallel=True, lr=1e-2, num_perturbations=2)
    optimizer.step(lambda: model(**batch).loss)  # an update still pending when the failing estimate starts
    optimizer.flush()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(KeyboardInterrupt):
        optimizer.estimate(_failing_on(failing_forward, lambda: model(**batch).loss, KeyboardInterrupt()))
    assert optimizer.records == []
    optimizer.flush()
    for p, saved in zip(model.parameters(), before, strict=True):
        if dtype == torch.bfloat16:
            assert torch.equal(p.detach(), saved)
        else:
            torch.testing.assert_close(p.detach(), saved, rtol=1e-6, atol=1e-6)


def test_fzoo_through_the_layout_equals_a_single_process():
    """FZOO's one-sided estimates go through the same slot as the two-point ones: on a 1 x 1 mesh the layout's
    sweeps (the centre forward, one sweep per estimate) and records are those of one process, bit for bit."""

    def build(parallel: bool):
        model = tiny_causal_lm().eval()
        layout = ParallelEstimation(ZOMesh(), ScalarCollectives()) if parallel else None
        return model, FZOO(model.parameters(), lr=1e-5, eps=1e-2, seed=3, execution=ZOExecution(parallel=layout))

    _assert_layout_trains_as_one_process(build)


def test_fzoo_refuses_perturbation_parallelism_and_the_dual_engine_but_not_data_parallelism():
    params = [torch.nn.Parameter(torch.zeros(3))]
    with pytest.raises(ValueError, match="zo_optimizer='fzoo' runs one-sided .* set zo_perturbation_parallel_size=1"):
        ParallelEstimation(ZOMesh(dp_size=1, pertp_size=2), collectives=None).check(FZOO(params, lr=0.1))
    ParallelEstimation(ZOMesh(dp_size=2, pertp_size=1), collectives=None).check(FZOO(params, lr=0.1))
    with pytest.raises(ValueError, match="zo_optimizer='fzoo' runs one-sided .* use zo_engine='sequential'"):
        FZOO(params, lr=0.1).attach_engine(object())
