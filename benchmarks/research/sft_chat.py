"""ZO SFT against TRL's first-order SFT on the embedded LLM: SST-2 as a chat task, scored by generation.

Each SST-2 training sentence becomes a conversational prompt-completion example, the user turn
``Is this movie review positive or negative?\\n{sentence}`` and the assistant turn ``positive`` or ``negative``,
which TRL renders through the model's chat template (SmolLM2-135M-Instruct, `hf_zo.models.embedded_llm_path`) and
trains on the completion only. The model answers the validation sentences (the same user turn, greedy, 6 new
tokens; `--heldout N`: N training sentences of 12+ words kept out of training instead, where a recipe is chosen);
an answer is right when it names the right word and not the other. `--system_prompt ''` puts an empty
system turn first (the template's default system prompt is 16 of a prompt's 52 tokens). `--answer_form` writes the
assistant turn in the form the instruct model already answers in (``This movie review is {answer}.``), so that what
SFT's loss leaves to learn is the word, not the form. LoRA r 8 / alpha 16 on
`q_proj` and `v_proj` (`--peft ln`: LN tuning of every RMSNorm instead), batch 16, a wall-time budget of training
(evaluation excluded), one variant per process (their peak memories stay apart), then merge::

    python -m benchmarks.research.sft_chat --variant zo --budget_minutes 20 --points 2 --output /tmp/sft_zo.json
    python -m benchmarks.research.sft_chat --variant trl --budget_minutes 10 --points 1 --output /tmp/sft_trl.json
    python -m benchmarks.research.sft_chat --merge /tmp/sft_zo.json /tmp/sft_trl.json \
        --output docs/images/sft_chat.json

`zo` is `hf_zo.ZOSFTTrainer` with `ZOSFTConfig` (MeZO's ZO-SGD, or FZOO with `--zo_optimizer fzoo`;
`--learning_rate` / `--zo_eps` override ZO's defaults), `trl` is `trl.SFTTrainer` with `SFTConfig` (AdamW,
`--learning_rate`, default 2e-4). The two runs differ in the import and the config class only. Peak resident memory is
measured over training and over inference forwards of the first training batches (the same batch shape); the training
peak over the optimizer steps alone (the evaluations by generation, at batch 32, are left out of it; `process_peak_mib`
has the whole of training).

`--zero_shot` trains nothing: it asks the instruct model each user turn of `QUESTIONS` (the one above first) about
400 training sentences of 12+ words and prints how well the two answer words' scores separate the classes (also at
their best threshold) and how many of its greedy answers to 100 of them are right (docs/results/trl.md).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from benchmarks.common import SST2_DIR
from benchmarks.research.learning_curve import WallTimeBudget
from benchmarks.research.llm_learning_curve import best_threshold_accuracy, load_data, read_results, read_sst2
from hf_zo.demo.memory import PeakMemory
from hf_zo.models import embedded_llm_path

QUESTION = "Is this movie review positive or negative?\n{sentence}"
ANSWERS = ("negative", "positive")
# Other user turns, compared with QUESTION by `--zero_shot` (the chat form the model answers in best).
QUESTIONS = {
    "reference": QUESTION,
    "review_sentiment": "Review: {sentence}\nSentiment:",
    "review_question": "Review: {sentence}\nIs this review positive or negative?",
    "classify": "Classify the sentiment of this movie review as positive or negative.\nReview: {sentence}",
    "sentence_question": "{sentence}\n\nIs the sentiment of this sentence positive or negative?",
    "one_word": "Is this movie review positive or negative? Answer with one word.\n{sentence}",
    "opinion": "Review: {sentence}\nWas the reviewer's opinion positive or negative?",
    "quoted": 'What is the sentiment of this review: "{sentence}"? Answer positive or negative.',
}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data_dir", default=str(SST2_DIR), help="Folder with train.tsv and validation.tsv.")
    parser.add_argument("--model", default=None, help="Model path (default: the embedded LLM).")
    parser.add_argument("--variant", default="zo", choices=["zo", "trl"])
    parser.add_argument("--learning_rate", type=float, default=None, help="Default: ZO's default / 2e-4 for TRL.")
    parser.add_argument("--zo_eps", type=float, default=None, help="ZO only; default: ZO's default.")
    parser.add_argument(
        "--zo_optimizer",
        default="zo_sgd",
        choices=["zo_sgd", "fzoo"],
        help="ZO only: MeZO's ZO-SGD, or FZOO (4 one-sided Rademacher perturbations, step divided by their spread).",
    )
    parser.add_argument("--budget_minutes", type=float, default=20.0, help="Training wall time.")
    parser.add_argument("--points", type=int, default=2, help="Evaluations after the zero-shot one, evenly in time.")
    parser.add_argument("--max_steps", type=int, default=None, help="Also stop after this many optimizer steps.")
    parser.add_argument("--num_train", type=int, default=8192, help="Training sentences sampled from train.tsv.")
    parser.add_argument("--num_eval", type=int, default=None, help="Validation sentences answered (default: all).")
    parser.add_argument(
        "--heldout",
        type=int,
        default=None,
        help="Answer this many held-out training sentences (of --heldout_min_words+ words) instead of validation: "
        "where a recipe is chosen without looking at validation.",
    )
    parser.add_argument(
        "--heldout_min_words", type=int, default=12, help="With --heldout: sentences as long as validation's."
    )
    parser.add_argument(
        "--train_min_words",
        type=int,
        default=0,
        help="Train only on SST-2 entries of at least this many words (its training set is mostly short phrases).",
    )
    parser.add_argument(
        "--lr_scheduler_type",
        default="constant",
        help="The learning-rate schedule; 'linear' falls to zero at --max_steps (which it then needs).",
    )
    parser.add_argument("--batch_size", type=int, default=16)
    parser.add_argument(
        "--peft", default="lora", choices=["lora", "ln"], help="LoRA r 8 on q/v, or LN tuning (every RMSNorm)."
    )
    parser.add_argument(
        "--lora_target_modules", nargs="+", default=["q_proj", "v_proj"], help="The modules LoRA adapts."
    )
    parser.add_argument(
        "--lora_layers_to_transform",
        nargs="+",
        type=int,
        default=None,
        help="The layers LoRA adapts (default: all); e.g. 10 ... 29, the upper two thirds of SmolLM2's 30, as the "
        "prompt-task defaults do (`hf_zo.training.prompt_lora_layers`).",
    )
    parser.add_argument(
        "--system_prompt",
        default=None,
        help="A system turn before each question ('' for an empty one); default: none, so the chat template adds "
        "SmolLM2's own (16 of a prompt's 52 tokens on average).",
    )
    parser.add_argument(
        "--answer_form",
        default="{answer}",
        help="The assistant turn trained on, `{answer}` standing for the label word: the word alone (the default), "
        "or a sentence in the form the instruct model answers in, e.g. 'This movie review is {answer}.'.",
    )
    parser.add_argument(
        "--zero_shot",
        action="store_true",
        help="Only compare the instruct model's zero-shot answers to each user turn of QUESTIONS, on --num_eval "
        "(default 400) training sentences of 12+ words, and write them to --output.",
    )
    parser.add_argument("--eval_batch_size", type=int, default=32)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--output", default="docs/images/sft_chat.json", help="Where the JSON goes.")
    parser.add_argument("--merge", nargs="*", default=None, help="Join these runs' JSON files into one.")
    options = parser.parse_args()
    if options.lr_scheduler_type != "constant" and options.max_steps is None:
        parser.error(f"--lr_scheduler_type {options.lr_scheduler_type} needs --max_steps, the step its rate ends at.")
    options.dataset = "sst2"  # `load_data`'s data set: SST-2 from --data_dir
    return options


def prompt_turns(sentence: str, system_prompt: str | None, question: str = QUESTION) -> list[dict]:
    """The prompt's turns: `question` about `sentence`, after a system turn when `system_prompt` is given."""
    system = [] if system_prompt is None else [{"role": "system", "content": system_prompt}]
    return [*system, {"role": "user", "content": question.format(sentence=sentence.strip())}]


