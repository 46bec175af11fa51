"""Learning curves of the embedded LLM on SST-2 as a prompt task: ZO variants against first-order AdamW.

The embedded causal LM (SmolLM2-135M-Instruct, `hf_zo.models.embedded_llm_path`) scores the label words after a
prompt (`hf_zo.prompts.PromptClassification`, MeZO's prompt-based classification) and is fine-tuned for a wall-time
budget of training (evaluation excluded), batch 16. Every variant starts from the model's zero-shot accuracy and is
evaluated on the full SST-2 validation set (872 sentences) every `budget / points` seconds. Peak resident memory is
measured over an evaluation pass at the training batch size (inference) and over training. Run one variant per
process, then merge (the figure and the table of docs/results/accuracy.md)::

    python -m benchmarks.research.llm_learning_curve --variants fzoo_lora --budget_minutes 20 --output /tmp/fzoo.json
    python -m benchmarks.research.llm_learning_curve --merge /tmp/fzoo.json /tmp/adamw.json \\
        --output docs/images/llm_learning_curve.json --figure docs/images/llm_learning_curve.png

`--dataset rotten_tomatoes` runs the same on a second sentiment set (Rotten Tomatoes' 8,530 movie-review snippets, 872
held out for evaluation); `--train_min_words 12` trains on SST-2's sentence-length entries only. `--heldout N`
evaluates on N sentences held out of the training set instead (to choose settings without touching the validation
set; `--heldout_min_words 12` holds out sentences as long as validation's, not the short phrases that make up most of
the training set); `--zero_shot` only prints each template's zero-shot accuracy on the evaluation set; `--step_cost`
only measures what a ZO step of each variant costs in forwards of the same batch (one batch of training prompts,
trained on again and again; each step paired with the forward timed right after it, as benchmarks/step_cost.py
does).

Variants (`--variants`): `fzoo_lora`, `fzoo_full` (FZOO, 4 one-sided Rademacher estimates around the centre loss,
step normalised by their spread), `mezo_lora`, `mezo_full` (MeZO's ZO-SGD), `adamw_lora`, `adamw_full` (first-order
`transformers.Trainer`), `mezo_ln`, `adamw_ln` (PEFT's LN tuning: the 61 RMSNorm weights, 35,136 parameters, against
LoRA's 460,800), `mezo_lora_fa` (LoRA-FA: LoRA whose random down-projections A stay as initialised, only B trained:
184,320 parameters), `prompt_defaults` (what `examples/train.py` trains a prompt task on a causal LM with: LoRA on
`hf_zo.training.prompt_lora_target_modules` of the layers `hf_zo.training.prompt_lora_layers`, the estimator
`hf_zo.training.PROMPT_ZO_DEFAULTS`, the learning rate and eps `ZOConfig` fills in), `mezo_defaults` (the same LoRA
with MeZO's ZO-SGD; `--set mezo_defaults.lora_layers=all` adapts every layer, as the defaults did until 2026-12-07),
`prompt_defaults_4bit` (the prompt defaults on a bitsandbytes NF4 base: `hf_zo.models.base_quantization_config`),
`qlora_prompt_defaults` (first-order QLoRA with the same LoRA: PEFT's `prepare_model_for_kbit_training` and AdamW).
LoRA: r 8, alpha 16, on q_proj and v_proj, as MeZO's LoRA runs (`--set mezo_lora.lora_target_modules='["q_proj"]'`
chooses others, `--set 'mezo_lora.lora_layers=[10, 11]'` the layers). `--template mezo` (default) is MeZO's
`{sentence} It was` / ` terrible`, ` great`; `--template review` is `Review: {sentence}\\nSentiment:` / ` negative`,
` positive`; `--template review_demos` is the review template after two demonstrations (one training phrase of
each class, chosen on held-out sentences by benchmarks/research/llm_demonstrations.py); the others (`--zero_shot`
compares them all, `--zero_shot_templates review,review_demos` some) include questions put through the model's chat
template (`chat_question`, ...), the label word the first token of the answer. The learning rate is constant unless
`--set` says otherwise: `--set mezo_lora.lr_scheduler_type=linear mezo_lora.max_steps=340` decays it linearly to zero
over 340 steps (about 20 minutes of MeZO on LoRA here), as `Trainer` does by default over `max_steps`.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import tempfile
import time

import torch
from datasets import DatasetDict, concatenate_datasets, load_dataset
from transformers import AutoModelForCausalLM, AutoTokenizer, Trainer, TrainerCallback, TrainingArguments

from benchmarks.common import SST2_DIR
from benchmarks.research.learning_curve import WallTimeBudget, read_movie_reviews
from hf_zo import ZOConfig, ZOTrainer
from hf_zo.demo.memory import PeakMemory
from hf_zo.metrics import build_compute_metrics
from hf_zo.models import base_quantization_config, embedded_llm_path, from_pretrained_quantized, norm_module_names
from hf_zo.prompts import PromptClassification
from hf_zo.training import PROMPT_ZO_DEFAULTS, prompt_lora_layers, prompt_lora_target_modules
from hf_zo.training.defaults import lora_target_names

TEMPLATES = {
    "mezo": ("{sentence} It was", (" terrible", " great")),
    "review": ("Review: {sentence}\nSentiment:", (" negative", " positive")),
    "movie_review": ("Movie review: {sentence}\nSentiment:", (" negative", " positive")),
    "sentence": ("Sentence: {sentence}\nSentiment:", (" negative", " positive")),
    "review_question": (
        "Review: {sentence}\nIs this review positive or negative?\nAnswer:",
        (" negative", " positive"),
    ),
    "review_good_bad": ("Review: {sentence}\nSentiment:", (" bad", " good")),
    "text": ("Text: {sentence}\nSentiment:", (" negative", " positive")),
    "overall": ("{sentence} Overall, the movie was", (" bad", " good")),
    "review_is": ("{sentence} The review is", (" negative", " positive")),
    "quoted_review": ('Movie review: "{sentence}"\nThe sentiment of this review is', (" negative", " positive")),
    # The review template after two demonstrations, one of each class (in-context examples, as LM-BFF's): SST-2
    # training phrases outside the held-out slice, the pair and order chosen on it
    # (benchmarks/research/llm_demonstrations.py).
    "review_demos": (
        "Review: chai 's structure and pacing are disconcertingly slack .\nSentiment: negative\n\n"
        "Review: i liked about schmidt a lot ,\nSentiment: positive\n\n"
        "Review: {sentence}\nSentiment:",
        (" negative", " positive"),
    ),
}
# User turns rendered through the model's chat template (its default system prompt), the label word the answer's
# first token: the instruct model asked as it was tuned to be asked.
CHAT_QUESTIONS = {
    "chat_question": "Is this movie review positive or negative?\n{sentence}",
    "chat_review": "Review: {sentence}\nIs this review positive or negative? Answer with one word.",
    "chat_sentiment": "What is the sentiment of this movie review, positive or negative?\n{sentence}",
}


def templates(tokenizer) -> dict[str, tuple[str, tuple[str, ...]]]:
    """Every template by name: :data:`TEMPLATES`, and :data:`CHAT_QUESTIONS` through `tokenizer`'s chat template."""
    chat = {
        name: (
            tokenizer.apply_chat_template(
                [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=False
            ),
            ("negative", "positive"),
        )
        for name, question in CHAT_QUESTIONS.items()
    }
    return {**TEMPLATES, **chat}


LORA = {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"]}
DEFAULT_SEED = 42  # the seed of every run in docs/results/accuracy.md that names none

# name: what is trained ("lora" or "full"), by whom ("zo" or "adamw"), and the ZOConfig / TrainingArguments fields
VARIANTS: dict[str, dict] = {
    "fzoo_lora": {
        "method": "lora",
        "trainer": "zo",
        "zo_optimizer": "fzoo",
        "zo_num_perturbations": 4,
        "zo_noise": "rademacher",
        "learning_rate": 3e-5,
        "zo_eps": 1e-2,
    },
    "fzoo_full": {
        "method": "full",
        "trainer": "zo",
        "zo_optimizer": "fzoo",
        "zo_num_perturbations": 4,
        "zo_noise": "rademacher",
        "learning_rate": 1e-6,
        "zo_eps": 1e-3,
    },
    "mezo_lora": {"method": "lora", "trainer": "zo", "zo_optimizer": "zo_sgd", "learning_rate": 2e-3, "zo_eps": 1e-2},
    "mezo_lora_fa": {
        "method": "lora_fa",
        "trainer": "zo",
        "zo_optimizer": "zo_sgd",
        "learning_rate": 2e-3,
        "zo_eps": 1e-2,
    },
    "mezo_defaults": {"method": "lora_prompt_default", "trainer": "zo"},
    "prompt_defaults": {"method": "lora_prompt_default", "trainer": "zo", **PROMPT_ZO_DEFAULTS},
    "mezo_full": {"method": "full", "trainer": "zo", "zo_optimizer": "zo_sgd", "learning_rate": 1e-6, "zo_eps": 1e-3},
    "mezo_ln": {"method": "ln", "trainer": "zo", "zo_optimizer": "zo_sgd", "learning_rate": 3e-3, "zo_eps": 1e-3},
    "adamw_lora": {"method": "lora", "trainer": "adamw", "learning_rate": 2e-4},
    "adamw_full": {"method": "full", "trainer": "adamw", "learning_rate": 1e-5},
    "adamw_ln": {"method": "ln", "trainer": "adamw", "learning_rate": 1e-3},
    # The prompt defaults on a bitsandbytes NF4 base (compute in float32), and first-order QLoRA on it with the same
    # LoRA: PEFT's prepare_model_for_kbit_training, then AdamW at adamw_lora's rate.
    "prompt_defaults_4bit": {
        "method": "lora_prompt_default",
        "trainer": "zo",
        "load_in_4bit": True,
        **PROMPT_ZO_DEFAULTS,
    },
    "qlora_prompt_defaults": {
        "method": "lora_prompt_default",
        "trainer": "adamw",
        "load_in_4bit": True,
        "learning_rate": 2e-4,
    },
}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data_dir", default=str(SST2_DIR), help="Folder with train.tsv and validation.tsv.")
    parser.add_argument(
        "--dataset",
        default="sst2",
        choices=["sst2", "rotten_tomatoes"],
        help="SST-2 from --data_dir, or a second sentiment set: Rotten Tomatoes (the `movie-reviews` package), 872 "
        "of its sentences held out for evaluation and the rest to train on.",
    )
    parser.add_argument("--model", default=None, help="Model path (default: the embedded LLM).")
    parser.add_argument("--variants", default="fzoo_lora", help=f"Comma-separated subset of {list(VARIANTS)}.")
    parser.add_argument(
        "--template", default="mezo", choices=[*TEMPLATES, *CHAT_QUESTIONS], help="The prompt and label words."
    )
    parser.add_argument("--loss", default="classification", choices=["classification", "lm"])
    parser.add_argument(
        "--set", nargs="*", default=[], help="Overrides, e.g. fzoo_lora.learning_rate=3e-5 (JSON, else a string)."
    )
    parser.add_argument("--budget_minutes", type=float, default=20.0, help="Training wall time of each variant.")
    parser.add_argument("--points", type=int, default=4, help="Evaluations after the first one, evenly in time.")
    parser.add_argument("--max_steps", type=int, default=None, help="Also stop after this many optimizer steps.")
    parser.add_argument("--num_train", type=int, default=8192, help="Training sentences sampled from train.tsv.")
    parser.add_argument("--heldout", type=int, default=None, help="Evaluate on this many held-out training sentences.")
    parser.add_argument(
        "--heldout_min_words",
        type=int,
        default=0,
        help="Hold out only training sentences of at least this many words (validation's are 19.5 words on average, "
        "the training set's phrases 9.4: 12 gives a held-out slice that reads like validation).",
    )
    parser.add_argument(
        "--train_min_words",
        type=int,
        default=0,
        help="Train only on sentences of at least this many words (SST-2's training set is mostly phrases; its "
        "20,358 entries of 12 words or more read like the validation sentences, as the sentence-level SST-2 that "
        "MeZO trains on does).",
    )
    parser.add_argument(
        "--average_decays",
        type=float,
        nargs="*",
        default=[],
        help="Also evaluate exponential moving averages of the trained weights at these decays at every point.",
    )
    parser.add_argument("--batch_size", type=int, default=16)
    parser.add_argument("--seed", type=int, default=DEFAULT_SEED)
    parser.add_argument("--zero_shot", action="store_true", help="Only print each template's zero-shot accuracy.")
    parser.add_argument(
        "--zero_shot_templates", default=None, help="With --zero_shot: only these templates (comma-separated)."
    )
    parser.add_argument("--step_cost", action="store_true", help="Only measure each ZO step in forwards.")
    parser.add_argument("--output", default="llm_learning_curve.json", help="Where the JSON goes.")
    parser.add_argument(
        "--figure", default=None, help="Where the figure goes (default: beside --output, with the suffix .png)."
    )
    parser.add_argument("--merge", nargs="*", default=None, help="Join these runs' JSON files into one.")
    return parser.parse_args()


def read_sst2(data_dir: str):
    """SST-2's `train.tsv` and `validation.tsv` in `data_dir`, as a `DatasetDict`."""
    files = {split: os.path.join(data_dir, f"{split}.tsv") for split in ("train", "validation")}
    return load_dataset("csv", data_files=files, delimiter="\t", quoting=3)


def read_results(paths: list[str]) -> list[dict]:
    """The runs in these JSON files, in order (for `--merge`)."""
    results = []
    for path in paths:
        with open(path) as file:
            results += json.load(file)["results"]
    return results


def read_rotten_tomatoes(num_eval: int, seed: int):
    """Rotten Tomatoes' 8,530 sentences (Pang and Lee's movie-review snippets), as a `DatasetDict` of SST-2's columns:
    `num_eval` sentences as `validation`, the rest as `train`."""
    data = read_movie_reviews("rotten_tomatoes")
    data = data.rename_column("text", "sentence").remove_columns("source").shuffle(seed=seed)
    return DatasetDict(train=data.select(range(num_eval, len(data))), validation=data.select(range(num_eval)))


def load_data(options: argparse.Namespace):
    """The training sample and the evaluation set (validation, or `--heldout` training sentences), untokenized."""
    if options.dataset == "rotten_tomatoes":
        raw, name, evaluated_on = read_rotten_tomatoes(872, options.seed), "Rotten Tomatoes", "held-out sentences"
    else:
        raw, name, evaluated_on = read_sst2(options.data_dir), "SST-2", "validation"
    train = raw["train"].shuffle(seed=options.seed)
    words = [len(sentence.split()) for sentence in train["sentence"]]
    held = [i for i, n in enumerate(words) if n >= options.heldout_min_words][: options.heldout or 0]
    held_set = set(held)
    rest = [i for i, n in enumerate(words) if n >= options.train_min_words and i not in held_set][: options.num_train]
    trained_on = f", trained on sentences of {options.train_min_words}+ words" if options.train_min_words else ""
    if options.heldout:
        longest = f" of at least {options.heldout_min_words} words" if options.heldout_min_words else ""
        description = f"{options.heldout} held-out {name} training sentences{longest}{trained_on}"
        return train.select(rest), train.select(held), description
    return train.select(rest), raw["validation"], f"{name} {evaluated_on} (872){trained_on}"


def build_model(
    path: str,
    method: str,
    lora_target_modules: list[str] | None = None,
    lora_layers: list[int] | str | None = None,
    load_in_4bit: bool = False,
    first_order: bool = False,
):
    """The model a variant trains: the LLM with LoRA (on `lora_target_modules` of the layers `lora_layers`: default
    every layer, or for the prompt default `hf_zo.training.prompt_lora_layers`; `"all"`: every layer), LoRA-FA, LN
    tuning, or all of its weights (`method`); with `load_in_4bit` on a bitsandbytes NF4 base, prepared for a backward
    pass by `peft.prepare_model_for_kbit_training` when `first_order` (QLoRA)."""
    quantization = base_quantization_config(load_in_4bit=load_in_4bit, compute_dtype=torch.float32)
    model = from_pretrained_quantized(AutoModelForCausalLM, path, quantization, dtype=torch.float32)
    from peft import LNTuningConfig, LoraConfig, TaskType, get_peft_model, prepare_model_for_kbit_training

    if load_in_4bit and first_order:
        model = prepare_model_for_kbit_training(model)

    if method == "lora_prompt_default":  # LoRA as examples/train.py builds it for a prompt task on a causal LM
        lora_target_modules = prompt_lora_target_modules(model)
        lora_layers = prompt_lora_layers(model) if lora_layers is None else lora_layers
    if lora_layers == "all":  # the prompt default's targets on every layer (the defaults before 2026-12-07)
        lora_layers = None
    if method in ("lora", "lora_fa", "lora_prompt_default"):
        lora = {**LORA, "target_modules": lora_target_modules or LORA["target_modules"]}
        if lora_layers is not None:
            lora["layers_to_transform"] = lora_layers
        model = get_peft_model(model, LoraConfig(task_type=TaskType.CAUSAL_LM, **lora))
        if method == "lora_fa":  # LoRA-FA: the random down-projections A stay as initialised, only B is trained
            for name, param in model.named_parameters():
                if "lora_A" in name:
                    param.requires_grad_(False)
    elif method == "ln":
        config = LNTuningConfig(task_type=TaskType.CAUSAL_LM, target_modules=norm_module_names(model))
        model = get_peft_model(model, config)
    return model


def build_trainer(spec: dict, options, tokenizer, task: PromptClassification, train, evaluation) -> Trainer:
    model_fields = ("method", "trainer", "lora_target_modules", "lora_layers", "load_in_4bit")
    fields = {k: v for k, v in spec.items() if k not in model_fields}
    common = dict(
        output_dir=tempfile.mkdtemp(prefix="hf_zo_llm_curve_"),
        max_steps=10**6,
        per_device_train_batch_size=options.batch_size,
        per_device_eval_batch_size=options.batch_size,
        lr_scheduler_type="constant",
        save_strategy="no",
        logging_steps=50,
        report_to=[],
        seed=options.seed,
        use_cpu=True,
        label_names=["labels"],
    )
    common.update(fields)  # the variant's fields and `--set` override the shared ones
    model = build_model(
        options.model,
        spec["method"],
        spec.get("lora_target_modules"),
        spec.get("lora_layers"),
        load_in_4bit=spec.get("load_in_4bit", False),
        first_order=spec["trainer"] == "adamw",
    )
    kwargs = dict(
        model=model,
        train_dataset=train,
        eval_dataset=evaluation,
        processing_class=tokenizer,
        compute_metrics=build_compute_metrics(["accuracy"]),
        **task.trainer_kwargs(),
    )
    if spec["trainer"] == "adamw":
        return Trainer(args=TrainingArguments(warmup_steps=0, weight_decay=0.0, **common), **kwargs)
    return ZOTrainer(args=ZOConfig(**common), **kwargs)


class Budget(WallTimeBudget):
    """`WallTimeBudget` whose first point is the zero-shot evaluation already made (not evaluated twice), and which
    also evaluates exponential moving averages of the trained weights (`average_decays`) at every later point.

    An average at decay `d` is updated after step `t` as `average = r * average + (1 - r) * weights` with
    `r = min(d, t / (t + 1))`: the plain mean of the weights so far (the start included) until `t` reaches
    `1 / (1 - d)`, then an average over about the last `1 / (1 - d)` steps. Its update is timed with the step. At a
    point, the averaged weights are swapped in for one evaluation and swapped back.
    """

    def __init__(self, trainer, budget, points, max_steps, zero_shot: dict, average_decays: tuple[float, ...] = ()):
        super().__init__(trainer, budget, points, max_steps)
        self.zero_shot = zero_shot
        self.trained = [p for p in trainer.model.parameters() if p.requires_grad]
        self.averages = {d: [p.detach().clone() for p in self.trained] for d in average_decays}

    def on_step_end(self, args, state, control, **kwargs):
        t = state.global_step
        with torch.no_grad():  # before the clock is read: the update counts as training time
            for decay, average in self.averages.items():
                torch._foreach_lerp_(average, self.trained, 1.0 - min(decay, t / (t + 1)))
        return super().on_step_end(args, state, control, **kwargs)

    def _evaluate(self) -> dict[str, float]:
        if self.zero_shot is None:
            point = super()._evaluate()
            if self.averages:
                with torch.no_grad():
                    live = [p.detach().clone() for p in self.trained]
                    for decay, average in self.averages.items():
                        torch._foreach_copy_(self.trained, average)
                        point[f"average_{decay}"] = super()._evaluate()
                    torch._foreach_copy_(self.trained, live)
            return point
        metrics, self.zero_shot = self.zero_shot, None
        return {"accuracy": metrics["eval_accuracy"], "loss": round(metrics["eval_loss"], 5)}


def run(name: str, spec: dict, options, tokenizer, task, train, evaluation) -> dict:
    trainer = build_trainer(spec, options, tokenizer, task, train, evaluation)
    start = time.perf_counter()
    with PeakMemory(interval=0.02) as inference:
        zero_shot = trainer.evaluate()
    eval_seconds = time.perf_counter() - start
    max_steps = min(options.max_steps or trainer.args.max_steps, trainer.args.max_steps)  # a variant's own too
    budget = Budget(
        trainer, 60.0 * options.budget_minutes, options.points, max_steps, zero_shot, tuple(options.average_decays)
    )
    trainer.add_callback(budget)
    with PeakMemory(interval=0.02) as training:
        budget.start()
        trainer.train()
    curve = budget.curve
    steps = trainer.state.global_step
    spec = {**spec, "learning_rate": trainer.args.learning_rate}  # the library's default where the variant left it
    if spec["method"] == "lora_prompt_default":
        spec["lora_target_modules"] = sorted(lora_target_names(trainer.model))
        if spec["trainer"] == "zo":
            spec["zo_eps"] = trainer.args.zo_eps
        if spec.get("lora_layers") is None:
            spec["lora_layers"] = prompt_lora_layers(trainer.model)
    return {
        "variant": name,
        "spec": spec,
        "steps": steps,
        "train_seconds": round(budget.seconds, 1),
        "seconds_per_step": round((budget.seconds - curve[0]["train_seconds"]) / max(1, steps), 3),
        "eval_seconds": round(eval_seconds, 1),
        "start_accuracy": zero_shot["eval_accuracy"],
        "final_accuracy": curve[-1]["accuracy"],
        "best_accuracy": max(p["accuracy"] for p in curve),
        "inference_peak_mib": round(inference.peak_mib, 1),
        "training_peak_mib": round(training.peak_mib, 1),
        "footprint_mib": round(trainer.model.get_memory_footprint() / 2**20, 1),
        "training_over_inference_memory": round(training.peak_mib / inference.peak_mib, 3),
        "curve": curve,
    }


def best_threshold_accuracy(scores: torch.Tensor, labels: torch.Tensor) -> float:
    """The accuracy of two-label `scores` `(n, 2)` at the best threshold on their difference (positive minus
    negative): what correcting the two label words' bias alone could reach."""
    margin = scores[:, 1] - scores[:, 0]
    return max(float(((margin > t) == labels.bool()).float().mean()) for t in margin.tolist())


def zero_shot(options, tokenizer, evaluation) -> None:
    """Each template's zero-shot accuracy on the evaluation set (to choose a template on held-out sentences), and
    its accuracy at the best threshold on the difference of the two label words' scores (what calibration alone
    could reach)."""
    model = AutoModelForCausalLM.from_pretrained(options.model, dtype=torch.float32)
    labels = torch.tensor(evaluation["label"])
    every = templates(tokenizer)
    chosen = options.zero_shot_templates.split(",") if options.zero_shot_templates else list(every)
    unknown = sorted(set(chosen) - set(every))
    if unknown:
        raise SystemExit(f"--zero_shot_templates: unknown {unknown}; choose from {sorted(every)}.")
    for name in chosen:
        template, words = every[name]
        task = PromptClassification(tokenizer, template, words)
        start = time.perf_counter()
        scores = task.predict_scores(model, task.tokenize(evaluation), batch_size=32)
        seconds = time.perf_counter() - start
        accuracy = float((scores.argmax(-1) == labels).float().mean())
        calibrated = best_threshold_accuracy(scores, labels)
        result = {
            "template": name,
            "accuracy": round(accuracy, 4),
            "best_threshold_accuracy": round(calibrated, 4),
            "seconds": round(seconds, 1),
        }
        print(json.dumps(result), flush=True)


class StopAfter(TrainerCallback):
    """Stops training after `steps` optimizer steps."""

    def __init__(self, steps: int):
        self.steps = steps

    def on_step_end(self, args, state, control, **kwargs):
        control.should_training_stop = state.global_step >= self.steps


def step_cost(name: str, spec: dict, options, tokenizer, task, train, steps: int = 8, warmup: int = 2) -> dict:
    """A ZO step of `spec` in forwards of the same batch: the median of step / forward over paired measurements."""
    from step_cost import StepTimer, paired_ratio

    rows = train.select(range(options.batch_size))
    repeated = concatenate_datasets([rows] * (steps + warmup + 1))  # read in order: every step sees `rows`
    spec = {**spec, "train_sampling_strategy": "sequential"}
    trainer = build_trainer(spec, options, tokenizer, task, repeated, rows)
    inputs = trainer._prepare_inputs(trainer.data_collator([rows[i] for i in range(len(rows))]))

    @torch.no_grad()
    def forward():
        # The loss each of the step's forwards computes; on a copy, as the step does (`compute_loss` pops the labels).
        trainer.compute_loss(trainer.model.eval(), copy.copy(inputs))

    timer = StepTimer(forward)
    trainer.add_callback(timer.callback)
    trainer.add_callback(StopAfter(steps + warmup))
    trainer.train()
    ratio, low, high = paired_ratio(timer.durations[warmup:], timer.forwards[warmup:])
    return {
        "variant": name,
        "step_seconds": round(statistics.median(timer.durations[warmup:]), 3),
        "forward_seconds": round(statistics.median(timer.forwards[warmup:]), 3),
        "zo_step_over_forward": round(ratio, 3),
        "range": [round(low, 3), round(high, 3)],
        "tokens_per_prompt": round(sum(len(r["input_ids"]) for r in rows) / len(rows), 1),
    }


def schedule(result: dict) -> str:
    """The run's estimator where it is FZOO, learning rate and schedule, e.g. "lr 2e-3 constant" or "lr 2e-3 linear
    over 340 steps", its LoRA modules and layers where they are not the default q_proj and v_proj of every layer
    ("fzoo (N 4), lr 6e-05 constant, LoRA on q_proj of layers 10-29"), and its seed where it is not the default."""
    spec = result["spec"]
    kind = spec.get("lr_scheduler_type", "constant")
    over = f" over {spec['max_steps']} steps" if kind != "constant" and "max_steps" in spec else ""
    modules = f", LoRA on {'+'.join(spec['lora_target_modules'])}" if spec.get("lora_target_modules") else ""
    if spec.get("lora_layers"):
        modules += f" of layers {min(spec['lora_layers'])}-{max(spec['lora_layers'])}"
    optimizer = spec.get("zo_optimizer", "zo_sgd") if spec.get("trainer") == "zo" else "adamw"
    estimator = f"{optimizer} (N {spec['zo_num_perturbations']}), " if optimizer == "fzoo" else ""
    seed = f", seed {result['seed']}" if result.get("seed", DEFAULT_SEED) != DEFAULT_SEED else ""
    return f"{estimator}lr {spec['learning_rate']:g} {kind}{over}{modules}{seed}"


def plot(results: list[dict], path: str, title: str) -> None:
    """Accuracy against optimizer steps and against training minutes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (by_step, by_time) = plt.subplots(1, 2, figsize=(12, 4.5))
    for result in results:
        style = dict(linestyle="--" if result["spec"]["trainer"] == "adamw" else "-", marker="o", markersize=3)
        accuracy = [100 * p["accuracy"] for p in result["curve"]]
        label = f"{result['variant']} ({result['template']}, {schedule(result)})"
        by_step.plot([p["step"] for p in result["curve"]], accuracy, label=label, **style)
        by_time.plot([p["train_seconds"] / 60 for p in result["curve"]], accuracy, label=label, **style)
    figure.suptitle(title)
    by_step.set(xlabel="optimizer steps", ylabel="validation accuracy (%)", title="against steps")
    by_time.set(xlabel="training minutes (evaluation excluded)", title="against wall time")
    for axes in (by_step, by_time):
        axes.grid(alpha=0.3)
    by_time.legend(loc="lower right", fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def table(results: list[dict]) -> str:
    """The Markdown table of docs/results/accuracy.md: one row per run."""
    rows = [
        "| variant | template | steps | s / step | zero-shot | after the budget | best point | peak memory "
        "(training / inference) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in results:
        if r["training_peak_mib"] is None:  # a run stopped before its memory was read
            memory = "not measured"
        else:
            memory = (
                f"{r['training_peak_mib']:.0f} / {r['inference_peak_mib']:.0f} MiB "
                f"({r['training_over_inference_memory']:.2f}x)"
            )
        rows.append(
            f"| {r['variant']}, {schedule(r)} | {r['template']} | {r['steps']} | {r['seconds_per_step']:.2f} | "
            f"{100 * r['start_accuracy']:.1f}% | {100 * r['final_accuracy']:.1f}% | {100 * r['best_accuracy']:.1f}% | "
            f"{memory} |"
        )
    return "\n".join(rows)


def write(options, results: list[dict], title: str) -> None:
    options.figure = options.figure or os.path.splitext(options.output)[0] + ".png"
    for path in (options.output, options.figure):
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(options.output, "w") as file:
        json.dump({"results": results}, file, indent=1)
    plot(results, options.figure, title)
    print(f"wrote {options.output} and {options.figure}\n\n{table(results)}")


def main() -> None:
    options = parse_args()
    if options.merge:
        results = read_results(options.merge)
        write(options, results, f"SmolLM2-135M-Instruct, {results[0]['evaluated_on']}, batch {results[0]['batch']}")
        return
    torch.set_num_threads(min(2, len(os.sched_getaffinity(0))))  # the cores this process may use (`taskset`)
    options.model = options.model or embedded_llm_path()
    tokenizer = AutoTokenizer.from_pretrained(options.model)
    train, evaluation, evaluated_on = load_data(options)
    if options.zero_shot:
        zero_shot(options, tokenizer, evaluation)
        return
    unknown = [n for n in options.variants.split(",") if n not in VARIANTS]
    if unknown:
        raise SystemExit(f"Unknown variants {unknown}; choose from {list(VARIANTS)}.")
    variants = {name: dict(VARIANTS[name]) for name in options.variants.split(",")}
    for override in options.set:
        target, value = override.split("=", 1)
        name, field = target.split(".", 1)
        try:
            variants[name][field] = json.loads(value)
        except json.JSONDecodeError:  # a bare string, e.g. train_sampling_strategy=group_by_length
            variants[name][field] = value
    template, words = templates(tokenizer)[options.template]
    task = PromptClassification(tokenizer, template, words, loss=options.loss)
    train, evaluation = task.tokenize(train), task.tokenize(evaluation)
    if options.step_cost:
        for name, spec in variants.items():
            print(json.dumps(step_cost(name, spec, options, tokenizer, task, train)), flush=True)
        return
    # Shortest prompts first: batches pad less (accuracy does not depend on the order).
    evaluation = evaluation.select(sorted(range(len(evaluation)), key=lambda i: len(evaluation[i]["input_ids"])))
    results = []
    for name, spec in variants.items():
        result = run(name, spec, options, tokenizer, task, train, evaluation)
        result.update(
            template=options.template,
            loss=options.loss,
            evaluated_on=evaluated_on,
            batch=options.batch_size,
            seed=options.seed,
        )
        results.append(result)
        print(json.dumps({k: v for k, v in result.items() if k != "curve"}), flush=True)
    write(options, results, f"SmolLM2-135M-Instruct, {evaluated_on}, batch {options.batch_size}")


if __name__ == "__main__":
    main()
