"""A sentence-transformers checkpoint loads as a classifier over the pooling it was trained with."""

from __future__ import annotations

import json
import re

import pytest
import torch
from peft import LoraConfig, PeftModel, PromptTuningConfig, TaskType, get_peft_model
from transformers import AutoModel, AutoModelForSequenceClassification, BertForSequenceClassification

from hf_zo import PooledEncoderForSequenceClassification, ZOTrainer, load_sequence_classifier
from hf_zo.models import read_pooling_config

from tiny_models import classification_dataset, save_tiny_sentence_encoder, tiny_bert_classifier, zo_args

# Two sequences, the second padded: masked pooling must ignore its last three tokens.
INPUT_IDS = torch.tensor([[2, 5, 9, 11, 7, 3], [2, 8, 6, 0, 0, 0]])
ATTENTION_MASK = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 0, 0, 0]])


def _assert_same_logits(model, other):
    with torch.no_grad():
        assert torch.equal(
            model(input_ids=INPUT_IDS, attention_mask=ATTENTION_MASK).logits,
            other(input_ids=INPUT_IDS, attention_mask=ATTENTION_MASK).logits,
        )


def hand_pooled(encoder_dir, mode: str) -> torch.Tensor:
    hidden = AutoModel.from_pretrained(encoder_dir)(input_ids=INPUT_IDS, attention_mask=ATTENTION_MASK)[0]
    rows = []
    for states, mask in zip(hidden, ATTENTION_MASK):
        kept = states[mask.bool()]
        pooled = {"mean": kept.mean(0), "max": kept.max(0).values, "cls": states[0]}
        pooled["mean_sqrt_len"] = kept.sum(0) / len(kept) ** 0.5
        rows.append(pooled[mode])
    return torch.stack(rows)


# The module types sentence-transformers 6.3 writes in modules.json (older releases: sentence_transformers.models.X).
CURRENT_TYPES = {
    "Transformer": "sentence_transformers.base.modules.transformer.Transformer",
    "Pooling": "sentence_transformers.sentence_transformer.modules.pooling.Pooling",
    "Dense": "sentence_transformers.base.modules.dense.Dense",
    "Normalize": "sentence_transformers.base.modules.normalize.Normalize",
}


def save_current_sentence_encoder(path, pooling_mode, modules=("Pooling",), include_prompt=True) -> None:
    """The tiny encoder saved as sentence-transformers 6.3 saves one: its module types, and a pooling config with
    the `pooling_mode` key (`{"embedding_dimension": ..., "pooling_mode": "mean", "include_prompt": true}`)."""
    save_tiny_sentence_encoder(path)  # the encoder's weights and config; modules.json and pooling replaced below
    entries = [{"idx": 0, "name": "0", "path": "", "type": CURRENT_TYPES["Transformer"]}]
    for idx, name in enumerate(modules, start=1):
        entries.append({"idx": idx, "name": str(idx), "path": f"{idx}_{name}", "type": CURRENT_TYPES[name]})
        (path / f"{idx}_{name}").mkdir(exist_ok=True)
    (path / "modules.json").write_text(json.dumps(entries))
    pooling = {"embedding_dimension": 32, "pooling_mode": pooling_mode, "include_prompt": include_prompt}
    (path / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    if "Dense" in modules:
        dense = {"in_features": 32, "out_features": 16, "bias": True, "activation_function": "torch.nn.Tanh"}
        (path / f"{modules.index('Dense') + 1}_Dense" / "config.json").write_text(json.dumps(dense))


@pytest.mark.parametrize("mode", ["mean", "max", "cls"])
def test_logits_are_the_head_on_the_checkpoints_pooling(tmp_path, mode):
    save_tiny_sentence_encoder(tmp_path, pooling=mode)
    model = load_sequence_classifier(tmp_path, num_labels=3)
    assert isinstance(model, PooledEncoderForSequenceClassification) and model.config.pooling_mode == mode
    assert not model.training  # like from_pretrained
    with torch.no_grad():
        logits = model(input_ids=INPUT_IDS, attention_mask=ATTENTION_MASK).logits
        expected = model.classifier(hand_pooled(tmp_path, mode))
    torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-6)


