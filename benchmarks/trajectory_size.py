"""How many bytes does a trajectory take: header, steps and stored tensors, for 10,000 steps?

For each run shape, a model is built in code (one per shape: a plain model stores no tensor with or without a
checkpoint to compare with, and a PEFT adapter is stored whole either way), a trajectory is started with `ZOTrainer`'s
two parameter groups (weight decay / none), 10,000 steps are appended with `ZOTrajectory.append` (the encoding of a
run) and the file is saved with the model. Prints one JSON line per run and a Markdown table.

    python benchmarks/trajectory_size.py
"""

from __future__ import annotations

import argparse
import json
import tempfile

import torch
from peft import LoraConfig, get_peft_model
from transformers import OPTConfig, OPTForCausalLM

from hf_zo import ZOSGD, ZOTrajectory, ZOTrajectoryStep

STEPS = 10_000
OPT_125M = dict(hidden_size=768, num_hidden_layers=12, ffn_dim=3072, num_attention_heads=12, vocab_size=50272)
TINY = dict(hidden_size=32, num_hidden_layers=2, ffn_dim=64, num_attention_heads=4, vocab_size=64)


def build(shape: dict) -> torch.nn.Module:
    torch.manual_seed(0)
    config = OPTConfig(**shape, max_position_embeddings=64, word_embed_proj_dim=shape["hidden_size"])
    return OPTForCausalLM(config)


def measure(name: str, model: torch.nn.Module, estimates: int, schedule: bool) -> dict:
    """Record `STEPS` steps of `estimates` estimates each (a linear lr schedule if `schedule`) and size the file."""
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    no_decay = [p for n, p in trainable if n.endswith("bias") or "layer_norm" in n]
    decay = [p for n, p in trainable if not (n.endswith("bias") or "layer_norm" in n)]
    groups = [{"params": decay, "weight_decay": 0.1}] + (
        [{"params": no_decay, "weight_decay": 0.0}] if no_decay else []
    )
    trajectory = ZOTrajectory.start(model, ZOSGD(groups, lr=1e-3))
    weight_decays = tuple(group["weight_decay"] for group in groups)
    for step in range(STEPS):
        lr = 1e-3 * (1 - step / STEPS) if schedule else 1e-3
        seeds = tuple(step * 7919 + k for k in range(estimates))
        trajectory.append(ZOTrajectoryStep(step, seeds, (0.25,) * estimates, (lr,) * len(groups), weight_decays))
    with tempfile.TemporaryDirectory() as folder:
        file_bytes = trajectory.save(folder, model).stat().st_size
    tensors = len(trajectory.tensor_section())
    return {
        "run": name,
        "header_bytes": file_bytes - trajectory.body_bytes - tensors,
        "tensor_bytes": tensors,
        "stored_initial_elements": sum(t.numel() for t in trajectory.initial_tensors.values()),
        "bytes_per_step": trajectory.body_bytes / STEPS,
        "file_bytes": file_bytes,
    }


def main() -> None:
    opt_125m = build(OPT_125M)
    rows = [
        measure("OPT-125m shape, full fine-tuning, q = 1, constant lr (MeZO)", opt_125m, 1, False),
        measure("same, linear lr schedule", opt_125m, 1, True),
        measure("same, 4 estimates per step (q = 2, accumulation 2)", opt_125m, 4, False),
        measure("tiny OPT of the tests", build(TINY), 1, False),
    ]
    lora = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"])
    rows.insert(3, measure("OPT-125m shape, LoRA r = 8 on q/v", get_peft_model(opt_125m, lora), 1, False))
    for row in rows:
        print(json.dumps(row))
    print("\n| run | header | stored tensors | bytes/step | 10,000 steps |\n| --- | ---: | ---: | ---: | ---: |")
    for row in rows:
        print(
            f"| {row['run']} | {row['header_bytes']:,} B | {row['tensor_bytes']:,} B | {row['bytes_per_step']:.1f} | "
            f"{row['file_bytes']:,} B |"
        )


if __name__ == "__main__":
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    main()
