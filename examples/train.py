# Copyright 2026 The hf_zo authors. Licensed under the Apache License, Version 2.0.
"""Zeroth-order fine-tuning with `ZOTrainer`: causal LM, sequence classification, or MeZO-style prompt-based
classification, on a hub dataset or local CSV/TSV/JSON files, with full fine-tuning or PEFT.

Sequence classification of SST-2 from local files with LoRA (a sentence-transformers checkpoint's head reads its
mean-pooled embedding; the head is linear-probed, then trained first-order)::

    python examples/train.py --model_name_or_path sentence-transformers/all-MiniLM-L6-v2 --task_name sst2 \
        --train_file sst2/train.tsv --validation_file sst2/validation.tsv --num_train 4096 \
        --peft lora --learning_rate 1e-4 --zo_eps 1e-2 --max_steps 1000 --output_dir minilm-sst2-zo

Prompt-based classification the MeZO way on the embedded LLM (SmolLM2-135M-Instruct, offline: `hf-zo embedded-llm`
prints its folder), with the recipe measured best for LoRA on a prompt task (`--recipe prompt`: FZOO at 6e-5;
docs/prompts.md)::

    python examples/train.py --model_name_or_path "$(hf-zo embedded-llm)" --task_name sst2 \
        --train_file examples/data/sst2/train.tsv --validation_file examples/data/sst2/validation.tsv \
        --peft lora --recipe prompt --max_steps 200 --output_dir smollm2-sst2-zo

Prompt-based classification the MeZO way (OPT scores " terrible" / " great" after "<sentence> It was")::

    accelerate launch examples/train.py --model_name_or_path facebook/opt-1.3b --task_name sst2 \
        --task_type prompt_classification --num_train 1000 --learning_rate 1e-6 --zo_eps 1e-3 \
        --max_steps 20000 --output_dir opt-sst2-mezo --push_to_hub

The same on a 4-bit base (bitsandbytes, QLoRA's base: ZO trains the adapter only; docs/quantization.md)::

    python examples/train.py --model_name_or_path "$(hf-zo embedded-llm)" --task_name sst2 \
        --train_file sst2/train.tsv --validation_file sst2/validation.tsv --num_train 4096 \
        --peft lora --load_in_4bit --max_steps 200 --output_dir smollm2-sst2-zo-4bit

Causal LM on a text column::

    python examples/train.py --model_name_or_path gpt2 --train_file notes.jsonl --text_column text \
        --peft lora --learning_rate 1e-4 --zo_eps 1e-2 --max_steps 2000 --output_dir gpt2-notes-zo

Every `ZOConfig` (and `TrainingArguments`) option is a flag: `python examples/train.py --help`.
"""

from __future__ import annotations

import csv
import dataclasses
import inspect
import json
import math
import os
import sys
from dataclasses import dataclass, field

import torch
import yaml
from datasets import ClassLabel, DatasetDict, load_dataset
from datasets.exceptions import DatasetGenerationError
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    DataCollatorForLanguageModeling,
    DataCollatorWithPadding,
    HfArgumentParser,
    set_seed,
)
from transformers.integrations import get_available_reporting_integrations

from hf_zo import PooledEncoderConfig, ZOConfig, ZOTrainer, load_sequence_classifier
from hf_zo.metrics import build_compute_metrics
from hf_zo.models import base_quantization_config, from_pretrained_quantized, norm_module_names
from hf_zo.peft_warnings import ignore_peft_warnings
from hf_zo.prompts import PROMPT_LOSSES, PROMPT_TASKS, PromptClassification, PromptTask
from hf_zo.training import PROMPT_ZO_DEFAULTS, prompt_lora_layers, prompt_lora_target_modules
from hf_zo.training.checkpointing import saved_run_files

ignore_peft_warnings()  # LN tuning's and get_peft_model's warnings, printed on every run: nothing to act on

# ---------------------------------------------------------------------- tasks


TASK_TYPES = ("auto", "causal_lm", "classification", "prompt_classification")