def test_normalize_module_normalizes_the_embedding(tmp_path):
    save_tiny_sentence_encoder(tmp_path, normalize=True)
    assert read_pooling_config(tmp_path) == {"pooling_modes": ["mean"], "normalize": True, "unsupported_modules": []}
    model = load_sequence_classifier(tmp_path, num_labels=2)
    with torch.no_grad():
        expected = model.classifier(torch.nn.functional.normalize(hand_pooled(tmp_path, "mean"), dim=-1))
        logits = model(input_ids=INPUT_IDS, attention_mask=ATTENTION_MASK).logits
    torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-6)


def test_save_and_auto_class_reload_are_exact(tmp_path):
    save_tiny_sentence_encoder(tmp_path / "encoder")
    model = load_sequence_classifier(tmp_path / "encoder", num_labels=2)
    assert not hasattr(model.encoder, "pooler") or model.encoder.pooler is None  # no untrained parameters left
    model.save_pretrained(tmp_path / "saved")
    reloaded = AutoModelForSequenceClassification.from_pretrained(tmp_path / "saved")
    assert type(reloaded) is PooledEncoderForSequenceClassification
    assert reloaded.config.pooling_mode == "mean" and reloaded.config.encoder.hidden_size == 32
    state, reloaded_state = model.state_dict(), reloaded.state_dict()
    assert state.keys() == reloaded_state.keys()
    assert all(torch.equal(state[k], reloaded_state[k]) for k in state)
    _assert_same_logits(model, reloaded)
    # A saved pooled classifier is not a sentence-transformers checkpoint any more: it loads as itself.
    assert type(load_sequence_classifier(tmp_path / "saved")) is PooledEncoderForSequenceClassification


def test_checkpoint_without_pooling_config_loads_with_the_auto_class(tmp_path):
    tiny_bert_classifier().save_pretrained(tmp_path)
    assert read_pooling_config(tmp_path) is None
    assert type(load_sequence_classifier(tmp_path, num_labels=2)) is BertForSequenceClassification


def test_several_pooling_modes_are_refused_with_the_fix(tmp_path):
    save_tiny_sentence_encoder(tmp_path)
    path = tmp_path / "1_Pooling" / "config.json"
    config = json.loads(path.read_text())
    path.write_text(json.dumps(config | {"pooling_mode_max_tokens": True}))
    # In sentence-transformers' order, the order in which it concatenates them.
    with pytest.raises(ValueError, match=r"pools with \['max', 'mean'\].*pass pooling_mode to choose it"):
        load_sequence_classifier(tmp_path, num_labels=2)
    model = PooledEncoderForSequenceClassification.from_encoder(tmp_path, pooling_mode="max", num_labels=2)
    assert model.config.pooling_mode == "max"


def test_lora_with_head_in_modules_to_save_trains_saves_and_reloads(tmp_path):
    save_tiny_sentence_encoder(tmp_path / "encoder")
    lora = LoraConfig(task_type=TaskType.SEQ_CLS, r=4, target_modules=["query", "value"])
    model = get_peft_model(load_sequence_classifier(tmp_path / "encoder", num_labels=2), lora)
    head_before = model.base_model.model.classifier.modules_to_save["default"].weight.detach().clone()
    args = zo_args(tmp_path, max_steps=3, learning_rate=1e-2, zo_eps=1e-2, zo_head_init_max_samples=16)
    trainer = ZOTrainer(model=model, args=args, train_dataset=classification_dataset(16))
    trainer.train()  # the default head options: linear probe on the pooled features, then a first-order head
    assert trainer.zo_heads.names == ["base_model.model.classifier.modules_to_save.default"]
    assert not torch.equal(model.base_model.model.classifier.modules_to_save["default"].weight, head_before)
    trainer.save_model(str(tmp_path / "adapter"))
    base = load_sequence_classifier(tmp_path / "encoder", num_labels=2)
    reloaded = PeftModel.from_pretrained(base, tmp_path / "adapter")
    model.eval()
    _assert_same_logits(model, reloaded)


