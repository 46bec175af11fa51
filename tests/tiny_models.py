"""Tiny random models built from configs in code (no downloads), their data, and a quiet `ZOConfig`, shared by the
tests."""

from __future__ import annotations

import torch
from transformers import (
    BertConfig,
    BertForSequenceClassification,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    OPTConfig,
    OPTForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

VOCAB = 64

OPTIMIZER_HYPERPARAMETERS = {
    "zo_sgd": dict(lr=0.02),
    "zo_sgd_momentum": dict(lr=0.005, momentum=0.9),
    "zo_sgd_sign": dict(lr=0.01),
    "zo_sgd_cons": dict(lr=0.02),
    "zo_adam": dict(lr=0.05),
    "lozo": dict(lr=0.02),
    "hizoo": dict(lr=0.02, hessian_smooth=1e-3),
    "fzoo": dict(lr=3e-5),  # its step is lr / eps * sqrt(d / N) long, whatever the gradient
}
"""Learning rates (and more) of each `hf_zo.optim` optimizer at which the tests' small problems descend."""


def tiny_causal_lm(family: str = "opt", seed: int = 0) -> torch.nn.Module:
    """A 2-layer causal LM of the given family with random weights."""
    torch.manual_seed(seed)
    if family == "opt":
        config = OPTConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            num_hidden_layers=2,
            ffn_dim=64,
            num_attention_heads=4,
            max_position_embeddings=64,
            word_embed_proj_dim=32,
            dropout=0.0,
            pad_token_id=1,
        )
        return OPTForCausalLM(config)
    if family == "llama":
        config = LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=64,
        )
        return LlamaForCausalLM(config)
    if family == "qwen2":
        config = Qwen2Config(
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=64,
        )
        return Qwen2ForCausalLM(config)
    if family == "gpt2":
        config = GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64)
        return GPT2LMHeadModel(config)
    raise ValueError(f"unknown family {family!r}")


def tiny_bert_config(**overrides) -> BertConfig:
    """The configuration of the tiny 2-layer BERT shared by the encoder and classifier builders."""
    return BertConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=64,
        **overrides,
    )


def tiny_bert_classifier(num_labels: int = 2, seed: int = 0) -> torch.nn.Module:
    """A 2-layer BERT sequence classifier with random weights."""
    torch.manual_seed(seed)
    return BertForSequenceClassification(tiny_bert_config(num_labels=num_labels))


def lm_dataset(num_examples: int = 16, length: int = 16, seed: int = 0):
    """Token sequences over a 12-token sub-vocabulary with a learnable pattern (arithmetic progressions)."""
    from datasets import Dataset

    generator = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(num_examples):
        start = int(torch.randint(0, 12, (1,), generator=generator))
        step = int(torch.randint(1, 4, (1,), generator=generator))
        ids = [2 + (start + step * i) % 12 for i in range(length)]
        rows.append({"input_ids": ids, "attention_mask": [1] * length, "labels": ids})
    return Dataset.from_list(rows)


RAGGED = ((3, 17), (0, 12), (1, 4))  # ranges of a ragged example's length, first token and step


def ragged_lm_dataset(num_examples: int, seed: int = 0):
    """Arithmetic token progressions of 3 to 16 tokens: batches of them need padding (see `pad_lm_batch`)."""
    from datasets import Dataset

    generator = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(num_examples):
        length, start, step = (int(torch.randint(low, high, (1,), generator=generator)) for low, high in RAGGED)
        ids = [2 + (start + step * i) % 12 for i in range(length)]
        rows.append({"input_ids": ids, "attention_mask": [1] * length, "labels": ids})
    return Dataset.from_list(rows)


def pad_lm_batch(rows: list[dict]) -> dict:
    """Right-pads a causal LM batch (pad token 1, no loss on padding)."""
    width = max(len(row["input_ids"]) for row in rows)
    fill = {"input_ids": 1, "attention_mask": 0, "labels": -100}
    return {
        key: torch.tensor([row[key] + [value] * (width - len(row[key])) for row in rows])
        for key, value in fill.items()
    }


def classification_dataset(num_examples: int = 16, length: int = 8, seed: int = 0):
    """Sequences labelled by whether their first token is in the lower half of the vocabulary."""
    from datasets import Dataset

    generator = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(num_examples):
        ids = torch.randint(2, VOCAB, (length,), generator=generator).tolist()
        rows.append({"input_ids": ids, "attention_mask": [1] * length, "label": int(ids[0] < VOCAB // 2)})
    return Dataset.from_list(rows)


def save_tiny_sentence_encoder(path, pooling: str = "mean", normalize: bool = False, seed: int = 0) -> None:
    """Save a 2-layer BERT encoder at `path` as sentence-transformers does: the encoder, `modules.json` and
    `1_Pooling/config.json` with the given pooling flag (a `2_Normalize` module when `normalize`)."""
    import json
    import os

    from transformers import BertModel

    torch.manual_seed(seed)
    BertModel(tiny_bert_config()).save_pretrained(path)
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
    ]
    if normalize:
        modules.append(
            {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}
        )
    flags = {"cls": "pooling_mode_cls_token", "mean": "pooling_mode_mean_tokens", "max": "pooling_mode_max_tokens"}
    os.makedirs(os.path.join(path, "1_Pooling"), exist_ok=True)
    with open(os.path.join(path, "modules.json"), "w") as file:
        json.dump(modules, file)
    with open(os.path.join(path, "1_Pooling", "config.json"), "w") as file:
        json.dump({"word_embedding_dimension": 32, **{flag: mode == pooling for mode, flag in flags.items()}}, file)


def zo_args(tmp_path, **overrides):
    """A `ZOConfig` for a short CPU run writing under `tmp_path / "out"`: batch 4, 10 steps, lr and eps 1e-3, logging
    every 5 steps, no checkpoints, reports or progress bars; `overrides` replace any field."""
    from hf_zo import ZOConfig

    values = dict(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=4,
        learning_rate=1e-3,
        zo_eps=1e-3,
        max_steps=10,
        logging_steps=5,
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
        use_cpu=True,
    )
    values.update(overrides)
    return ZOConfig(**values)