@dataclass
class ModelArguments:
    """What is trained and how: the model, the kind of task, and the PEFT method."""

    model_name_or_path: str = field(metadata={"help": "Hub id or local path of the pretrained model."})
    task_type: str = field(
        default="auto",
        metadata={
            "help": "causal_lm (a text column), classification (a sequence-classification head) or "
            "prompt_classification (MeZO's label-word scoring with a causal LM); auto: causal_lm without "
            "--task_name, else prompt_classification for a causal LM and classification otherwise.",
            "choices": list(TASK_TYPES),
        },
    )
    peft: str | None = field(
        default=None,
        metadata={
            "help": "PEFT method (default, or none: full fine-tuning); ln_tuning: the normalisation layers only.",
            "choices": ["none", "lora", "ln_tuning", "prefix", "prompt"],
        },
    )
    lora_r: int = field(default=8, metadata={"help": "LoRA rank."})
    lora_alpha: int = field(default=16, metadata={"help": "LoRA alpha."})
    lora_dropout: float = field(default=0.0, metadata={"help": "LoRA dropout (ZO forwards run in eval mode)."})
    lora_target_modules: list[str] | None = field(
        default=None,
        metadata={
            "help": "LoRA target modules (default: q_proj for a prompt task on a causal LM that has it, "
            "hf_zo.training.PROMPT_LORA_TARGET_MODULES; else PEFT's choice for the architecture)."
        },
    )
    lora_layers_to_transform: list[int] | None = field(
        default=None,
        metadata={
            "help": "Layer indices LoRA adapts (default: with the default targets of a prompt task, the upper two "
            "thirds of the layers, hf_zo.training.prompt_lora_layers; else every layer)."
        },
    )
    recipe: str = field(
        default="none",
        metadata={
            "help": "prompt: the setting measured best for LoRA on a prompt task (hf_zo.training.PROMPT_ZO_DEFAULTS: "
            "FZOO, 4 Rademacher estimates, lr 6e-5, eps 1e-2; flags given for these still win; docs/prompts.md). "
            "none (the default): ZOConfig's defaults (MeZO's ZO-SGD, the rate and eps of the PEFT method).",
            "choices": ["none", "prompt"],
        },
    )
    num_virtual_tokens: int = field(default=10, metadata={"help": "Virtual tokens of prefix and prompt tuning."})
    prompt_init_text: str | None = field(
        default=None, metadata={"help": "Initialise prompt tuning from this text (default: random)."}
    )
    torch_dtype: str = field(
        default="float32", metadata={"help": "Weights dtype.", "choices": ["float32", "bfloat16", "float16"]}
    )
    load_in_4bit: bool = field(
        default=False,
        metadata={
            "help": "Load the base in 4 bits with bitsandbytes (QLoRA's base; needs --peft: ZO trains the adapter and "
            'never writes a quantized weight). Needs pip install "hf-zo[quant]"; see docs/quantization.md.'
        },
    )
    load_in_8bit: bool = field(
        default=False, metadata={"help": "Load the base in 8 bits with bitsandbytes (needs --peft)."}
    )
    bnb_4bit_quant_type: str = field(
        default="nf4", metadata={"help": "The 4-bit data type of --load_in_4bit.", "choices": ["nf4", "fp4"]}
    )
    use_bnb_nested_quant: bool = field(
        default=False, metadata={"help": "Quantize the 4-bit scales too (double quantization)."}
    )
    overwrite_output_dir: bool = field(
        default=False,
        metadata={
            "help": "Train into an --output_dir that already holds a run or model, replacing it (without this flag "
            "such a folder is refused unless --resume_from_checkpoint continues it)."
        },
    )

    def __post_init__(self):
        if self.peft == "none":  # so that a config file's method can be switched off from the command line
            self.peft = None
        path = self.model_name_or_path
        if (os.path.isabs(path) or path.startswith(("./", "../"))) and not os.path.isdir(path):
            raise ValueError(f"--model_name_or_path {path} is not a folder: give a saved model's folder or a Hub id.")


