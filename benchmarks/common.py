"""What the benchmarks share: the repository's paths, random OPT models of a given shape, SST-2 from TSV files.

Scripts at the top of `benchmarks/` import it as `common` (Python puts a script's own folder on `sys.path`); the
research scripts, run as modules from the repository root (`python -m benchmarks.research.NAME`), as
`benchmarks.common`.
"""

from __future__ import annotations

import csv
import os
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SST2_DIR = ROOT / "examples" / "data" / "sst2"
"""SST-2's validation split and 4,096 training sentences, shipped with the examples (examples/data/README.md)."""


def random_opt(sizes: dict, lora: bool = False, device: str = "cpu", dtype: str = "float32", **config):
    """A random OPT with the given `sizes` (hidden_size, num_hidden_layers, ffn_dim, num_attention_heads, vocab_size),
    optionally with LoRA r=8 on q_proj and v_proj, built on `device` in `dtype`; `config` overrides `OPTConfig`."""
    import torch
    from transformers import OPTConfig, OPTForCausalLM

    torch.manual_seed(0)
    fields = dict(
        word_embed_proj_dim=sizes["hidden_size"], max_position_embeddings=2048, dropout=0.0, attention_dropout=0.0
    )
    config = OPTConfig(**sizes, **{**fields, **config})
    # Initialised where it will run: a 1.3B model's random init on the CPU alone costs more than its measurement.
    with torch.device(device):
        model = OPTForCausalLM(config).to(getattr(torch, dtype))
    if lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]))
    return model


def load_sst2(data_dir: str, tokenizer, num_train: int, num_eval: int | None, max_length: int, seed: int):
    """SST-2's `train.tsv` (`num_train` sampled with `seed`) and `validation.tsv` (the first `num_eval`, default all)
    from `data_dir`, tokenized and sorted by length."""
    from datasets import load_dataset

    files = {split: os.path.join(data_dir, f"{split}.tsv") for split in ("train", "validation")}
    data = load_dataset("csv", data_files=files, delimiter="\t", quoting=csv.QUOTE_NONE)
    train = data["train"].shuffle(seed=seed).select(range(min(num_train, len(data["train"]))))
    validation = data["validation"]
    if num_eval is not None:
        validation = validation.select(range(min(num_eval, len(validation))))

    def tokenize(batch):
        encoded = tokenizer(batch["sentence"], truncation=True, max_length=max_length)
        encoded["n"] = [len(ids) for ids in encoded["input_ids"]]
        return encoded

    # Sorted by length so that sequential passes (evaluation, the linear probe's feature collection) carry little
    # padding; training batches are drawn at random (grouped by length) whatever the order.
    return [
        d.map(tokenize, batched=True, remove_columns=["sentence"]).sort("n").remove_columns("n")
        for d in (train, validation)
    ]