def test_prompt_tuning_needs_no_sizes_and_pools_over_the_virtual_tokens(tmp_path):
    # PEFT reads num_layers / token_dim / num_attention_heads from the top-level config and the vocabulary from
    # get_text_config(): both come from the encoder, so a prompt-tuning config needs none of them.
    save_tiny_sentence_encoder(tmp_path / "encoder")
    classifier = load_sequence_classifier(tmp_path / "encoder", num_labels=2)
    encoder_config = classifier.config.encoder
    assert classifier.config.get_text_config() is encoder_config
    assert (classifier.config.hidden_size, classifier.config.num_hidden_layers) == (
        encoder_config.hidden_size,
        encoder_config.num_hidden_layers,
    )
    model = get_peft_model(classifier, PromptTuningConfig(task_type=TaskType.SEQ_CLS, num_virtual_tokens=3))
    model.eval()

    # The mean runs over the virtual tokens too: they are part of the sequence the encoder sees.
    prompt = model.get_prompt_embedding_to_save("default").unsqueeze(0).expand(2, -1, -1)
    embeds = torch.cat([prompt, classifier.get_input_embeddings()(INPUT_IDS)], dim=1)
    mask = torch.cat([torch.ones(2, 3, dtype=torch.long), ATTENTION_MASK], dim=1)
    with torch.no_grad():
        hidden = classifier.encoder(inputs_embeds=embeds, attention_mask=mask)[0]
        pooled = (hidden * mask.unsqueeze(-1)).sum(1) / mask.sum(1, keepdim=True)
        expected = model.base_model.classifier.modules_to_save["default"](pooled)
        torch.testing.assert_close(model(input_ids=INPUT_IDS, attention_mask=ATTENTION_MASK).logits, expected)

    before = model.get_prompt_embedding_to_save("default").clone()
    args = zo_args(tmp_path, max_steps=3, learning_rate=1e-2, zo_eps=1e-2, zo_head_init_max_samples=16)
    ZOTrainer(model=model, args=args, train_dataset=classification_dataset(16)).train()
    assert not torch.equal(model.get_prompt_embedding_to_save("default"), before)
    model.save_pretrained(tmp_path / "adapter")
    reloaded = PeftModel.from_pretrained(
        load_sequence_classifier(tmp_path / "encoder", num_labels=2), tmp_path / "adapter"
    )
    model.eval()
    _assert_same_logits(model, reloaded)


def test_unknown_pooling_mode_fails_at_construction():
    from hf_zo import PooledEncoderConfig

    with pytest.raises(ValueError, match="Unknown pooling_mode 'sum'"):
        PooledEncoderConfig(pooling_mode="sum")


def test_a_head_on_the_untrained_pooler_is_reported(tmp_path):
    from hf_zo.models import pooling_mismatch

    save_tiny_sentence_encoder(tmp_path)
    on_pooler = AutoModelForSequenceClassification.from_pretrained(tmp_path, num_labels=2)
    message = pooling_mismatch(get_peft_model(on_pooler, LoraConfig(task_type=TaskType.SEQ_CLS, r=2)))
    assert message is not None and "['mean'] pooling" in message and "load_sequence_classifier" in message
    assert pooling_mismatch(load_sequence_classifier(tmp_path, num_labels=2)) is None
    assert pooling_mismatch(tiny_bert_classifier()) is None  # built in code: no checkpoint to compare with


@pytest.mark.parametrize(
    "written, mode",
    [("mean", "mean"), ("cls", "cls"), ("max", "max"), ("mean_sqrt_len_tokens", "mean_sqrt_len"), (["mean"], "mean")],
)
def test_the_pooling_mode_key_of_current_sentence_transformers_is_read(tmp_path, written, mode):
    # sentence-transformers >= 6 writes {"pooling_mode": "mean", ...} instead of the pooling_mode_*_tokens flags; a
    # one-mode list is the same mode, and include_prompt does not change what a prompt-less input pools over.
    save_current_sentence_encoder(tmp_path, written, modules=("Pooling", "Normalize"), include_prompt=False)
    assert read_pooling_config(tmp_path) == {"pooling_modes": [mode], "normalize": True, "unsupported_modules": []}
    model = load_sequence_classifier(tmp_path, num_labels=2)
    assert (model.config.pooling_mode, model.config.normalize) == (mode, True)
    with torch.no_grad():
        expected = model.classifier(torch.nn.functional.normalize(hand_pooled(tmp_path, mode), dim=-1))
        logits = model(input_ids=INPUT_IDS, attention_mask=ATTENTION_MASK).logits
    torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-6)


