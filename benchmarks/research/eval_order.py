"""What evaluating longest first saves: `ZOTrainer.evaluate` on SST-2's 872 validation prompts, embedded LLM.

`ZOConfig`'s default `train_sampling_strategy="group_by_length"` runs evaluation batches longest first
(`hf_zo.training.LengthSortedSampler`) and puts the results back in the data set's order; `"random"` evaluates in the
data set's order, as `Trainer` does. Both evaluate the same model on the same prompts (the review template of
benchmarks/research/llm_learning_curve.py, batch 16) in one process, one after the other; the accuracy and loss
must agree::

    python -m benchmarks.research.eval_order
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from benchmarks.common import SST2_DIR
from benchmarks.research.llm_learning_curve import TEMPLATES, read_sst2
from hf_zo import ZOConfig, ZOTrainer
from hf_zo.metrics import build_compute_metrics
from hf_zo.models import embedded_llm_path
from hf_zo.prompts import PromptClassification


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data_dir", default=str(SST2_DIR), help="Folder with validation.tsv.")
    parser.add_argument("--batch_size", type=int, default=16)
    options = parser.parse_args()
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    path = embedded_llm_path()
    tokenizer = AutoTokenizer.from_pretrained(path)
    task = PromptClassification(tokenizer, *TEMPLATES["review"])
    validation = task.tokenize(read_sst2(options.data_dir)["validation"])
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    results = {}
    for strategy in ("group_by_length", "random"):
        args = ZOConfig(
            output_dir=tempfile.mkdtemp(prefix="hf_zo_eval_order_"),
            per_device_eval_batch_size=options.batch_size,
            train_sampling_strategy=strategy,
            label_names=["labels"],
            use_cpu=True,
            report_to=[],
        )
        trainer = ZOTrainer(
            model=model,
            args=args,
            processing_class=tokenizer,
            compute_metrics=build_compute_metrics(["accuracy"]),
            **task.trainer_kwargs(),
        )
        start = time.perf_counter()
        metrics = trainer.evaluate(validation)
        results[strategy] = {
            "seconds": round(time.perf_counter() - start, 1),
            "accuracy": metrics["eval_accuracy"],
            "loss": round(metrics["eval_loss"], 5),
        }
    results["speedup"] = round(results["random"]["seconds"] / results["group_by_length"]["seconds"], 2)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