@dataclass
class DataArguments:
    """Which data, and how much of it."""

    task_name: str | None = field(
        default=None, metadata={"help": "A ready classification task.", "choices": list(PROMPT_TASKS)}
    )
    dataset_name: str | None = field(default=None, metadata={"help": "Hub dataset (default: the task's)."})
    dataset_config_name: str | None = field(default=None, metadata={"help": "Hub dataset configuration."})
    train_file: str | None = field(default=None, metadata={"help": "Local training file (.csv, .tsv, .json, .jsonl)."})
    validation_file: str | None = field(default=None, metadata={"help": "Local validation file."})
    text_column: str | None = field(
        default=None,
        metadata={
            "help": "Text column of data without --task_name (default: 'text' for causal LM, 'sentence' for "
            "classification)."
        },
    )
    label_column: str = field(default="label", metadata={"help": "Label column of classification data."})
    num_train: int | None = field(default=None, metadata={"help": "Sample this many training examples (MeZO: 1000)."})
    num_eval: int | None = field(default=None, metadata={"help": "Sample this many validation examples."})
    max_length: int = field(default=256, metadata={"help": "Maximum tokens per example."})
    template: str | None = field(default=None, metadata={"help": "Prompt template (default: the task's)."})
    label_words: list[str] | None = field(default=None, metadata={"help": "Label words (default: the task's)."})
    prompt_loss: str = field(
        default="classification",
        metadata={
            "help": "Training loss of prompt classification: cross-entropy over the label words (MeZO's "
            "train_as_classification) or over the whole vocabulary ('lm').",
            "choices": list(PROMPT_LOSSES),
        },
    )

    def __post_init__(self):
        for name in ("num_train", "num_eval", "max_length"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"--{name} must be at least 1, got {value}; leave it out for its default.")
        if self.text_column is not None and self.task_name is not None:
            fields = PROMPT_TASKS[self.task_name].fields
            raise ValueError(
                f"--text_column {self.text_column} applies to data without --task_name; --task_name "
                f"{self.task_name} reads the columns {list(fields)}: rename the file's columns to them, or leave out "
                "--task_name."
            )


# ---------------------------------------------------------------------- data


def load_raw_datasets(data: DataArguments, seed: int) -> DatasetDict:
    """Load the train/validation splits from local files or the Hub and sample `num_train` / `num_eval`."""
    if data.train_file or data.validation_file:
        files = {s: f for s, f in (("train", data.train_file), ("validation", data.validation_file)) if f}
        # .json and .jsonl are one format to the `json` loader (JSON Lines or one JSON document per file)
        extensions = {os.path.splitext(f)[1].lower().replace(".jsonl", ".json") for f in files.values()}
        if len(extensions) != 1 or extensions - {".csv", ".tsv", ".json"}:
            raise ValueError(
                f"Local files must all be .csv, all .tsv or all .json/.jsonl, got {sorted(files.values())}."
            )
        extension = extensions.pop()
        try:
            if extension == ".tsv":
                raw = load_dataset("csv", data_files=files, delimiter="\t", quoting=csv.QUOTE_NONE)
            else:
                raw = load_dataset("json" if extension == ".json" else "csv", data_files=files)
        except DatasetGenerationError as error:  # the reason is in its cause; the message only says it failed
            raise ValueError(
                f"Could not read {sorted(files.values())}: {str(error.__cause__ or error).rstrip('.')}. Each file "
                "needs a header row (for .csv/.tsv) and at least one example."
            ) from error
    elif data.dataset_name or data.task_name:
        name, config = (data.dataset_name, data.dataset_config_name)
        if name is None:
            name, config = PROMPT_TASKS[data.task_name].hub
        raw = load_dataset(name, config)
        raw = DatasetDict({s: raw[s] for s in ("train", "validation") if s in raw})
    else:
        raise ValueError("No data: pass --task_name, --dataset_name, or --train_file/--validation_file.")
    for split, count in (("train", data.num_train), ("validation", data.num_eval)):
        if count is not None and split in raw and count < len(raw[split]):
            raw[split] = raw[split].shuffle(seed=seed).select(range(count))
    return raw


def task_fields(data: DataArguments) -> tuple[PromptTask | None, tuple[str, ...]]:
    task = PROMPT_TASKS.get(data.task_name) if data.task_name else None
    fields = task.fields if task else (data.text_column or "sentence",)
    return task, fields