def test_several_modes_under_the_pooling_mode_key_are_refused(tmp_path):
    save_current_sentence_encoder(tmp_path, ["cls", "mean_sqrt_len_tokens"])
    with pytest.raises(ValueError, match=r"pools with \['cls', 'mean_sqrt_len'\].*pass pooling_mode to choose it"):
        load_sequence_classifier(tmp_path, num_labels=2)


@pytest.mark.parametrize("written", ["lasttoken", "weightedmean"])
def test_a_mode_hf_zo_does_not_implement_is_refused_by_name(tmp_path, written):
    save_current_sentence_encoder(tmp_path, written)
    with pytest.raises(ValueError, match=rf"pools with \['{written}'\]; .*exactly one of \['mean', 'cls'"):
        load_sequence_classifier(tmp_path, num_labels=2)


def test_legacy_config_with_no_flag_set_pools_with_the_mean_as_sentence_transformers_does(tmp_path):
    save_tiny_sentence_encoder(tmp_path)
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 32}))
    assert read_pooling_config(tmp_path)["pooling_modes"] == ["mean"]


def test_cls_pooling_reads_the_first_non_padding_token(tmp_path):
    # Left padding (a tokenizer with padding_side="left"): sentence-transformers' CLS is the first attended token.
    save_tiny_sentence_encoder(tmp_path, pooling="cls")
    model = load_sequence_classifier(tmp_path, num_labels=2)
    input_ids = torch.tensor([[2, 5, 9, 11], [0, 0, 2, 8]])
    attention_mask = torch.tensor([[1, 1, 1, 1], [0, 0, 1, 1]])
    with torch.no_grad():
        hidden = model.encoder(input_ids=input_ids, attention_mask=attention_mask)[0]
        expected = model.classifier(torch.stack([hidden[0, 0], hidden[1, 2]]))
        logits = model(input_ids=input_ids, attention_mask=attention_mask).logits
    torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-6)


def test_a_dense_module_is_refused_unless_a_pooling_mode_is_chosen(tmp_path):
    # LaBSE, sentence-t5 and gtr-t5 project the pooled embedding with a Dense layer the classifier does not compute.
    from hf_zo.models import pooling_mismatch

    save_current_sentence_encoder(tmp_path, "mean", modules=("Pooling", "Dense", "Normalize"))
    dense = "sentence_transformers.base.modules.dense.Dense (at '2_Dense')"
    assert read_pooling_config(tmp_path)["unsupported_modules"] == [dense]
    with pytest.raises(ValueError, match=re.escape(dense) + r" in its modules.json.*Pass pooling_mode"):
        load_sequence_classifier(tmp_path, num_labels=2)
    model = load_sequence_classifier(tmp_path, num_labels=2, pooling_mode="mean", normalize=False)
    with torch.no_grad():
        expected = model.classifier(hand_pooled(tmp_path, "mean"))
        torch.testing.assert_close(model(input_ids=INPUT_IDS, attention_mask=ATTENTION_MASK).logits, expected)
    on_pooler = AutoModelForSequenceClassification.from_pretrained(tmp_path, num_labels=2)
    assert "load_sequence_classifier(path, num_labels=..., pooling_mode=...)" in pooling_mismatch(on_pooler)


def test_an_encoder_decoder_checkpoint_is_refused(tmp_path):
    # A sentence-t5 encoder saved alone (T5EncoderModel writes is_encoder_decoder=False): AutoModel would build the
    # whole T5Model, with a random decoder whose forward fails without decoder inputs.
    from transformers import T5Config, T5EncoderModel

    save_tiny_sentence_encoder(tmp_path)
    config = T5Config(vocab_size=64, d_model=16, d_kv=8, d_ff=32, num_layers=1, num_heads=2)
    T5EncoderModel(config).save_pretrained(tmp_path)  # replaces the BERT encoder, keeps the pooling config
    with pytest.raises(ValueError, match=r"is a 't5' checkpoint, an encoder-decoder architecture.*encoder-only"):
        load_sequence_classifier(tmp_path, num_labels=2)


