"""One phase of the demo's memory measurement, alone in a fresh process: `python -m hf_zo.demo.phase PHASE`.

Each phase (an inference forward, ZO steps, a first-order AdamW step) runs in its own process after the same set-up
(the model with its LoRA adapter and one training batch), and memory freed by the set-up is handed back to the
operating system before the phase starts. The peak resident memory of one phase therefore cannot hide in memory that
another phase (or the set-up) left resident, as it can when the phases run one after the other in one process: there
the first-order step's activations and AdamW's moments may fit into pages that training freed but kept. The demo
(`hf_zo/demo/llm.py`) runs the three phases this way and prints each peak.

Prints one JSON line: ``{"phase": ..., "peak_mib": ..., "setup_mib": ...}``.
"""

from __future__ import annotations

import argparse
import gc
import json
import subprocess
import sys

import torch

from ..heap import return_freed_memory
from .memory import PeakMemory, resident_bytes
from .setup import demo_batch, demo_model

PHASES = ("inference", "zo", "first_order")
ZO_STEPS = 3


def peak_in_fresh_process(phase: str, batch_size: int, lora_rank: int, learning_rate: float, zo_eps: float) -> dict:
    """Run `phase` in a new Python process (see the module docstring) and return its JSON line."""
    command = [sys.executable, "-m", "hf_zo.demo.phase", phase, "--batch_size", str(batch_size)]
    command += ["--lora_rank", str(lora_rank), "--learning_rate", str(learning_rate), "--zo_eps", str(zo_eps)]
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise RuntimeError(f"the {phase} memory measurement failed:\n{result.stderr[-2000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def measure(phase: str, batch_size: int, lora_rank: int, learning_rate: float, zo_eps: float) -> dict:
    """Set up the demo's model and batch, release what the set-up freed, and run `phase` under a `PeakMemory`."""
    torch.manual_seed(0)
    torch.set_num_threads(min(2, torch.get_num_threads()))
    model = demo_model(lora_rank)
    task, rows = demo_batch(batch_size)
    batch = task(rows)
    labels = batch.pop("labels")
    trainable = [p for p in model.parameters() if p.requires_grad]
    if phase == "zo":
        from hf_zo import ZOSGD

        optimizer = ZOSGD(trainable, lr=learning_rate, eps=zo_eps)

        def closure():
            return task.compute_loss(model(**batch), labels)
    elif phase == "first_order":
        optimizer = torch.optim.AdamW(trainable, lr=1e-4)
        model.train()
    gc.collect()
    return_freed_memory()
    setup = resident_bytes()
    with PeakMemory() as memory:
        if phase == "inference":
            with torch.no_grad():
                task.compute_loss(model(**batch), labels)
        elif phase == "zo":
            for _ in range(ZO_STEPS):
                optimizer.step(closure)
        else:
            loss = task.compute_loss(model(**batch), labels)
            loss.backward()
            optimizer.step()
    return {"phase": phase, "peak_mib": round(memory.peak_mib, 1), "setup_mib": round(setup / 2**20, 1)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("phase", choices=PHASES)
    parser.add_argument("--batch_size", type=int, default=16)
    parser.add_argument("--lora_rank", type=int, default=8)
    parser.add_argument("--learning_rate", type=float, default=2e-3)
    parser.add_argument("--zo_eps", type=float, default=1e-2)
    args = parser.parse_args(argv)
    print(json.dumps(measure(args.phase, args.batch_size, args.lora_rank, args.learning_rate, args.zo_eps)))


if __name__ == "__main__":
    main()