def number_text_labels(raw: DatasetDict, data: DataArguments) -> tuple[DatasetDict, list[str] | None]:
    """Labels numbered 0 to n - 1 in sorted order over every split, as transformers' `run_glue.py` numbers a local
    file's labels: text labels (`positive`, `negative`), and integer labels that are not 0 to n - 1 already (star
    ratings 1 to 5 become 0 to 4, named "1" to "5"); integer labels 0 to n - 1 are left as they are.

    Returns:
        `tuple[DatasetDict, list[str] | None]`: the data with integer labels, and the label names (`None` when the
        labels were 0 to n - 1 already).
    """
    column = data.label_column
    labelled = [d for d in raw.values() if column in d.column_names]
    task = PROMPT_TASKS[data.task_name] if data.task_name is not None else None
    if all(getattr(d.features[column], "dtype", "").startswith(("int", "uint")) for d in labelled):  # or ClassLabel
        if not labelled or any(isinstance(d.features[column], ClassLabel) for d in labelled):
            return raw, None  # a Hub dataset's ClassLabel has numbered its labels already
        values = sorted({int(label) for d in labelled for label in d.unique(column)})
        if task is not None:
            if values and (values[0] < 0 or values[-1] >= len(task.label_words)):
                raise ValueError(
                    f"--task_name {data.task_name} numbers its labels 0 to {len(task.label_words) - 1} (label words "
                    f"{list(task.label_words)}), but the '{column}' column holds {values[:5]}: write the labels as "
                    "those integers, or leave out --task_name to have the labels numbered in sorted order."
                )
            return raw, None
        if values == list(range(len(values))):
            return raw, None
        index = {value: i for i, value in enumerate(values)}
        names = [str(value) for value in values]
        raw = raw.map(lambda batch: {column: [index[int(v)] for v in batch[column]]}, batched=True)
        return raw.cast_column(column, ClassLabel(names=names)), names
    names = sorted({str(label) for d in labelled for label in d.unique(column)})
    if task is not None:
        raise ValueError(
            f"--task_name {data.task_name} numbers its labels 0 to {len(task.label_words) - 1} (label words "
            f"{list(task.label_words)}), but the '{column}' column holds {names[:5]}: write the labels as those "
            "integers, or leave out --task_name to have text labels numbered in sorted order."
        )
    return raw.cast_column(column, ClassLabel(names=names)), names


def check_columns(raw: DatasetDict, data: DataArguments, needed: list[str], fix: str) -> None:
    """Fail before tokenizing when a split lacks a column the task reads, with the columns it has and `fix`."""
    sources = {"train": data.train_file, "validation": data.validation_file}
    for split, dataset in raw.items():
        missing = [column for column in needed if column not in dataset.column_names]
        if missing:
            source = sources.get(split) or data.dataset_name or f"--task_name {data.task_name}"
            raise ValueError(
                f"The {split} data ({source}) has no column {missing}; its columns are {dataset.column_names}. {fix}"
            )


def tokenize_classification(raw: DatasetDict, tokenizer, data: DataArguments) -> DatasetDict:
    """Tokenize the input field (or field pair) for a sequence classifier; keep `label`."""
    _, fields = task_fields(data)
    check_columns(
        raw,
        data,
        [*fields, data.label_column],
        "Rename the columns to these, or without --task_name name yours with --text_column and --label_column.",
    )

    def tokenize(batch):
        texts = [batch[f] for f in fields]
        encoded = tokenizer(*texts, truncation=True, max_length=data.max_length)
        encoded["label"] = batch[data.label_column]
        return encoded

    return raw.map(
        tokenize, batched=True, remove_columns=raw["train" if "train" in raw else "validation"].column_names
    )


def tokenize_causal_lm(raw: DatasetDict, tokenizer, data: DataArguments) -> DatasetDict:
    """Tokenize the text column for causal LM training."""
    column = data.text_column or "text"
    check_columns(raw, data, [column], "Set --text_column to the column that holds the text.")

    def tokenize(batch):
        return tokenizer(batch[column], truncation=True, max_length=data.max_length)

    return raw.map(
        tokenize, batched=True, remove_columns=raw["train" if "train" in raw else "validation"].column_names
    )