CUSTOM_CONFIG = """
from transformers import BertConfig


class CustomBertConfig(BertConfig):
    model_type = "hf_zo_test_custom_bert"
"""

CUSTOM_MODELING = """
from transformers import BertConfig, BertForSequenceClassification, BertModel

from .configuration_custom import CustomBertConfig


class CustomBertModel(BertModel):
    config_class = CustomBertConfig


class CustomBertForSequenceClassification(BertForSequenceClassification):
    config_class = CustomBertConfig


class NativeConfigBertModel(BertModel):
    config_class = BertConfig
"""


def save_custom_code_encoder(path, custom_config: bool, sentence_transformers: bool = True) -> None:
    """The tiny encoder as a checkpoint whose model (and, with `custom_config`, config) class is its own code."""
    from tiny_models import tiny_bert_config

    save_tiny_sentence_encoder(path)
    if not sentence_transformers:
        (path / "modules.json").unlink()
    (path / "configuration_custom.py").write_text(CUSTOM_CONFIG)
    (path / "modeling_custom.py").write_text(CUSTOM_MODELING)
    config = tiny_bert_config().to_dict()
    if custom_config:
        config["model_type"] = "hf_zo_test_custom_bert"
        config["auto_map"] = {
            "AutoConfig": "configuration_custom.CustomBertConfig",
            "AutoModel": "modeling_custom.CustomBertModel",
            "AutoModelForSequenceClassification": "modeling_custom.CustomBertForSequenceClassification",
        }
    else:
        config["auto_map"] = {"AutoModel": "modeling_custom.NativeConfigBertModel"}
    (path / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("custom_config", [True, False], ids=["custom-config", "native-config"])
def test_an_encoder_running_its_own_code_is_refused_as_it_would_not_load_back(tmp_path, custom_config):
    path = tmp_path / f"custom_encoder_{custom_config}"
    save_custom_code_encoder(path, custom_config)
    with pytest.raises(ValueError, match=r"runs its own code \(.*trust_remote_code=True\).*would not load back"):
        load_sequence_classifier(path, num_labels=2, trust_remote_code=True)


def test_trust_remote_code_reaches_the_config_of_a_checkpoint_without_pooling(tmp_path):
    path = tmp_path / "custom_classifier"
    save_custom_code_encoder(path, custom_config=True, sentence_transformers=False)
    model = load_sequence_classifier(path, num_labels=2, trust_remote_code=True)
    assert type(model).__name__ == "CustomBertForSequenceClassification"


def test_device_map_keeps_the_head_with_the_encoder(tmp_path):
    save_tiny_sentence_encoder(tmp_path)
    torch.manual_seed(0)
    plain = load_sequence_classifier(tmp_path, num_labels=2)
    torch.manual_seed(0)
    placed = load_sequence_classifier(tmp_path, num_labels=2, device_map="cpu")
    assert placed.classifier.weight.device == placed.encoder.device
    _assert_same_logits(plain, placed)


def test_an_offloaded_encoder_computes_saves_and_reloads_exactly(tmp_path):
    # A device_map with disk offload dispatches the encoder with accelerate hooks: the composite model carries the
    # map (with the head), which save_pretrained needs to gather the offloaded weights.
    save_tiny_sentence_encoder(tmp_path / "encoder")
    torch.manual_seed(0)
    plain = load_sequence_classifier(tmp_path / "encoder", num_labels=2)
    torch.manual_seed(0)
    device_map = {"embeddings": "cpu", "encoder": "disk", "pooler": "cpu"}
    offloaded = load_sequence_classifier(
        tmp_path / "encoder", num_labels=2, device_map=device_map, offload_folder=str(tmp_path / "offload")
    )
    assert offloaded.hf_device_map == {"encoder.embeddings": "cpu", "encoder.encoder": "disk", "classifier": "cpu"}
    _assert_same_logits(plain, offloaded)
    offloaded.save_pretrained(tmp_path / "saved")
    reloaded = AutoModelForSequenceClassification.from_pretrained(tmp_path / "saved")
    state, reloaded_state = plain.state_dict(), reloaded.state_dict()
    assert state.keys() == reloaded_state.keys()
    assert all(torch.equal(state[k], reloaded_state[k]) for k in state)
