"""The LLM demo: the embedded SmolLM2-135M-Instruct learns a prompt task by zeroth-order training alone.

The model scores " terrible" / " great" after "<sentence> It was" (MeZO's SST-2 prompt,
`hf_zo.prompts.PromptClassification`); LoRA (r=8 on q_proj, v_proj) is trained with MeZO's ZO-SGD (the estimator
that climbed fastest per second on SST-2 with this model, docs/results/accuracy.md) on the 320 training sentences of
`hf_zo/demo/data`. No head, no probe: every point of accuracy gained is ZO's. It prints the held-out
accuracy before and after, one generation before and after, and the peak resident memory of ZO steps, of an inference
forward and of one first-order (AdamW) step on the same batch, each measured alone in a fresh process
(`hf_zo/demo/phase.py`), so that neither side's peak can hide in memory another phase left resident.
"""

from __future__ import annotations

import time

import torch

from .phase import PHASES, peak_in_fresh_process
from .setup import LABEL_WORDS, TEMPLATE, demo_model, demo_task

GENERATION_PROMPT = "The acting was wooden and the plot made no sense. It was"


def generate(model, tokenizer, prompt: str, max_new_tokens: int = 4) -> str:
    """The greedy continuation of `prompt`."""
    inputs = tokenizer(prompt, return_tensors="pt")
    with torch.no_grad():
        output = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
    return tokenizer.decode(output[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)


def run(demo) -> dict:
    """Run the LLM demo with `demo`'s options (`DemoArguments`) and return its summary."""
    from transformers import AutoTokenizer, set_seed

    from hf_zo import ZOConfig, ZOTrainer
    from hf_zo.metrics import build_compute_metrics
    from hf_zo.models import EMBEDDED_LLM_ID, embedded_llm_path

    set_seed(demo.seed)
    torch.set_num_threads(min(2, torch.get_num_threads()))
    tokenizer = AutoTokenizer.from_pretrained(embedded_llm_path())
    task, data = demo_task(tokenizer)
    model = demo_model(demo.lora_rank)
    args = ZOConfig(
        output_dir=demo.output_dir,
        max_steps=demo.max_steps,
        per_device_train_batch_size=demo.batch_size,
        per_device_eval_batch_size=demo.batch_size,  # inference memory measured at the training batch
        learning_rate=demo.learning_rate,
        lr_scheduler_type="constant",
        zo_eps=demo.zo_eps,
        logging_steps=max(1, demo.max_steps // 10),
        save_strategy="no",
        report_to=[],
        seed=demo.seed,
        use_cpu=True,
        label_names=["labels"],
    )
    trainer = ZOTrainer(
        model=model,
        args=args,
        train_dataset=data["train"],
        eval_dataset=data["test"],
        processing_class=tokenizer,
        compute_metrics=build_compute_metrics(["accuracy"]),
        **task.trainer_kwargs(),
    )
    generation_before = generate(model, tokenizer, GENERATION_PROMPT)
    before = trainer.evaluate()
    start = time.perf_counter()
    trainer.train()
    wall_time = time.perf_counter() - start
    after = trainer.evaluate()
    generation_after = generate(model, tokenizer, GENERATION_PROMPT)
    trainer.save_model()
    settings = (demo.batch_size, demo.lora_rank, demo.learning_rate, demo.zo_eps)
    peaks = {phase: peak_in_fresh_process(phase, *settings)["peak_mib"] for phase in PHASES}

    return {
        "model": f"{EMBEDDED_LLM_ID} + LoRA, MeZO (hf_zo ZOTrainer)",
        "prompt": f"{TEMPLATE!r} -> {' / '.join(repr(w) for w in LABEL_WORDS)}",
        "train_examples": len(data["train"]),
        "test_examples": len(data["test"]),
        "steps": demo.max_steps,
        "accuracy_zero_shot": round(before["eval_accuracy"], 4),
        "accuracy_after_zo_training": round(after["eval_accuracy"], 4),
        "loss_zero_shot": round(before["eval_loss"], 4),
        "loss_after_zo_training": round(after["eval_loss"], 4),
        "generation_prompt": GENERATION_PROMPT,
        "generation_before": generation_before,
        "generation_after": generation_after,
        "train_wall_time_s": round(wall_time, 1),
        "memory_measured": f"peak resident memory, each phase alone in a fresh process, batch {demo.batch_size}",
        "inference_peak_mib": peaks["inference"],
        "zo_step_peak_mib": peaks["zo"],
        "first_order_step_peak_mib": peaks["first_order"],
        "zo_over_inference_memory": round(peaks["zo"] / peaks["inference"], 3),
        "first_order_over_inference_memory": round(peaks["first_order"] / peaks["inference"], 3),
    }