def prompt_classification(tokenizer, data: DataArguments) -> PromptClassification:
    """The prompt task of the arguments: `--template` and `--label_words`, or the `--task_name`'s."""
    task, _ = task_fields(data)
    template = data.template or (task.template if task else None)
    words = data.label_words or (task.label_words if task else None)
    if template is None or words is None:
        raise ValueError("Prompt-based classification needs --template and --label_words (or a --task_name).")
    return PromptClassification(
        tokenizer, template, words, loss=data.prompt_loss, max_length=data.max_length, label_column=data.label_column
    )


def tokenize_prompts(raw: DatasetDict, prompts: PromptClassification, data: DataArguments) -> DatasetDict:
    """Each example as its prompt's token ids and its label (MeZO's prompt-based classification)."""
    check_columns(
        raw,
        data,
        [*prompts.fields, data.label_column],
        "Rename the columns, or write a --template that formats the columns you have; --label_column names the "
        "label column.",
    )
    return prompts.tokenize(raw)


# ---------------------------------------------------------------------- model


def resolve_task_type(model_args: ModelArguments, data: DataArguments) -> str:
    """`--task_type`, or for `auto` the one the checkpoint's architecture (an adapter's base model's) implies."""
    if model_args.task_type != "auto":
        return model_args.task_type
    if data.task_name is None:
        return "causal_lm"
    architectures = AutoConfig.from_pretrained(base_model_path(model_args.model_name_or_path)).architectures or []
    causal = any(a.endswith(("ForCausalLM", "LMHeadModel")) for a in architectures)
    return "prompt_classification" if causal else "classification"


def is_prompt_task(model_args: ModelArguments, data: DataArguments) -> bool:
    """Whether the run is a prompt task; `False` for a model whose config cannot be read now (loading it fails later
    with its own message)."""
    try:
        return resolve_task_type(model_args, data) == "prompt_classification"
    except OSError:
        return False


def build_peft_config(model_args: ModelArguments, task_type: str, model):
    """The PEFT config of `--peft` (a classifier's head goes to `modules_to_save`, trained with the adapter)."""
    from peft import LNTuningConfig, LoraConfig, PrefixTuningConfig, PromptTuningConfig, PromptTuningInit, TaskType
    from peft.utils import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING

    peft_task = TaskType.SEQ_CLS if task_type == "classification" else TaskType.CAUSAL_LM
    if model_args.peft == "lora":
        target_modules = model_args.lora_target_modules
        if target_modules is None and isinstance(model.config, PooledEncoderConfig):
            # PEFT picks LoRA's targets by model type; a pooled encoder's are those of its encoder.
            target_modules = TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING.get(model.config.encoder.model_type)
        layers = model_args.lora_layers_to_transform
        if target_modules is None and task_type == "prompt_classification":
            target_modules = prompt_lora_target_modules(model)
            if target_modules is not None and layers is None:
                layers = prompt_lora_layers(model)
        module_names = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
        unknown = [name for name in target_modules or () if name not in module_names]
        if unknown:
            linear = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)})
            raise ValueError(
                f"--lora_target_modules: {type(model).__name__} has no module named {unknown}; its linear layers are "
                f"named {linear}."
            )
        return LoraConfig(
            task_type=peft_task,
            r=model_args.lora_r,
            lora_alpha=model_args.lora_alpha,
            lora_dropout=model_args.lora_dropout,
            target_modules=target_modules,
            layers_to_transform=layers,
        )
    if model_args.peft == "ln_tuning":
        return LNTuningConfig(task_type=peft_task, target_modules=norm_module_names(model))
    if model_args.peft == "prefix":
        # For a classifier PEFT hands the prefix to the model as `past_key_values`, which BERT-style encoders (and
        # transformers 5's classifiers generally) do not take; causal LMs get it through their cache.
        takes_prefix = any(
            "past_key_values" in inspect.signature(m.forward).parameters for m in (model, model.base_model)
        )
        if task_type == "classification" and not takes_prefix:
            raise ValueError(
                f"--peft prefix needs a classifier that takes past_key_values, and {type(model).__name__} does not. "
                "Use --peft prompt (virtual tokens in the input), lora or ln_tuning."
            )
        return PrefixTuningConfig(task_type=peft_task, num_virtual_tokens=model_args.num_virtual_tokens)
    init = PromptTuningInit.TEXT if model_args.prompt_init_text else PromptTuningInit.RANDOM
    return PromptTuningConfig(
        task_type=peft_task,
        num_virtual_tokens=model_args.num_virtual_tokens,
        prompt_tuning_init=init,
        prompt_tuning_init_text=model_args.prompt_init_text,
        tokenizer_name_or_path=model_args.model_name_or_path if model_args.prompt_init_text else None,
    )


