"""How many bytes does a trajectory take: header, steps and stored tensors, for 10,000 steps?

For each run shape, a model is saved to a temporary folder and loaded back (so the trajectory compares its trainable
tensors with a real checkpoint, as on the user path), a trajectory is started with `ZOTrainer`'s two parameter groups
(weight decay / none), 10,000 steps are appended with `ZOTrajectory.append` (the encoding of a run) and the file is
saved with the model. Prints one JSON line per run and a Markdown table.

    python benchmarks/trajectory_size.py
"""

from __future__ import annotations

import json
import tempfile

import torch
from peft import LoraConfig, get_peft_model
from transformers import OPTConfig, OPTForCausalLM

from hf_zo import ZOSGD, ZOTrajectory, ZOTrajectoryStep

STEPS = 10_000
OPT_125M = dict(hidden_size=768, num_hidden_layers=12, ffn_dim=3072, num_attention_heads=12, vocab_size=50272)
TINY = dict(hidden_size=32, num_hidden_layers=2, ffn_dim=64, num_attention_heads=4, vocab_size=64)


def measure(name: str, shape: dict, lora: bool, estimates: int, schedule: bool) -> dict:
    """Record `STEPS` steps of `estimates` estimates each (a linear lr schedule if `schedule`) and size the file."""
    with tempfile.TemporaryDirectory() as folder:
        torch.manual_seed(0)
        OPTForCausalLM(
            OPTConfig(**shape, max_position_embeddings=64, word_embed_proj_dim=shape["hidden_size"])
        ).save_pretrained(folder)
        model = OPTForCausalLM.from_pretrained(folder)
        if lora:
            model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]))
        trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        decay = [p for n, p in trainable if not n.endswith("bias") and "layer_norm" not in n]
        no_decay = [p for n, p in trainable if n.endswith("bias") or "layer_norm" in n]
        groups = [{"params": decay, "weight_decay": 0.1}] + (
            [{"params": no_decay, "weight_decay": 0.0}] if no_decay else []
        )
        trajectory = ZOTrajectory.start(model, ZOSGD(groups, lr=1e-3))
        for step in range(STEPS):
            lr = 1e-3 * (1 - step / STEPS) if schedule else 1e-3
            seeds = tuple(step * 7919 + k for k in range(estimates))
            trajectory.append(
                ZOTrajectoryStep(
                    step, seeds, (0.25,) * estimates, (lr,) * len(groups), tuple(g["weight_decay"] for g in groups)
                )
            )
        data_size = trajectory.save(folder, model).stat().st_size
    tensors = len(trajectory.tensor_section())
    return {
        "run": name,
        "header_bytes": data_size - trajectory.body_bytes - tensors,
        "tensor_bytes": tensors,
        "stored_initial_elements": sum(t.numel() for t in trajectory.initial_tensors.values()),
        "bytes_per_step": trajectory.body_bytes / STEPS,
        "file_bytes": data_size,
    }


def main() -> None:
    runs = [
        ("OPT-125m shape, full fine-tuning, q = 1, constant lr (MeZO)", OPT_125M, False, 1, False),
        ("same, linear lr schedule", OPT_125M, False, 1, True),
        ("same, 4 estimates per step (q = 2, accumulation 2)", OPT_125M, False, 4, False),
        ("OPT-125m shape, LoRA r = 8 on q/v", OPT_125M, True, 1, False),
        ("tiny OPT of the tests", TINY, False, 1, False),
    ]
    rows = [measure(*run) for run in runs]
    for row in rows:
        print(json.dumps(row))
    print("\n| run | header | stored tensors | bytes/step | 10,000 steps |\n| --- | ---: | ---: | ---: | ---: |")
    for row in rows:
        print(
            f"| {row['run']} | {row['header_bytes']:,} B | {row['tensor_bytes']:,} B | {row['bytes_per_step']:.1f} | "
            f"{row['file_bytes']:,} B |"
        )


if __name__ == "__main__":
    main()
