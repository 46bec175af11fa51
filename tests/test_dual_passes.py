"""What each pass of the dual engine sees: every tensor outside the blocks in the pass's state whoever reads it, the
caller's autocast and default device, and the sequential engine's loss conversion."""

import copy

import pytest
import torch
from peft import LoraConfig, get_peft_model
from torch import nn
from transformers import CLIPConfig, CLIPModel, DebertaV2Config, DebertaV2ForSequenceClassification

from hf_zo.engine import DualEngine
from hf_zo.optim import ZOSGD

from tiny_models import VOCAB, tiny_causal_lm


def _estimates(model, closure, engine, steps=2, eps=1e-2):
    """Records and flushed weights of a few ZO-SGD steps (two perturbations each) with `engine`."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = ZOSGD(trainable, lr=1e-2, eps=eps, weight_decay=0.1, seed=5, num_perturbations=2)
    if engine == "dual":
        optimizer.attach_engine(DualEngine(model))
    records = []
    for _ in range(steps):
        records += optimizer.estimate(lambda: closure(model))
        optimizer.step()
    optimizer.flush()
    return records, {name: p.detach().clone() for name, p in model.named_parameters()}


def _assert_engines_agree(model, closure, **kwargs):
    """The sequential and dual engines give bitwise the same records and weights, and the estimate is not zero."""
    sequential, dual = (
        _estimates(copy.deepcopy(model), closure, engine, **kwargs) for engine in ("sequential", "dual")
    )
    assert [r.projected_grad for r in sequential[0]] == [r.projected_grad for r in dual[0]]
    assert sequential[0] == dual[0]  # seeds and both losses too
    assert all(r.loss_plus != r.loss_minus for r in sequential[0])  # the trained tensors move the loss
    for name, value in sequential[1].items():
        assert torch.equal(value, dual[1][name]), name


def _train_only(model, predicate):
    for name, param in model.named_parameters():
        param.requires_grad_(predicate(name))
    return model


def _lm_loss(model):
    ids = torch.randint(2, VOCAB, (2, 8), generator=torch.Generator().manual_seed(0))
    return model(input_ids=ids, labels=ids).loss


class _ReadsAroundItsOwners(nn.Module):
    """Reads a trainable tensor whose owner never runs (the embedding) and one whose owner's forward begins before the
    blocks and uses it after them (`scale`, read by the model itself, as CLIP reads `logit_scale`)."""

    _no_split_modules = ["_Block"]

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, 8)
        self.layers = nn.ModuleList([_Block() for _ in range(2)])
        self.scale = nn.Parameter(torch.tensor(1.5))

    def forward(self, ids):
        hidden = nn.functional.embedding(ids, self.embed.weight)
        for layer in self.layers:
            hidden = layer(hidden)
        return (self.scale * hidden).pow(2).mean()


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, hidden):
        return torch.tanh(self.linear(hidden))


def _custom_loss(model):
    return model(torch.randint(0, VOCAB, (2, 5), generator=torch.Generator().manual_seed(0)))


@pytest.mark.parametrize("only", ["embed", "scale", "all"])
def test_tensors_read_outside_their_owners_forward(only):
    model = _ReadsAroundItsOwners()
    _train_only(model, lambda name: only == "all" or name.startswith(only))
    _assert_engines_agree(model, _custom_loss)


def _deberta():
    config = DebertaV2Config(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=64,
        relative_attention=True,
        position_buckets=8,
        norm_rel_ebd="layer_norm",
        pos_att_type=["p2c", "c2p"],
        num_labels=2,
        # At the default 0.02 the relative-position bias moves the loss of this tiny model by less than fp32 can
        # tell (1e-7 with transformers 5.25), so a perturbation of `rel_embeddings` alone would change nothing.
        initializer_range=0.2,
    )
    torch.manual_seed(0)
    return DebertaV2ForSequenceClassification(config).eval()


def _classifier_loss(model):
    ids = torch.randint(2, VOCAB, (2, 8), generator=torch.Generator().manual_seed(0))
    return model(input_ids=ids, labels=torch.tensor([0, 1])).loss


@pytest.mark.parametrize("only_rel_embeddings", [True, False], ids=["rel_embeddings", "full"])
def test_deberta_v2_relative_embeddings(only_rel_embeddings):
    """The encoder reads `rel_embeddings.weight` through `get_rel_embedding()`: the embedding module never runs."""
    model = _deberta()
    if only_rel_embeddings:
        _train_only(model, lambda name: name == "deberta.encoder.rel_embeddings.weight")
    _assert_engines_agree(model, _classifier_loss, eps=0.5)


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("only_embedding_adapter", [True, False], ids=["embedding_adapter", "with_attention"])
def test_lora_on_the_embedding(only_embedding_adapter):
    """PEFT keeps `lora_embedding_A/B` in an `nn.ParameterDict`, whose forward never runs."""
    config = LoraConfig(r=4, target_modules=["embed_tokens", "q_proj", "v_proj"], init_lora_weights=False)
    model = get_peft_model(tiny_causal_lm("llama"), config).eval()
    if only_embedding_adapter:
        _train_only(model, lambda name: "lora_embedding" in name)
    _assert_engines_agree(model, _lm_loss)


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_peft_trainable_tokens():
    config = LoraConfig(r=4, target_modules=["q_proj"], trainable_token_indices=list(range(2, 12)))
    model = get_peft_model(tiny_causal_lm("llama"), config).eval()
    _train_only(model, lambda name: "trainable_tokens_delta" in name)
    _assert_engines_agree(model, _lm_loss, eps=0.5)


@pytest.mark.parametrize("only_logit_scale", [True, False], ids=["logit_scale", "full"])
def test_clip_logit_scale(only_logit_scale):
    """`CLIPModel.forward` owns `logit_scale` and starts before the blocks; the scale is read after them."""
    config = CLIPConfig(
        text_config=dict(
            vocab_size=VOCAB,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            max_position_embeddings=16,
            bos_token_id=0,
            eos_token_id=1,
            pad_token_id=1,
        ),
        vision_config=dict(
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            image_size=8,
            patch_size=4,
        ),
        projection_dim=8,
    )
    torch.manual_seed(0)
    model = CLIPModel(config).eval()
    if only_logit_scale:
        _train_only(model, lambda name: name == "logit_scale")
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(2, VOCAB, (3, 5), generator=generator)
    pixels = torch.randn(3, 3, 8, 8, generator=generator)
    _assert_engines_agree(model, lambda m: m(input_ids=ids, pixel_values=pixels, return_loss=True).loss, eps=0.5)


def _observed_state(engine, context):
    """The per-thread state each forward of one estimate runs under, and the dtype of a block's output."""
    model = tiny_causal_lm("opt").eval()
    optimizer = ZOSGD(model.parameters(), lr=1e-2, eps=1e-2, seed=1)
    if engine == "dual":
        optimizer.attach_engine(DualEngine(model))
    seen = []

    def closure():
        state = (
            torch.is_autocast_enabled("cpu"),
            torch.get_autocast_dtype("cpu"),
            torch.is_autocast_cache_enabled(),
            torch.empty(0).device,
        )
        with torch.device("cpu"):  # the model's own tensors on the CPU, whatever the default device is
            loss = _lm_loss(model)
        seen.append(state)
        return loss

    dtypes = []
    model.model.decoder.layers[0].fc1.register_forward_hook(lambda module, args, out: dtypes.append(out.dtype))
    with context():
        record = optimizer.estimate(closure)[0]
    return seen, set(dtypes), record