def base_model_path(model_name_or_path: str) -> str:
    """The base model that a folder saved with `--peft` (an adapter) names; any other path unchanged."""
    if os.path.isfile(os.path.join(model_name_or_path, "adapter_config.json")):
        from peft import PeftConfig

        return PeftConfig.from_pretrained(model_name_or_path).base_model_name_or_path
    return model_name_or_path


def load_model(model_args: ModelArguments, task_type: str, num_labels: int | None, tokenizer, trainable: bool = True):
    """The model of the task; a sentence-transformers checkpoint's classifier uses the checkpoint's pooling. A folder
    saved with `--peft` (an adapter) loads onto the base model it names, and is trainable only if `trainable`."""
    adapter_path = model_args.model_name_or_path
    if (base := base_model_path(adapter_path)) != adapter_path:
        from peft import PeftModel

        base_args = dataclasses.replace(model_args, model_name_or_path=base, peft=None)
        model = load_model(base_args, task_type, num_labels, tokenizer)
        return PeftModel.from_pretrained(model, adapter_path, is_trainable=trainable)
    dtype = getattr(torch, model_args.torch_dtype)
    kwargs = {"dtype": dtype}
    quantization = base_quantization_config(
        load_in_4bit=model_args.load_in_4bit,
        load_in_8bit=model_args.load_in_8bit,
        bnb_4bit_quant_type=model_args.bnb_4bit_quant_type,
        use_bnb_nested_quant=model_args.use_bnb_nested_quant,
        compute_dtype=dtype,
    )
    if quantization is not None:
        # No peft.prepare_model_for_kbit_training: what it sets up (gradient checkpointing, inputs that require
        # gradients) serves a backward pass, and PEFT already keeps the adapter in float32.
        kwargs["quantization_config"] = quantization
    if task_type == "classification":
        model = load_sequence_classifier(model_args.model_name_or_path, num_labels=num_labels, **kwargs)
        if model.config.pad_token_id is None:
            model.config.pad_token_id = tokenizer.pad_token_id
    else:
        # A base quantized on load reads its float checkpoint one tensor at a time (from_pretrained_quantized)
        model = from_pretrained_quantized(AutoModelForCausalLM, model_args.model_name_or_path, **kwargs)
    if model_args.peft:
        from peft import get_peft_model

        model = get_peft_model(model, build_peft_config(model_args, task_type, model))
    return model


# ---------------------------------------------------------------------- main


def check_prompt_recipe(model_args: ModelArguments, data: DataArguments, args: ZOConfig) -> None:
    """`--recipe prompt` is measured for LoRA on a prompt task with FZOO, which runs on the sequential engine of one
    process group; anything else fails here, naming the flag to change."""
    if model_args.peft != "lora":
        raise ValueError(f"--recipe prompt trains LoRA: add --peft lora (got --peft {model_args.peft}).")
    if not is_prompt_task(model_args, data):
        raise ValueError(
            "--recipe prompt is for a prompt task (--task_type prompt_classification, or a causal LM with "
            "--task_name): leave --recipe out for this run."
        )
    if args.zo_engine != "sequential" or args.zo_offload or args.zo_perturbation_parallel_size > 1:
        raise ValueError(
            "--recipe prompt trains with FZOO, which runs on the sequential engine without offload or perturbation "
            "parallelism: leave --recipe out (MeZO's ZO-SGD runs them) or drop --zo_engine/--zo_offload/"
            "--zo_perturbation_parallel_size."
        )


