"""The dual engine: blocks found from model metadata, and the same estimates and weights as the sequential engine."""

import threading

import pytest
import torch
from peft import LoraConfig, PrefixTuningConfig, PromptTuningConfig, TaskType, get_peft_model
from torch import nn

from hf_zo.engine import BlocksNotFoundError, DualEngine, find_blocks
from hf_zo.optim import ZOSGD, ZOAdam

from tiny_models import VOCAB, tiny_bert_classifier, tiny_causal_lm

FAMILIES = ["opt", "llama", "qwen2", "gpt2", "bert"]
BLOCK_CLASSES = {
    "opt": "OPTDecoderLayer",
    "llama": "LlamaDecoderLayer",
    "qwen2": "Qwen2DecoderLayer",
    "gpt2": "GPT2Block",
    "bert": "BertLayer",
}


def _model(family, seed=0):
    model = tiny_bert_classifier(seed=seed) if family == "bert" else tiny_causal_lm(family, seed=seed)
    return model.eval()


def _closure(model, family, seed=0):
    ids = torch.randint(2, VOCAB, (2, 8), generator=torch.Generator().manual_seed(seed))
    if family == "bert":
        return lambda: model(input_ids=ids, labels=torch.tensor([0, 1])).loss
    return lambda: model(input_ids=ids, labels=ids).loss