def chat_datasets(options: argparse.Namespace):
    """The training examples (conversational prompt-completion), the sentences answered (validation, or
    `--heldout` training sentences kept out of training) and their description."""
    train, evaluated, evaluated_on = load_data(options)

    def to_chat(row):
        return {
            "prompt": prompt_turns(row["sentence"], options.system_prompt),
            "completion": [{"role": "assistant", "content": options.answer_form.format(answer=ANSWERS[row["label"]])}],
        }

    train = train.map(to_chat, remove_columns=train.column_names)
    if options.num_eval and not options.heldout:
        evaluated = evaluated.select(range(options.num_eval))
        evaluated_on = f"SST-2 validation (the first {options.num_eval})"
    return train, evaluated, evaluated_on


class GenerationAccuracy:
    """The share of validation sentences whose greedy answer names the right word and not the other."""

    def __init__(
        self,
        tokenizer,
        validation,
        batch_size: int,
        system_prompt: str | None,
        max_new_tokens: int = 6,
        question: str = QUESTION,
    ):
        self.tokenizer, self.batch_size, self.max_new_tokens = tokenizer, batch_size, max_new_tokens
        prompts = [
            tokenizer.apply_chat_template(
                prompt_turns(s, system_prompt, question),
                tokenize=False,
                add_generation_prompt=True,
            )
            for s in validation["sentence"]
        ]
        order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))  # batches of similar length pad less
        self.prompts = [prompts[i] for i in order]
        self.labels = [validation["label"][i] for i in order]

    @torch.no_grad()
    def __call__(self, model) -> dict:
        was_training = model.training
        model.eval()
        padding_side, self.tokenizer.padding_side = self.tokenizer.padding_side, "left"
        start = time.perf_counter()
        right = unclear = 0
        try:
            for first in range(0, len(self.prompts), self.batch_size):
                batch = self.tokenizer(
                    self.prompts[first : first + self.batch_size],
                    return_tensors="pt",
                    padding=True,
                    add_special_tokens=False,
                )
                generated = model.generate(
                    **batch,
                    max_new_tokens=self.max_new_tokens,
                    do_sample=False,
                    pad_token_id=self.tokenizer.pad_token_id,
                )
                answers = self.tokenizer.batch_decode(generated[:, batch["input_ids"].shape[1] :])
                for answer, label in zip(answers, self.labels[first : first + self.batch_size], strict=True):
                    named = [word in answer.lower() for word in ANSWERS]
                    if sum(named) != 1:
                        unclear += 1
                    elif named[label]:
                        right += 1
        finally:
            self.tokenizer.padding_side = padding_side
            model.train(was_training)
        total = len(self.prompts)
        return {
            "accuracy": round(right / total, 4),
            "unclear": unclear,
            "eval_seconds": round(time.perf_counter() - start, 1),
        }