CONFIG_FILE_SUFFIXES = (".json", ".yaml", ".yml")


def parse_arguments(argv: list[str]) -> tuple[ModelArguments, DataArguments, ZOConfig]:
    """The script's arguments: flags, or a JSON/YAML file of them first and flags after it that override its values
    (`python examples/train.py config.yaml --max_steps 100`), as TRL's scripts take a `--config` file."""
    parser = HfArgumentParser((ModelArguments, DataArguments, ZOConfig))
    values = {}
    if argv and argv[0].endswith(CONFIG_FILE_SUFFIXES):
        with open(argv[0], encoding="utf-8") as file:
            values = yaml.safe_load(file) if argv[0].endswith(("yaml", "yml")) else json.load(file)
        if not isinstance(values, dict):
            raise ValueError(
                f"{argv[0]} must hold a mapping of argument names to values, got {type(values).__name__}."
            )
        unknown = sorted(set(values) - {action.dest for action in parser._actions})
        if unknown:
            raise ValueError(f"{argv[0]} sets unknown arguments {unknown}; see `python examples/train.py --help`.")
        for action in parser._actions:  # defaults skip argparse's own check of `choices`
            if action.choices is not None and action.dest in values and values[action.dest] not in action.choices:
                raise ValueError(
                    f"{argv[0]} sets {action.dest} to {values[action.dest]!r}; choose one of {list(action.choices)}."
                )
        # A string default goes through the argument's type as a flag would (YAML reads 1e-3 as a string).
        parser.set_defaults(**values)
        for action in parser._actions:
            action.required = action.required and action.dest not in values
        argv = argv[1:]
    model_args, data, args = parser.parse_args_into_dataclasses(argv)
    if model_args.recipe == "prompt":
        # The recipe's values are defaults: a flag (or a config file's value) given for one of them still wins.
        check_prompt_recipe(model_args, data, args)
        parser.set_defaults(**{name: value for name, value in PROMPT_ZO_DEFAULTS.items() if name not in values})
        model_args, data, args = parser.parse_args_into_dataclasses(argv)
    return model_args, data, args


