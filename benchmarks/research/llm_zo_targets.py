"""Which weights of the embedded LLM ZO should perturb: each group's gradient signal, gradient noise and curvature.

For a set G of trained tensors, one ZO-SGD step along a Gaussian direction changes the loss on average by about
``-lr * S_G + lr**2 / 2 * N_G * T_G``, where ``S_G`` is the squared norm of the gradient of the expected loss
(the signal), ``N_G`` the mean squared norm of one batch's gradient (the signal and the batch noise) and ``T_G``
the trace of the Hessian (the curvature the random direction meets). The best rate gives ``-S_G**2 / (2 N_G T_G)``:
a set of weights is worth perturbing when its signal is large against the noise and curvature it brings. This
script estimates the three by groups (each linear type's LoRA B, each RMSNorm type, by bands of 10 layers), with
the prompt task of the learning-curve benchmark:

- ``S`` and ``N`` from first-order gradients of `--batches` training batches (a diagnostic only: ZO never needs
  them), ``S`` unbiased: ``(K |mean g|^2 - mean |g|^2) / (K - 1)``;
- ``T`` from forwards alone (Hutchinson's estimator by second differences, ``(L(w + eps z) + L(w - eps z) - 2
  L(w)) / eps**2`` averaged over `--samples` Gaussian directions on one batch); with few samples it is noisy, and
  negative estimates are counted as zero in the sums.

Then it prints, for candidate sets (LoRA on q and v; on q alone, and on q of layers 10-29, the default for a prompt
task; on every linear layer; the RMSNorms), ``S``, ``N``, ``T`` and the best expected decrease per step (each group's
own line gives them by band: ``q_proj:0`` is q_proj of layers 0-9)::

    python -m benchmarks.research.llm_zo_targets --template review --output /tmp/zo_targets.json
"""

from __future__ import annotations

import argparse
import json
import os

import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, AutoTokenizer

from benchmarks.common import SST2_DIR
from benchmarks.research.llm_learning_curve import read_sst2, templates
from hf_zo.models import embedded_llm_path
from hf_zo.prompts import PromptClassification

LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
NORMS = {"input_layernorm": "input_norm", "post_attention_layernorm": "post_attention_norm"}
CANDIDATES = {
    "LoRA on q, v (the default)": ["q_proj", "v_proj"],
    "LoRA on q": ["q_proj"],
    "LoRA on q of layers 10-29": ["q_proj:1", "q_proj:2"],
    "LoRA on v": ["v_proj"],
    "LoRA on q, k, v, o": ["q_proj", "k_proj", "v_proj", "o_proj"],
    "LoRA on the MLP": ["gate_proj", "up_proj", "down_proj"],
    "LoRA on every linear layer": LINEAR,
    "the RMSNorms (LN tuning)": [*NORMS.values(), "final_norm"],
}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data_dir", default=str(SST2_DIR), help="Folder with train.tsv.")
    parser.add_argument("--model", default=None, help="Model path (default: the embedded LLM).")
    parser.add_argument("--template", default="review", help="A template of research/llm_learning_curve.py.")
    parser.add_argument("--batches", type=int, default=12, help="Training batches whose gradients give S and N.")
    parser.add_argument("--samples", type=int, default=4, help="Gaussian directions per group for T.")
    parser.add_argument("--batch_size", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", default=None, help="Where the JSON goes (default: printed only).")
    return parser.parse_args()


def group_of(name: str) -> str:
    """The group of a trained tensor: its kind and its band of 10 layers, e.g. ``"q_proj:1"``."""
    layer = int(name.split("layers.")[1].split(".")[0]) if "layers." in name else None
    kind = next((t for t in LINEAR if t in name), None)
    kind = kind or next((short for module, short in NORMS.items() if module in name), "final_norm")
    return f"{kind}:{(layer if layer is not None else 29) // 10}"


def main() -> None:
    options = parse_args()
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    torch.manual_seed(options.seed)
    path = options.model or embedded_llm_path()
    tokenizer = AutoTokenizer.from_pretrained(path)
    template, words = templates(tokenizer)[options.template]
    task = PromptClassification(tokenizer, template, words)
    count = options.batch_size * (options.batches + 1)
    rows = task.tokenize(read_sst2(options.data_dir)["train"].shuffle(seed=42).select(range(400, 400 + count)))
    model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32),
        LoraConfig(r=8, lora_alpha=16, target_modules=LINEAR),
    ).eval()
    params = {}
    for name, param in model.named_parameters():  # LoRA's B (A stays a random projection) and every norm weight
        param.requires_grad_("lora_B" in name or "norm" in name)
        if param.requires_grad:
            params[name] = param
    groups = {}
    for name in params:
        groups.setdefault(group_of(name), []).append(name)

    def batch(index):
        batch = task([rows[i] for i in range(index * options.batch_size, (index + 1) * options.batch_size)])
        return batch, batch.pop("labels")

    def loss(inputs, labels):
        return task.compute_loss(model(**inputs), labels)

    gradients = {group: [] for group in groups}
    for index in range(options.batches):
        model.zero_grad()
        loss(*batch(index)).backward()
        for group, names in groups.items():
            gradients[group].append(torch.cat([params[n].grad.flatten() for n in names]))
    inputs, labels = batch(options.batches)  # a batch of its own for the curvature
    results = {}
    with torch.no_grad():
        centre = loss(inputs, labels).item()
        for group, names in sorted(groups.items()):
            stack = torch.stack(gradients[group])
            mean_square = stack.pow(2).sum(1).mean().item()
            k = options.batches
            signal = (k * stack.mean(0).pow(2).sum().item() - mean_square) / (k - 1)
            eps = 1e-3 if "norm" in group else 1e-2  # the zo_eps each is trained with
            curvature = []
            for _ in range(options.samples):
                direction = {n: torch.randn_like(params[n]) for n in names}
                for n in names:
                    params[n].add_(direction[n], alpha=eps)
                plus = loss(inputs, labels).item()
                for n in names:
                    params[n].add_(direction[n], alpha=-2 * eps)
                minus = loss(inputs, labels).item()
                for n in names:
                    params[n].add_(direction[n], alpha=eps)
                curvature.append((plus + minus - 2 * centre) / eps**2)
            results[group] = {
                "parameters": stack.shape[1],
                "S": signal,
                "N": mean_square,
                "T": sum(curvature) / len(curvature),
                "T_samples": [round(c, 3) for c in curvature],
            }
            print(json.dumps({"group": group, **results[group]}), flush=True)
    print("\n| weights ZO perturbs | parameters | S | N | T | S / N | best decrease a step, S^2 / (2 N T) |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    summary = {}
    for candidate, kinds in CANDIDATES.items():
        chosen = [results[g] for g in results if g.split(":")[0] in kinds or g in kinds]  # a kind, or one band
        size = sum(r["parameters"] for r in chosen)
        signal, noise = sum(r["S"] for r in chosen), sum(r["N"] for r in chosen)
        curvature = sum(max(r["T"], 0.0) for r in chosen)
        best = signal**2 / (2 * noise * curvature)
        summary[candidate] = {"parameters": size, "S": signal, "N": noise, "T": curvature, "best_decrease": best}
        print(
            f"| {candidate} | {size:,} | {signal:.4f} | {noise:.3f} | {curvature:.2f} | {signal / noise:.3f} | "
            f"{best:.2e} |"
        )
    if options.output:
        with open(options.output, "w") as file:
            json.dump({"centre_loss": centre, "groups": results, "candidates": summary}, file, indent=1)


if __name__ == "__main__":
    main()