class Budget(WallTimeBudget):
    """`WallTimeBudget` scored by generation; its first point is the zero-shot score already measured. It also keeps
    the peak resident memory over the optimizer steps alone (`step_peak_mib`), the evaluations left out: generating
    answers for a batch of 32 prompts needs more memory than a training step of 16."""

    def __init__(self, trainer, budget, points, max_steps, score: GenerationAccuracy, zero_shot: dict):
        super().__init__(trainer, budget, points, max_steps)
        self.score, self.zero_shot = score, zero_shot
        self.step_peak_mib = 0.0
        self._memory: PeakMemory | None = None

    def on_step_begin(self, args, state, control, **kwargs):
        super().on_step_begin(args, state, control, **kwargs)
        self._memory = PeakMemory(interval=0.02).__enter__()

    def on_step_end(self, args, state, control, **kwargs):
        self._memory.__exit__(None, None, None)
        self.step_peak_mib = max(self.step_peak_mib, self._memory.peak_mib)
        super().on_step_end(args, state, control, **kwargs)  # may evaluate

    def _evaluate(self) -> dict:
        if self.zero_shot is not None:
            result, self.zero_shot = self.zero_shot, None
            return result
        return self.score(self.trainer.model)


def build_trainer(options, tokenizer, train):
    from peft import LNTuningConfig, LoraConfig

    from hf_zo.models import norm_module_names

    common = dict(
        output_dir=tempfile.mkdtemp(prefix="hf_zo_sft_chat_"),
        max_steps=options.max_steps or 10**6,
        per_device_train_batch_size=options.batch_size,
        lr_scheduler_type=options.lr_scheduler_type,
        save_strategy="no",
        logging_steps=50,
        report_to=[],
        seed=options.seed,
        use_cpu=True,
        bf16=False,  # fp32 for both: TRL's SFTConfig turns bf16 autocast on, 4x slower on CPUs without bf16 units
        model_init_kwargs={"dtype": torch.float32},
    )
    if options.peft == "lora":
        peft_config = LoraConfig(
            r=8,
            lora_alpha=16,
            target_modules=options.lora_target_modules,
            layers_to_transform=options.lora_layers_to_transform,
            task_type="CAUSAL_LM",
        )
    else:
        norms = norm_module_names(AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(options.model)))
        peft_config = LNTuningConfig(target_modules=norms, task_type="CAUSAL_LM")
    if options.variant == "zo":
        from hf_zo import ZOSFTConfig as SFTConfig
        from hf_zo import ZOSFTTrainer as SFTTrainer

        common.update(learning_rate=options.learning_rate, zo_eps=options.zo_eps, zo_optimizer=options.zo_optimizer)
        if options.zo_optimizer == "fzoo":  # as the paper runs it
            common.update(zo_num_perturbations=4, zo_noise="rademacher")
    else:
        from trl import SFTConfig, SFTTrainer

        common.update(learning_rate=options.learning_rate or 2e-4, gradient_checkpointing=False)  # ZO's default
    args = SFTConfig(**common)
    return SFTTrainer(
        model=options.model, args=args, train_dataset=train, processing_class=tokenizer, peft_config=peft_config
    )


