"""Resident memory of ZO training on the user's path, in a fresh process: `from_pretrained` of a safetensors folder,
(optionally) one inference forward, three ZO steps through `ZOTrainer`, and `save_model`.

Usage: ``python memory_worker.py MODEL_DIR OUTPUT_DIR {none,disk} {forward,no-forward}``. Prints one JSON line: the
model's bytes, the resident set size when the worker started (after its imports) and the peak of each phase, in
bytes. The peak of a phase is sampled from `/proc/self/status` (`VmRSS`, which counts mapped file pages).
"""

import json
import os
import sys
import threading
import time

import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM

from hf_zo import ZOConfig, ZOTrainer


def resident() -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmRSS"))


def main(model_dir: str, output_dir: str, offload: str, forward: str) -> None:
    peaks, phase = {}, ["start"]

    def sample():
        while True:
            peaks[phase[0]] = max(peaks.get(phase[0], 0), resident())
            time.sleep(0.002)

    threading.Thread(target=sample, daemon=True).start()
    time.sleep(0.05)
    start = resident()
    phase[0] = "load"
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    tokens = torch.arange(64).remainder(model.config.vocab_size).view(2, 32)
    if forward == "forward":
        phase[0] = "inference"
        with torch.no_grad():
            model(input_ids=tokens, labels=tokens)
    offload_args = {}
    if offload == "disk":
        blocks_dir = os.path.join(output_dir, "blocks")
        offload_args = {"zo_engine": "dual", "zo_offload": "disk", "zo_offload_dir": blocks_dir}
    args = ZOConfig(
        output_dir=output_dir,
        max_steps=3,
        per_device_train_batch_size=2,
        learning_rate=1e-6,
        zo_eps=1e-3,
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
        **offload_args,
    )
    rows = tokens.tolist() * 4
    phase[0] = "train"
    trainer = ZOTrainer(model=model, args=args, train_dataset=Dataset.from_dict({"input_ids": rows, "labels": rows}))
    trainer.train()
    phase[0] = "save"
    trainer.save_model()
    time.sleep(0.05)
    print(json.dumps({"model_bytes": model_bytes, "start": start, **peaks}))


if __name__ == "__main__":
    main(*sys.argv[1:])
