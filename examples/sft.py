# Copyright 2026 The hf_zo authors. Licensed under the Apache License, Version 2.0.
"""Zeroth-order supervised fine-tuning with `ZOSFTTrainer`, in the shape of TRL's `trl/scripts/sft.py`: the same
`TrlParser` flags (`ScriptArguments`, `ModelConfig` with `--use_peft`, every `ZOSFTConfig` option), with ZO's
optimizer. Data come from a Hub dataset (`--dataset_name`) or from local JSON/JSONL files (`--train_file`,
`--validation_file`) in any of TRL's formats (`messages`, `prompt`/`completion`, `text`)::

    python examples/sft.py --model_name_or_path "$(hf-zo embedded-llm)" --train_file chat.jsonl \
        --use_peft --lora_target_modules q_proj v_proj --max_steps 1000 --output_dir smollm2-chat-zo

with rows such as ``{"prompt": [{"role": "user", ...}], "completion": [{"role": "assistant", ...}]}`` (TRL trains
the completion only). `--assistant_only_loss true` over `messages` rows needs a chat template with
``{% generation %}`` markers, which SmolLM2's lacks: TRL then refuses it, naming the template.

On a 4-bit base (QLoRA's, bitsandbytes; docs/quantization.md) add `--load_in_4bit` (or `--load_in_8bit`) to
`--use_peft`.

Leave `--learning_rate` and `--zo_eps` unset for ZO's defaults by method (docs/hyperparameters.md). The trained
adapter (with `--use_peft`) or model is saved in `--output_dir`. See docs/trl.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from datasets import load_dataset
from transformers import AutoModelForCausalLM
from trl import ModelConfig, ScriptArguments, TrlParser, get_peft_config, get_quantization_config

from hf_zo import ZOSFTConfig, ZOSFTTrainer
from hf_zo.models import from_pretrained_quantized


@dataclass
class DataFileArguments:
    """Local data files, as in examples/train.py (instead of `--dataset_name`)."""

    train_file: str | None = field(default=None, metadata={"help": "A JSON/JSONL file of training examples."})
    validation_file: str | None = field(default=None, metadata={"help": "A JSON/JSONL file of evaluation examples."})


def load_data(script_args: ScriptArguments, file_args: DataFileArguments):
    """The train and evaluation splits: from local files when given, else from the Hub dataset."""
    if file_args.train_file is not None:
        files = {"train": file_args.train_file}
        if file_args.validation_file is not None:
            files["validation"] = file_args.validation_file
        dataset = load_dataset("json", data_files=files)
        return dataset["train"], dataset.get("validation")
    if script_args.dataset_name is None:
        raise ValueError("Give --train_file (local JSON/JSONL) or --dataset_name (a Hub dataset).")
    dataset = load_dataset(script_args.dataset_name, name=script_args.dataset_config)
    return dataset[script_args.dataset_train_split], dataset.get(script_args.dataset_test_split)


def peft_config(model_args: ModelConfig):
    """TRL's `get_peft_config`, except that one plain module name stays a module name.

    `ModelConfig` turns a single `--lora_target_modules` value into a string (meant for `all-linear`), and PEFT
    reads a string as a regular expression over whole module paths: `--lora_target_modules q_proj` alone would
    match no module. A single name (`q_proj`) is kept as the set `{"q_proj"}`; `all-linear` and regular
    expressions are passed on as given.
    """
    config = get_peft_config(model_args)
    if config is not None and isinstance(config.target_modules, str) and config.target_modules.isidentifier():
        config.target_modules = {config.target_modules}
    return config


def make_parser() -> TrlParser:
    """TRL's flags (`ScriptArguments`, `ZOSFTConfig`, `ModelConfig`) and the local data files."""
    return TrlParser((ScriptArguments, ZOSFTConfig, ModelConfig, DataFileArguments))


def main(script_args, training_args, model_args, file_args) -> ZOSFTTrainer:
    """Train, save to `--output_dir` (and push with `--push_to_hub`); return the trainer."""
    training_args.model_init_kwargs = dict(
        revision=model_args.model_revision,
        trust_remote_code=training_args.trust_remote_code,
        attn_implementation=model_args.attn_implementation,
        dtype=model_args.dtype,
        **(training_args.model_init_kwargs or {}),
    )
    # --load_in_4bit / --load_in_8bit: a bitsandbytes base, with TRL's flags (with --use_peft: ZO trains the adapter,
    # in float32, and never writes a quantized weight). It is loaded here rather than by the trainer so that the float
    # checkpoint is read one tensor at a time (hf_zo.models.from_pretrained_quantized).
    model = model_args.model_name_or_path
    quantization_config = get_quantization_config(model_args)
    if quantization_config is not None:
        init_kwargs = training_args.model_init_kwargs
        if isinstance(init_kwargs.get("dtype"), str) and init_kwargs["dtype"] != "auto":
            init_kwargs["dtype"] = getattr(torch, init_kwargs["dtype"])
        model = from_pretrained_quantized(AutoModelForCausalLM, model, quantization_config, **init_kwargs)
        training_args.model_init_kwargs = None
    train_dataset, eval_dataset = load_data(script_args, file_args)
    trainer = ZOSFTTrainer(
        model=model,
        args=training_args,
        train_dataset=train_dataset,
        eval_dataset=eval_dataset if training_args.eval_strategy != "no" else None,
        peft_config=peft_config(model_args),
    )
    trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    trainer.save_model(training_args.output_dir)
    if training_args.push_to_hub:
        trainer.push_to_hub(dataset_name=script_args.dataset_name)
    return trainer


if __name__ == "__main__":
    main(*make_parser().parse_args_and_config())