@torch.no_grad()
def inference_peak(trainer, batches: int = 4) -> float:
    """Peak resident MiB over evaluation forwards (`compute_loss` in eval mode, as `trainer.evaluate()` runs it) of
    the first training batches: inference on the training batch."""
    model = trainer.model
    model.eval()
    with PeakMemory(interval=0.02) as memory:
        for index, batch in enumerate(trainer.get_train_dataloader()):
            if index == batches:
                break
            trainer.compute_loss(model, trainer._prepare_inputs(batch))
    model.train()
    return memory.peak_mib


def run(options) -> dict:
    tokenizer = AutoTokenizer.from_pretrained(options.model)
    train, evaluated, evaluated_on = chat_datasets(options)
    score = GenerationAccuracy(tokenizer, evaluated, options.eval_batch_size, options.system_prompt)
    trainer = build_trainer(options, tokenizer, train)
    zero_shot = score(trainer.model)  # LoRA's B starts at zero: the adapter changes nothing yet
    print(json.dumps({"zero_shot": zero_shot}), flush=True)
    inference_mib = inference_peak(trainer)
    budget = Budget(trainer, 60.0 * options.budget_minutes, options.points, options.max_steps, score, zero_shot)
    trainer.add_callback(budget)
    with PeakMemory(interval=0.02) as training:
        budget.start()
        trainer.train()
    curve = budget.curve
    steps = trainer.state.global_step
    return {
        "variant": options.variant,
        "trainer": type(trainer).__name__,
        "learning_rate": trainer.args.learning_rate,
        "zo_eps": getattr(trainer.args, "zo_eps", None),
        "zo_optimizer": getattr(trainer.args, "zo_optimizer", None),
        "batch": options.batch_size,
        "peft": options.peft,
        "lora_target_modules": options.lora_target_modules if options.peft == "lora" else None,
        "lora_layers_to_transform": options.lora_layers_to_transform if options.peft == "lora" else None,
        "system_prompt": options.system_prompt,
        "answer_form": options.answer_form,
        "steps": steps,
        "train_seconds": round(budget.seconds, 1),
        "seconds_per_step": round((budget.seconds - curve[0]["train_seconds"]) / max(1, steps), 3),
        "zero_shot_accuracy": zero_shot["accuracy"],
        "final_accuracy": curve[-1]["accuracy"],
        "inference_peak_mib": round(inference_mib, 1),
        "training_peak_mib": round(budget.step_peak_mib, 1),
        "training_over_inference_memory": round(budget.step_peak_mib / inference_mib, 3),
        "process_peak_mib": round(training.peak_mib, 1),  # over `trainer.train()`, evaluations included
        "lr_scheduler_type": options.lr_scheduler_type,
        "train_min_words": options.train_min_words,
        "evaluated_on": evaluated_on,
        "curve": curve,
    }