def main(argv: list[str] | None = None) -> tuple[ZOTrainer, dict[str, float]]:
    """Parse the arguments, train, save, evaluate (and push to the Hub).

    Returns:
        `tuple[ZOTrainer, dict[str, float]]`: the trainer and the final evaluation metrics (empty without data).
    """
    model_args, data, args = parse_arguments(sys.argv[1:] if argv is None else argv)
    missing = sorted(set(args.report_to) - set(get_available_reporting_integrations()))
    if missing:  # Trainer would stop on it only after the data and the model are loaded
        raise ValueError(
            f"--report_to {' '.join(missing)}: not installed here; install it (e.g. pip install tensorboard) or "
            "pass --report_to none."
        )
    if args.do_predict:  # a TrainingArguments flag that would otherwise be silently ignored
        raise ValueError(
            "--do_predict: this script trains and evaluates but writes no predictions; load the saved model and call "
            "Trainer.predict (or the model) on your data, as examples/README.md shows."
        )

    if should_train(args):
        check_output_dir(model_args, args)

    task_type = resolve_task_type(model_args, data)
    tokenizer = AutoTokenizer.from_pretrained(model_args.model_name_or_path)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    with args.main_process_first(desc="dataset loading"):
        raw = load_raw_datasets(data, args.seed)
        label_names = None
        if task_type != "causal_lm":
            raw, label_names = number_text_labels(raw, data)
        if task_type == "classification":
            datasets = tokenize_classification(raw, tokenizer, data)
        elif task_type == "prompt_classification":
            datasets = tokenize_prompts(raw, prompt_classification(tokenizer, data), data)
        else:
            datasets = tokenize_causal_lm(raw, tokenizer, data)

    task, _ = task_fields(data)
    num_labels = None
    if task_type == "classification" and task:
        num_labels = len(task.label_words)
    elif task_type == "classification":
        num_labels = len(label_names or {label for split in datasets.values() for label in split.unique("label")})
    set_seed(args.seed)  # a new head and PEFT matrices are initialised from the global RNG: same start every run
    model = load_model(model_args, task_type, num_labels, tokenizer, trainable=should_train(args))
    if task_type == "classification" and label_names:
        config = model.get_base_model().config if hasattr(model, "get_base_model") else model.config
        config.id2label, config.label2id = dict(enumerate(label_names)), {n: i for i, n in enumerate(label_names)}

    kwargs = {}
    if task_type == "causal_lm":
        kwargs["data_collator"] = DataCollatorForLanguageModeling(tokenizer, mlm=False)
    else:
        metrics = task.metrics if task else ("accuracy",)
        kwargs["compute_metrics"] = build_compute_metrics(metrics)
        if task_type == "prompt_classification":
            kwargs.update(prompt_classification(tokenizer, data).trainer_kwargs())
            args.label_names = ["labels"]  # PEFT's wrapper hides the model's `labels` argument from Trainer
        else:
            kwargs["data_collator"] = DataCollatorWithPadding(tokenizer)
    trainer = ZOTrainer(
        model=model,
        args=args,
        train_dataset=datasets.get("train") if should_train(args) else None,
        eval_dataset=datasets.get("validation"),
        processing_class=tokenizer,
        **kwargs,
    )

    metrics = {}
    if should_train(args):
        resume = args.resume_from_checkpoint  # a folder, or "true" for the last checkpoint in --output_dir
        result = trainer.train(resume_from_checkpoint=True if str(resume).lower() == "true" else resume)
        if not args.push_to_hub:  # push_to_hub saves, writes the card and uploads in one go
            trainer.save_model()
        trainer.log_metrics("train", result.metrics)
        trainer.save_metrics("train", result.metrics)
        trainer.save_state()
    if "validation" in datasets:
        metrics = trainer.evaluate()
        if task_type == "causal_lm":
            metrics["perplexity"] = math.exp(min(metrics["eval_loss"], 50.0))
        trainer.log_metrics("eval", metrics)
        trainer.save_metrics("eval", metrics)
    if args.push_to_hub:
        card = {"finetuned_from": model_args.model_name_or_path, "tags": ["zeroth-order", "hf-zo"]}
        if data.task_name:
            card["dataset"] = data.task_name
        trainer.push_to_hub(**card)
    return trainer, metrics


def check_output_dir(model_args: ModelArguments, args: ZOConfig) -> None:
    """Refuse, before anything loads, to train into a folder that holds another run or model: its checkpoints would
    be replaced or rotated away and its weights and trajectory overwritten."""
    held = saved_run_files(args.output_dir)
    if held and not args.resume_from_checkpoint and not model_args.overwrite_output_dir:
        listed = ", ".join(held[:3]) + (f" and {len(held) - 3} more" if len(held) > 3 else "")
        raise ValueError(
            f"--output_dir {args.output_dir} already holds a run or model ({listed}); training there would replace "
            "it. Continue it with --resume_from_checkpoint true, replace it with --overwrite_output_dir, or choose "
            "a new folder."
        )


def should_train(args: ZOConfig) -> bool:
    """Whether to train: always, unless only `--do_eval` was asked for (without `--do_train` and without an
    `--eval_strategy`, which `TrainingArguments` turns into `do_eval=True` but which means "evaluate while training").
    """
    return args.do_train or not args.do_eval or args.eval_strategy != "no"


def run_cli() -> int:
    """`main()` for the command line: a bad argument, file or checkpoint ends in its message and exit code 2.

    hf_zo's errors say what was wrong and how to fix it; the traceback through transformers and torch adds
    nothing for a user. Set `HF_ZO_TRACEBACK=1` to see it anyway.
    """
    try:
        main()
    except (ValueError, TypeError, OSError, FloatingPointError) as error:
        if os.environ.get("HF_ZO_TRACEBACK") == "1":
            raise
        print(f"error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(run_cli())
