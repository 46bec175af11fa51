"""`FrozenPrefix`: the frozen blocks before the first perturbed one run once per micro-batch, and nothing changes."""

import pytest
import torch
from peft import LoraConfig, get_peft_model

from hf_zo import ZOTrainer
from hf_zo.engine import FrozenPrefix, find_blocks, frozen_prefix_blocks
from hf_zo.optim import FZOO, ZOSGD

from tiny_models import VOCAB, lm_dataset, tiny_causal_lm, zo_args

FAMILIES = ["opt", "llama", "qwen2", "gpt2"]
TARGETS = {"opt": ["q_proj"], "llama": ["q_proj"], "qwen2": ["q_proj"], "gpt2": ["c_attn"]}


def _lora(family, layers=(1,), seed=0):
    """A tiny causal LM of `family` with LoRA on the attention of `layers` only (B made non-zero, so the
    perturbations change the loss)."""
    config = LoraConfig(r=2, target_modules=TARGETS[family], layers_to_transform=list(layers))
    model = get_peft_model(tiny_causal_lm(family, seed=seed), config).eval()
    torch.manual_seed(seed)
    for name, param in model.named_parameters():
        if "lora_B" in name:
            param.data.normal_(std=0.1)
    return model


def _perturbed(model):
    return [p for p in model.parameters() if p.requires_grad]


def _closure(model, seed):
    ids = torch.randint(2, VOCAB, (2, 8), generator=torch.Generator().manual_seed(seed))
    return lambda: model(input_ids=ids, labels=ids).loss


def _train(model, optimizer_cls, share: bool, steps=3):
    """A few ZO steps, each micro-batch's estimates inside `FrozenPrefix.shared()` when `share`; the records, the
    flushed weights and the prefix."""
    kwargs = dict(lr=1e-2, eps=1e-3, seed=3, num_perturbations=2)
    if optimizer_cls is FZOO:
        kwargs.update(lr=3e-5, num_perturbations=3)
    optimizer = optimizer_cls(_perturbed(model), **kwargs)
    prefix = FrozenPrefix(model, _perturbed(model) if share else [])
    records = []
    for step in range(steps):
        with prefix.shared():
            records += optimizer.estimate(_closure(model, step))
        optimizer.step()
    optimizer.flush()
    return records, {name: p.detach().clone() for name, p in model.named_parameters()}, prefix


@pytest.mark.filterwarnings("ignore:fan_in_fan_out")
@pytest.mark.parametrize("family", FAMILIES)
def test_prefix_is_the_blocks_before_the_first_perturbed_one(family):
    model = _lora(family, layers=(1,))
    assert frozen_prefix_blocks(model, _perturbed(model)) == find_blocks(model)[:1]
    everywhere = _lora(family, layers=(0, 1))
    assert frozen_prefix_blocks(everywhere, _perturbed(everywhere)) == []
    assert frozen_prefix_blocks(model, []) == []  # nothing perturbed: nothing to share


def test_no_prefix_when_a_perturbed_tensor_lies_outside_the_blocks():
    model = _lora("llama", layers=(1,))
    embeddings = model.get_input_embeddings().weight
    embeddings.requires_grad_(True)
    assert frozen_prefix_blocks(model, _perturbed(model)) == []
    assert not FrozenPrefix(model, _perturbed(model))


@pytest.mark.filterwarnings("ignore:fan_in_fan_out")
@pytest.mark.parametrize("optimizer_cls", [ZOSGD, FZOO])
@pytest.mark.parametrize("family", FAMILIES)
def test_reuse_changes_nothing_bitwise(family, optimizer_cls):
    records, weights, _ = _train(_lora(family), optimizer_cls, share=False)
    shared_records, shared_weights, prefix = _train(_lora(family), optimizer_cls, share=True)
    assert shared_records == records  # seeds, projected gradients and losses, bitwise
    for name, value in weights.items():
        assert torch.equal(shared_weights[name], value), name
    if family == "llama":  # the first forward of each micro-batch runs block 0, the others reuse it
        forwards = 4  # a step of ZO-SGD: two two-point estimates; of FZOO: a centre and three one-sided points
        assert prefix.reused == 3 * (forwards - 1)


def test_other_inputs_run_the_block_and_the_patch_is_removed():
    model = _lora("llama")
    block = find_blocks(model)[0]
    calls = []
    block.register_forward_hook(lambda *_: calls.append(1))
    prefix = FrozenPrefix(model, _perturbed(model))
    with torch.no_grad():
        expected = [_closure(model, seed)().item() for seed in (0, 1, 0)]
        calls.clear()
        with prefix.shared():
            losses = [_closure(model, seed)().item() for seed in (0, 1, 0)]
    assert losses == expected
    assert len(calls) == 3  # other inputs run the block (the hooks run whether or not it computes)
    assert prefix.reused == 0  # each batch differs from the one before it: nothing reused
    assert "forward" not in block.__dict__


@pytest.mark.filterwarnings("ignore:fan_in_fan_out")
def test_trainer_reuses_the_prefix_and_trains_the_same_weights(tmp_path):
    def train(reuse: bool):
        model = _lora("llama")
        args = zo_args(tmp_path, zo_reuse_frozen_prefix=reuse, max_steps=4, learning_rate=1e-2)
        trainer = ZOTrainer(model=model, args=args, train_dataset=lm_dataset(16, length=8))
        trainer.train()
        return trainer, {name: p.detach().clone() for name, p in model.named_parameters() if p.requires_grad}

    reused, weights = train(True)
    plain, plain_weights = train(False)
    assert reused._zo_frozen_prefix[1].reused == 4  # one reuse of block 0 a step
    assert not plain._zo_frozen_prefix[1]
    for name, value in weights.items():
        assert torch.equal(plain_weights[name], value), name