def zero_shot(options) -> list[dict]:
    """Each user turn of :data:`QUESTIONS` asked of the instruct model, zero-shot, on `--num_eval` (default 400)
    training sentences of 12+ words (as long as validation's; none of them validation): the two answer words' scores
    at the first position of the answer (the accuracy, and the accuracy at the best threshold on their difference:
    what calibrating the two words alone could reach, the discrimination an SFT run starts from), and greedy
    generation on the first 100 (right, and unclear: naming neither word or both)."""
    from hf_zo.prompts import PromptClassification

    tokenizer = AutoTokenizer.from_pretrained(options.model)
    model = AutoModelForCausalLM.from_pretrained(options.model, dtype=torch.float32)
    train = read_sst2(options.data_dir)["train"].shuffle(seed=options.seed)
    long = [i for i, sentence in enumerate(train["sentence"]) if len(sentence.split()) >= 12]
    sentences = train.select(long[: options.num_eval or 400]).map(lambda row: {"sentence": row["sentence"].strip()})
    labels = torch.tensor(sentences["label"])
    results = []
    for name, question in QUESTIONS.items():
        template = tokenizer.apply_chat_template(
            prompt_turns("{sentence}", options.system_prompt, question), add_generation_prompt=True, tokenize=False
        )
        task = PromptClassification(tokenizer, template, ANSWERS)
        scores = task.predict_scores(model, task.tokenize(sentences), batch_size=options.eval_batch_size)
        calibrated = best_threshold_accuracy(scores, labels)
        generated = GenerationAccuracy(
            tokenizer,
            sentences.select(range(min(100, len(sentences)))),
            options.eval_batch_size,
            options.system_prompt,
            question=question,
        )(model)
        results.append(
            {
                "question": name,
                "system_prompt": options.system_prompt,
                "sentences": len(sentences),
                "score_accuracy": round(float((scores.argmax(-1) == labels).float().mean()), 4),
                "best_threshold_accuracy": round(calibrated, 4),
                "generation_accuracy": generated["accuracy"],
                "generation_unclear": generated["unclear"],
            }
        )
        print(json.dumps(results[-1]), flush=True)
    return results


def table(results: list[dict]) -> str:
    """The Markdown table of docs/results/trl.md: one row per run, one column per evaluation point."""
    rows = [
        "| trainer | lr | steps | s / step | zero-shot | accuracy by training minutes | peak memory (training / "
        "inference) |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in results:
        points = ", ".join(
            f"{p['train_seconds'] / 60:.1f} min: {100 * p['accuracy']:.1f}% ({p['unclear']} unclear)"
            for p in r["curve"][1:]
        )
        falling = " → 0" if r.get("lr_scheduler_type", "constant") == "linear" else ""
        rows.append(
            f"| `{r['trainer']}` | {r['learning_rate']:g}{falling} | {r['steps']} | {r['seconds_per_step']:.2f} | "
            f"{100 * r['zero_shot_accuracy']:.1f}% | {points} | {r['training_peak_mib']:.0f} / "
            f"{r['inference_peak_mib']:.0f} MiB ({r['training_over_inference_memory']:.2f}x) |"
        )
    return "\n".join(rows)


def main() -> None:
    options = parse_args()
    os.makedirs(os.path.dirname(os.path.abspath(options.output)), exist_ok=True)
    if options.merge:
        results = read_results(options.merge)
    else:
        torch.set_num_threads(min(2, os.cpu_count() or 1))
        options.model = options.model or embedded_llm_path()
        if options.zero_shot:
            with open(options.output, "w") as file:
                json.dump({"zero_shot": zero_shot(options)}, file, indent=1)
            print(f"wrote {options.output}")
            return
        results = [run(options)]
        print(json.dumps({k: v for k, v in results[0].items() if k != "curve"}), flush=True)
    with open(options.output, "w") as file:
        json.dump({"results": results}, file, indent=1)
    print(f"wrote {options.output}\n\n{table(results)}")


if __name__ == "__main__":
    main()