@pytest.mark.parametrize(
    "context",
    [
        lambda: torch.autocast("cpu", dtype=torch.bfloat16),
        lambda: torch.autocast("cpu", dtype=torch.float16, cache_enabled=False),
        lambda: torch.device("meta"),
    ],
    ids=["bf16_autocast", "fp16_autocast_no_cache", "default_device"],
)
def test_passes_run_under_the_callers_autocast_and_default_device(context):
    sequential, dual = _observed_state("sequential", context), _observed_state("dual", context)
    assert len(dual[0]) == 2 and dual[0] == sequential[0]
    assert dual[1] == sequential[1]


def test_autocast_estimates_agree_with_the_sequential_engine():
    """Under bf16 autocast both engines run the same bf16 kernels. (Autocast's weight cache is off: with it on, the
    sequential engine's second forward would reuse the first forward's casts of the perturbed weights.)"""
    sequential, dual = (
        _observed_state(engine, lambda: torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False))
        for engine in ("sequential", "dual")
    )
    assert dual[1] == {torch.bfloat16}
    assert dual[2] == sequential[2]


def test_float64_losses_keep_their_precision():
    model = tiny_causal_lm("opt").double().eval()
    ids = torch.randint(2, VOCAB, (2, 8), generator=torch.Generator().manual_seed(0))

    def closure(m):
        return m(input_ids=ids).logits.log_softmax(-1).mean()

    _assert_engines_agree(model, closure, eps=1e-3)
    loss = _estimates(copy.deepcopy(model), closure, "dual", steps=1)[0][0].loss_plus
    assert loss != float(torch.tensor(loss, dtype=torch.float32))  # not rounded to fp32 on the way


def test_a_model_output_from_the_closure_is_named():
    model = tiny_causal_lm("opt").eval()
    optimizer = ZOSGD(model.parameters(), lr=1e-2, eps=1e-3)
    optimizer.attach_engine(DualEngine(model))
    ids = torch.randint(2, VOCAB, (2, 8), generator=torch.Generator().manual_seed(0))
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(TypeError, match=r"got CausalLMOutputWithPast \(a model output: return its \.loss\)"):
        optimizer.estimate(lambda: model(input_ids=ids, labels=ids))
    optimizer.flush()  # the failed estimate left every tensor restored (pending)
    assert all(torch.allclose(p, b, rtol=0, atol=1e-6) for p, b in zip(model.parameters(), before))