def _run(model, family, engine, optimizer_cls=ZOSGD, steps=3, **kwargs):
    """Train a few steps with `num_perturbations=2`; return the records and the flushed weights."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = optimizer_cls(trainable, lr=1e-2, eps=1e-3, weight_decay=0.1, seed=3, num_perturbations=2, **kwargs)
    if engine == "dual":
        optimizer.attach_engine(DualEngine(model))
    records = []
    for step in range(steps):
        records += optimizer.estimate(_closure(model, family, seed=step))
        optimizer.step()
    optimizer.flush()
    return records, {name: p.detach().clone() for name, p in model.named_parameters()}


def _assert_same(run_a, run_b):
    assert run_a[0] == run_b[0]  # seeds, projected gradients and both losses, bitwise
    assert run_a[1].keys() == run_b[1].keys()
    for name, value in run_a[1].items():
        assert torch.equal(value, run_b[1][name]), name


@pytest.mark.filterwarnings("ignore:fan_in_fan_out")
@pytest.mark.parametrize("family", FAMILIES)
def test_find_blocks_uses_no_split_modules(family):
    model = _model(family)
    blocks = find_blocks(model)
    assert [type(b).__name__ for b in blocks] == [BLOCK_CLASSES[family]] * 2
    lora = get_peft_model(model, LoraConfig(r=2, target_modules="all-linear"))
    assert [id(b) for b in find_blocks(lora)] == [id(b) for b in blocks]


def test_find_blocks_error_names_what_was_looked_for():
    class Stack(nn.Module):
        _no_split_modules = ["Layer"]

        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList([nn.Linear(2, 2), nn.Linear(2, 2)])

    with pytest.raises(BlocksNotFoundError, match=r"Could not find the repeated blocks of Stack: .*\['Layer'\]"):
        find_blocks(Stack())
    with pytest.raises(BlocksNotFoundError, match="zo_engine='sequential'"):
        find_blocks(nn.Linear(2, 2))
    plain = nn.Sequential(nn.Embedding(4, 2), nn.ModuleList([nn.Linear(2, 2) for _ in range(3)]))
    assert len(find_blocks(plain)) == 3  # no metadata: the repeated ModuleList


@pytest.mark.parametrize("family", FAMILIES)
def test_dual_matches_sequential_bitwise(family):
    """Full fine-tuning, weight decay, two perturbations per step; OPT and GPT-2 tie their embedding and LM head."""
    _assert_same(_run(_model(family), family, "sequential"), _run(_model(family), family, "dual"))


@pytest.mark.parametrize(
    "peft_config",
    [
        LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "fc1"]),
        PrefixTuningConfig(task_type=TaskType.CAUSAL_LM, num_virtual_tokens=3),
        PromptTuningConfig(task_type=TaskType.CAUSAL_LM, num_virtual_tokens=3),
    ],
    ids=["lora", "prefix", "prompt"],
)
def test_dual_matches_sequential_with_peft(peft_config):
    runs = [_run(get_peft_model(_model("opt"), peft_config), "opt", engine) for engine in ("sequential", "dual")]
    _assert_same(*runs)
    assert runs[0][0][-1].projected_grad != 0.0  # the adapter is perturbed and moves the loss


def test_dual_matches_sequential_with_lora_on_an_encoder():
    config = LoraConfig(r=4, target_modules=["query", "value"], modules_to_save=["classifier"])
    _assert_same(*[_run(get_peft_model(_model("bert"), config), "bert", engine) for engine in ("sequential", "dual")])


def test_blocks_that_do_not_run_get_the_sequential_sweeps():
    runs = []
    for engine in ("sequential", "dual"):
        model = _model("llama")
        model.config.num_hidden_layers = 1  # Llama runs layers[:num_hidden_layers]: block 1 is trained but never runs
        runs.append(_run(model, "llama", engine))
    _assert_same(*runs)


def test_dual_works_with_stateful_optimizers():
    _assert_same(_run(_model("llama"), "llama", "sequential", ZOAdam), _run(_model("llama"), "llama", "dual", ZOAdam))


def test_tied_embedding_is_updated_once():
    model = _model("opt")
    assert model.lm_head.weight is model.model.decoder.embed_tokens.weight
    before = model.lm_head.weight.detach().clone()
    optimizer = ZOSGD(model.parameters(), lr=0.0, eps=1e-3, seed=1)
    optimizer.attach_engine(DualEngine(model))
    for _ in range(3):
        optimizer.step(_closure(model, "opt"))
    optimizer.flush()
    assert model.lm_head.weight is model.model.decoder.embed_tokens.weight
    assert torch.allclose(model.lm_head.weight, before, rtol=0, atol=1e-6)  # lr=0: only restore rounding


def test_non_finite_loss_is_skipped_and_weights_restored():
    model = _model("gpt2")
    before = [p.detach().clone() for p in model.parameters()]
    optimizer = ZOSGD(model.parameters(), lr=1e-2, eps=1e-3, seed=1)
    optimizer.attach_engine(DualEngine(model))
    calls = []

    def closure():
        calls.append(threading.current_thread().name)
        return torch.tensor(float("nan"))

    assert optimizer.estimate(closure) == []
    optimizer.step()
    optimizer.flush()
    assert optimizer.num_skipped == 1 and len(calls) == 2
    assert all(torch.allclose(p, b, rtol=0, atol=1e-6) for p, b in zip(model.parameters(), before))


def test_failure_in_a_pass_restores_weights_and_ends_both_threads():
    model = _model("llama")
    before = [p.detach().clone() for p in model.parameters()]
    optimizer = ZOSGD(model.parameters(), lr=1e-2, eps=1e-3, seed=1)
    optimizer.attach_engine(DualEngine(model))
    failing = model.model.layers[1]

    def explode(module, args):
        raise RuntimeError("boom in block 1")

    handle = failing.register_forward_pre_hook(explode)
    with pytest.raises(RuntimeError, match="boom in block 1"):
        optimizer.estimate(_closure(model, "llama"))
    handle.remove()
    assert not [t for t in threading.enumerate() if t.name.startswith("hf_zo_pass")]
    optimizer.flush()
    assert all(torch.allclose(p, b, rtol=0, atol=1e-6) for p, b in zip(model.parameters(), before))
    assert optimizer.step(_closure(model, "llama")) is not None  # the engine still works afterwards


def test_blocks_must_run_in_the_same_order_in_both_passes():
    model = _model("opt")
    optimizer = ZOSGD(model.parameters(), lr=1e-2, eps=1e-3, seed=1)
    optimizer.attach_engine(DualEngine(model))
    ids = torch.randint(2, VOCAB, (2, 8), generator=torch.Generator().manual_seed(0))
    layers = model.model.decoder.layers
    flips = []

    def closure():  # the second pass runs the layers in reverse
        flips.append(len(flips))
        if flips[-1] == 1:
            layers._modules = dict(reversed(list(layers._modules.items())))
        return model(input_ids=ids, labels=ids).loss

    with pytest.raises(RuntimeError, match="reached different blocks"):
        optimizer.estimate(closure)


def test_exact_restore_in_bf16():
    """With lr=0 a bf16 model drifts by restore rounding; exact_restore brings every block back bit for bit."""
    drift = {}
    for exact in (False, True):
        model = _model("llama").to(torch.bfloat16)
        before = [p.detach().clone() for p in model.parameters()]
        optimizer = ZOSGD(model.parameters(), lr=0.0, eps=1e-2, seed=1)
        optimizer.attach_engine(DualEngine(model, exact_restore=exact))
        for _ in range(3):
            optimizer.step(_closure(model, "llama"))
        optimizer.flush()
        drift[exact] = max((p.float() - b.float()).abs().max().item() for p, b in zip(model.parameters(), before))
    assert drift[True] == 0.0 and drift[False] > 0.0


def test_engine_restores_as_the_optimizer_decides_by_default(tmp_path):
    """A small bf16 set gets exact restore by default (the optimizer's `exact_restore=None`), with the dual engine
    too: through the trainer, lr 0 leaves every weight bit for bit."""
    from hf_zo import ZOTrainer

    from tiny_models import lm_dataset, zo_args

    model = _model("llama").to(torch.bfloat16)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    args = zo_args(
        tmp_path, learning_rate=0.0, zo_eps=1e-2, zo_engine="dual", max_steps=3, per_device_train_batch_size=2
    )
    trainer = ZOTrainer(model=model, args=args, train_dataset=lm_dataset(8, length=8))
    trainer.train()
    assert trainer.optimizer.optimizer.engine.exact_restore is True  # inside accelerate's wrapper
    for name, param in model.named_parameters():
        assert torch.equal(param, before[name]), name

    optimizer = ZOSGD(model.parameters(), lr=0.0, eps=1e-2, exact_restore=False)
    optimizer.attach_engine(DualEngine(model))
    assert optimizer.engine.exact_restore is False


def test_plain_forwards_are_untouched_outside_estimates():
    model = _model("qwen2")
    ids = torch.randint(2, VOCAB, (2, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = model(input_ids=ids).logits
    engine = DualEngine(model)
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, expected)
    engine.close()
    assert all(not block._forward_pre_hooks for block in find_blocks(model))
