"""A sentence-transformers checkpoint loads as a classifier over the pooling it was trained with."""

from __future__ import annotations

import json

import pytest
import torch
from peft import LoraConfig, PeftModel, PromptTuningConfig, TaskType, get_peft_model
from transformers import AutoModel, AutoModelForSequenceClassification, BertForSequenceClassification

from hf_zo import PooledEncoderForSequenceClassification, ZOTrainer, load_sequence_classifier
from hf_zo.pooled_classifier import read_pooling_config

from tiny_models import classification_dataset, save_tiny_sentence_encoder, tiny_bert_classifier, zo_args

# Two sequences, the second padded: masked pooling must ignore its last three tokens.
INPUT_IDS = torch.tensor([[2, 5, 9, 11, 7, 3], [2, 8, 6, 0, 0, 0]])
ATTENTION_MASK = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 0, 0, 0]])


def hand_pooled(encoder_dir, mode: str) -> torch.Tensor:
    hidden = AutoModel.from_pretrained(encoder_dir)(input_ids=INPUT_IDS, attention_mask=ATTENTION_MASK)[0]
    rows = []
    for states, mask in zip(hidden, ATTENTION_MASK):
        kept = states[mask.bool()]
        rows.append({"mean": kept.mean(0), "max": kept.max(0).values, "cls": states[0]}[mode])
    return torch.stack(rows)


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
    assert read_pooling_config(tmp_path) == {"pooling_modes": ["mean"], "normalize": True}
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
    with torch.no_grad():
        assert torch.equal(
            model(input_ids=INPUT_IDS, attention_mask=ATTENTION_MASK).logits,
            reloaded(input_ids=INPUT_IDS, attention_mask=ATTENTION_MASK).logits,
        )
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
    with pytest.raises(ValueError, match=r"pools with \['mean', 'max'\].*pass pooling_mode to choose it"):
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
    with torch.no_grad():
        assert torch.equal(
            model(input_ids=INPUT_IDS, attention_mask=ATTENTION_MASK).logits,
            reloaded(input_ids=INPUT_IDS, attention_mask=ATTENTION_MASK).logits,
        )


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
    with torch.no_grad():
        assert torch.equal(
            model(input_ids=INPUT_IDS, attention_mask=ATTENTION_MASK).logits,
            reloaded(input_ids=INPUT_IDS, attention_mask=ATTENTION_MASK).logits,
        )


def test_unknown_pooling_mode_fails_at_construction():
    from hf_zo import PooledEncoderConfig

    with pytest.raises(ValueError, match="Unknown pooling_mode 'sum'"):
        PooledEncoderConfig(pooling_mode="sum")


def test_a_head_on_the_untrained_pooler_is_reported(tmp_path):
    from hf_zo.pooled_classifier import pooling_mismatch

    save_tiny_sentence_encoder(tmp_path)
    on_pooler = AutoModelForSequenceClassification.from_pretrained(tmp_path, num_labels=2)
    message = pooling_mismatch(get_peft_model(on_pooler, LoraConfig(task_type=TaskType.SEQ_CLS, r=2)))
    assert message is not None and "['mean'] pooling" in message and "load_sequence_classifier" in message
    assert pooling_mismatch(load_sequence_classifier(tmp_path, num_labels=2)) is None
    assert pooling_mismatch(tiny_bert_classifier()) is None  # built in code: no checkpoint to compare with
