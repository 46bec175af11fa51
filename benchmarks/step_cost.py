"""What does one ZO step cost, in forward passes and in memory?

For each configuration (model shape x full/LoRA), one fresh process measures, after a warm-up, the median seconds
per step and the peak resident memory of:

  (a) an inference forward (no_grad),
  (b) an hf_zo ZO step through `ZOTrainer` with the default settings (gaussian noise from the compiled Philox
      kernel), with the previous generator (`zo_noise_algorithm="torch"`) and with `zo_noise="table"`,
  (c) a MeZO reference step written here from the published algorithm (torch.manual_seed before each of its four
      sweeps, z drawn per parameter with torch.normal, out-of-place updates),
  (d) a first-order AdamW step through `transformers.Trainer`.

Every timed step is followed by one timed inference forward on the same batch, and each time ratio is the median of
the per-step ratios `step / forward` of these back-to-back pairs (`_range`: the lowest and highest pair), so a
machine that slows down or speeds up between phases moves both halves of a pair together instead of the ratio.
It prints one JSON line per configuration with the ratios `zo_step/forward`, `zo_torch_noise_step/forward`,
`zo_table_step/forward`,
`mezo_step/zo_step`, `zo_peak_mem/inference_peak_mem` and `fo_peak_mem/zo_peak_mem`, then a summary table, and
writes `docs/images/step_cost.png`. Peak memory is the resident set size above the process's size before the model
was built (libraries only), so it counts weights, activations and every temporary.

    python benchmarks/step_cost.py                      # tiny, small and OPT-125M shapes, full and LoRA
    python benchmarks/step_cost.py --sizes opt-125m     # one shape
    python benchmarks/step_cost.py --sizes opt-350m     # larger shapes on request
    python benchmarks/step_cost.py --device cuda --dtype bfloat16 --sizes opt-1.3b   # on a GPU

With `--device cuda` the model, the batch and every step run on the GPU, each timed step ends with
`torch.cuda.synchronize()`, and peak memory is `torch.cuda.max_memory_allocated` (weights included) instead of the
resident set size; without a CUDA device it prints one JSON line with a `skipped` reason and exits 0.

With `--profile` it answers where a ZO step's time goes instead, in this process, on the CPU, for full fine-tuning
of each `--sizes` shape with each `--noise` configuration (`distribution[:algorithm]`). Inside real training steps
it times the loss closures (forward passes), the noise sweeps, and everything else (Trainer bookkeeping, data
loading); then, outside training, one sweep over the model split into noise generation (chunks of noise written to
memory, on the sweep's threads) and the in-place update. It prints one JSON line per shape and noise configuration,
with the generation cost in ns per element; for the gaussian configurations after `gaussian:torch` also
`generation_speedup_vs_torch`, how many times faster than the `torch` algorithm (PyTorch's `normal_`, on the same
threads) the configuration generates. A first line compares `torch.Tensor.normal_` with the compiled kernel, on one
thread and on all of torch's threads (see `generation_speed`).

    python benchmarks/step_cost.py --profile --sizes opt-125m --steps 5   # gaussian with both algorithms, table
    python benchmarks/step_cost.py --profile --sizes small --steps 5 --noise gaussian:philox
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from common import random_opt

SHAPES = {
    "tiny": dict(hidden_size=64, num_hidden_layers=2, ffn_dim=256, num_attention_heads=4, vocab_size=1024),
    "small": dict(hidden_size=256, num_hidden_layers=4, ffn_dim=1024, num_attention_heads=4, vocab_size=8192),
    "opt-125m": dict(hidden_size=768, num_hidden_layers=12, ffn_dim=3072, num_attention_heads=12, vocab_size=50272),
    "opt-350m": dict(hidden_size=1024, num_hidden_layers=24, ffn_dim=4096, num_attention_heads=16, vocab_size=50272),
    "opt-1.3b": dict(hidden_size=2048, num_hidden_layers=24, ffn_dim=8192, num_attention_heads=32, vocab_size=50272),
}
DEFAULT_SIZES = ["tiny", "small", "opt-125m"]
ROOT = Path(__file__).resolve().parent.parent


def build_model(shape: str, lora: bool, device: str = "cpu", dtype: str = "float32"):
    """A random OPT of the named shape (optionally with LoRA r=8 on q_proj, v_proj), built on `device` in `dtype`."""
    return random_opt(SHAPES[shape], lora, device, dtype)


def make_dataset(vocab_size: int, batch: int, length: int, steps: int):
    import torch
    from datasets import Dataset

    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(2, vocab_size, (batch * steps, length), generator=generator).tolist()
    return Dataset.from_dict({"input_ids": ids, "attention_mask": [[1] * length] * len(ids), "labels": ids})


def synchronize() -> None:
    """Wait for queued CUDA work, so that a timer read afterwards counts it (no-op without CUDA in use)."""
    import torch

    if torch.cuda.is_initialized():
        torch.cuda.synchronize()


class CudaPeakMemory:
    """Context manager keeping `torch.cuda.max_memory_allocated` of its block, the CUDA analogue of `PeakMemory`.

    Attributes:
        peak_bytes (`int`): the most bytes allocated on the GPU at any time inside the block.
    """

    def __enter__(self) -> CudaPeakMemory:
        import torch

        synchronize()
        torch.cuda.reset_peak_memory_stats()
        return self

    def __exit__(self, *exc) -> None:
        import torch

        synchronize()
        self.peak_bytes = torch.cuda.max_memory_allocated()


class StepTimer:
    """A `TrainerCallback` recording the wall time of each optimizer step (GPU work included).

    With `forward` (a no-argument callable running one inference forward), it also times one forward right after
    every step: each step then has a neighbour measured under the same machine load (see :func:`paired_ratio`).
    """

    def __init__(self, forward=None):
        from transformers import TrainerCallback

        timer = self

        class _Callback(TrainerCallback):
            def on_step_begin(self, args, state, control, **kwargs):
                synchronize()
                timer._start = time.perf_counter()

            def on_step_end(self, args, state, control, **kwargs):
                synchronize()
                timer.durations.append(time.perf_counter() - timer._start)
                if forward is not None:
                    timer.forwards.append(time_call(forward))

        self.durations: list[float] = []
        self.forwards: list[float] = []
        self.callback = _Callback()


def time_call(function) -> float:
    """Seconds one call of `function` takes (queued GPU work included)."""
    synchronize()
    start = time.perf_counter()
    function()
    synchronize()
    return time.perf_counter() - start


def paired_ratio(steps: list[float], forwards: list[float]) -> tuple[float, float, float]:
    """Median, lowest and highest of `step_i / forward_i` over pairs measured back to back.

    A shared machine's speed drifts by tens of percent over minutes; a step and the forward right after it see
    the same drift, so their ratio is steadier than the ratio of two medians measured minutes apart.
    """
    ratios = [step / forward for step, forward in zip(steps, forwards, strict=True)]
    return statistics.median(ratios), min(ratios), max(ratios)


def time_trainer(
    trainer_cls,
    model,
    args_cls,
    dataset,
    steps: int,
    warmup: int,
    device: str = "cpu",
    batch: int = 8,
    forward=None,
    **extra,
):
    """Train `steps + warmup` steps; returns the measured steps' seconds, their paired forwards' and the memory."""
    from hf_zo.demo.memory import PeakMemory

    args = args_cls(
        output_dir="/tmp/hf_zo_bench",
        max_steps=steps + warmup,
        per_device_train_batch_size=batch,
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
        use_cpu=device == "cpu",
        logging_steps=10_000,
        dataloader_num_workers=0,
        **extra,
    )
    timer = StepTimer(forward)
    trainer = trainer_cls(model=model, args=args, train_dataset=dataset, callbacks=[timer.callback])
    with CudaPeakMemory() if device == "cuda" else PeakMemory() as memory:
        trainer.train()
    return timer.durations[warmup:], timer.forwards[warmup:], memory


def mezo_reference_step(model, batch, lr=1e-6, eps=1e-3, weight_decay=0.0):
    """One step of the published MeZO algorithm (reference implementation style)."""
    import numpy as np
    import torch

    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    seed = np.random.randint(1_000_000_000)

    def perturb(scale):
        torch.manual_seed(seed)
        for _, p in params:
            z = torch.normal(mean=0, std=1, size=p.data.size(), device=p.data.device, dtype=p.data.dtype)
            p.data = p.data + scale * z * eps

    with torch.no_grad():
        perturb(1)
        loss_plus = model(**batch).loss
        perturb(-2)
        loss_minus = model(**batch).loss
        perturb(1)
        projected_grad = ((loss_plus - loss_minus) / (2 * eps)).item()
        torch.manual_seed(seed)
        for name, p in params:
            z = torch.normal(mean=0, std=1, size=p.data.size(), device=p.data.device, dtype=p.data.dtype)
            if "bias" not in name and "layer_norm" not in name and "layernorm" not in name:
                p.data = p.data - lr * (projected_grad * z + weight_decay * p.data)
            else:
                p.data = p.data - lr * (projected_grad * z)


def measure(
    shape: str,
    lora: bool,
    steps: int,
    warmup: int,
    length: int = 64,
    batch: int = 8,
    device: str = "cpu",
    dtype: str = "float32",
) -> dict:
    """All four measurements for one configuration, in this process."""
    import gc

    import torch
    from transformers import Trainer, TrainingArguments

    from hf_zo import ZOConfig, ZOTrainer
    from hf_zo.demo.memory import PeakMemory, resident_bytes
    from hf_zo.noise import resolve_noise_algorithm

    on_cuda = device == "cuda"
    peak_memory = CudaPeakMemory if on_cuda else PeakMemory
    baseline = 0 if on_cuda else resident_bytes()
    dataset = make_dataset(SHAPES[shape]["vocab_size"], batch, length, steps + warmup)
    batch_inputs = {
        k: torch.tensor(dataset[:batch][k], device=device) for k in ("input_ids", "attention_mask", "labels")
    }

    model = build_model(shape, lora, device, dtype).eval()

    def forward():
        with torch.no_grad():
            model(**batch_inputs)

    with peak_memory() as inference_memory:
        durations = [time_call(forward) for _ in range(warmup + steps)]
    forward_s = statistics.median(durations[warmup:])

    lr = 1e-4 if lora else 1e-6
    runs = {
        "zo": dict(),
        "zo_torch_noise": dict(zo_noise_algorithm="torch"),
        "zo_table": dict(zo_noise="table"),
    }
    timed, memories = {}, {}
    for name, extra in runs.items():
        step_s, forward_pairs, memories[name] = time_trainer(
            ZOTrainer, model, ZOConfig, dataset, steps, warmup, device, batch, forward, learning_rate=lr, **extra
        )
        timed[name] = (step_s, forward_pairs)

    mezo_s, mezo_forwards = [], []
    with peak_memory() as memories["mezo"]:
        for i in range(warmup + steps):
            step = time_call(lambda: mezo_reference_step(model, batch_inputs, lr=lr))
            paired = time_call(forward)
            if i >= warmup:
                mezo_s.append(step)
                mezo_forwards.append(paired)
    timed["mezo"] = (mezo_s, mezo_forwards)

    del model
    gc.collect()  # the ZO trainers' reference cycles would otherwise keep the first model on the GPU
    model = build_model(shape, lora, device, dtype)
    fo_s, fo_forwards, memories["fo"] = time_trainer(
        Trainer, model, TrainingArguments, dataset, steps, warmup, device, batch, forward, learning_rate=lr
    )  # `forward` now runs this model: the same shape, the same cost
    timed["fo"] = (fo_s, fo_forwards)

    def above_baseline(memory):
        return (memory.peak_bytes - baseline) / 2**20

    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    result = {
        "shape": shape,
        "mode": "lora" if lora else "full",
        "trainable_params": trainable,
        "batch": f"{batch}x{length}",
        "device": device,
        "dtype": dtype,
        "peak_memory": "torch.cuda.max_memory_allocated" if on_cuda else "resident set size above baseline",
        "threads": torch.get_num_threads(),
        "noise_algorithm": resolve_noise_algorithm("auto"),
        "forward_s": round(forward_s, 4),
        **{f"{name}_step_s": round(statistics.median(step_s), 4) for name, (step_s, _) in timed.items()},
        "inference_peak_mib": round(above_baseline(inference_memory), 1),
        **{f"{name}_peak_mib": round(above_baseline(memories[name]), 1) for name in ("zo", "mezo", "fo")},
    }
    # Time ratios from pairs measured back to back (see paired_ratio); "_range" is the lowest and highest pair.
    in_forwards = {name: paired_ratio(*pairs) for name, pairs in timed.items()}
    for name, (median, low, high) in in_forwards.items():
        result[f"{name}_step/forward"] = round(median, 3)
        result[f"{name}_step/forward_range"] = [round(low, 3), round(high, 3)]
    result.update(
        {
            "mezo_step/zo_step": round(in_forwards["mezo"][0] / in_forwards["zo"][0], 3),
            "fo_step/zo_step": round(in_forwards["fo"][0] / in_forwards["zo"][0], 3),
            "zo_peak_mem/inference_peak_mem": round(result["zo_peak_mib"] / result["inference_peak_mib"], 3),
            "fo_peak_mem/zo_peak_mem": round(result["fo_peak_mib"] / result["zo_peak_mib"], 3),
        }
    )
    return result


def plot(results: list[dict], path: Path) -> None:
    """Bar chart of step cost in forward passes per configuration."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r['shape']}\n{r['mode']}" for r in results]
    series = {
        "hf_zo ZO step": [r["zo_step/forward"] for r in results],
        "hf_zo ZO step (previous torch generator)": [r["zo_torch_noise_step/forward"] for r in results],
        "hf_zo ZO step (table noise)": [r["zo_table_step/forward"] for r in results],
        "MeZO reference step": [r["mezo_step/forward"] for r in results],
        "first-order AdamW step": [r["fo_step/forward"] for r in results],
    }
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(results)), 4))
    width = 0.8 / len(series)
    for k, (name, values) in enumerate(series.items()):
        ax.bar([i + k * width for i in range(len(results))], values, width, label=name)
    ax.axhline(2.0, color="black", linestyle="--", linewidth=0.8, label="ideal: two forwards")
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(results))], labels)
    ax.set_ylabel("seconds per step / seconds per forward")
    ax.set_title("Cost of one training step, in forward passes (CPU, 2 threads)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


def print_table(results: list[dict]) -> None:
    columns = [
        "shape",
        "mode",
        "forward_s",
        "zo_step/forward",
        "zo_torch_noise_step/forward",
        "zo_table_step/forward",
        "mezo_step/zo_step",
        "zo_peak_mem/inference_peak_mem",
        "fo_peak_mem/zo_peak_mem",
    ]
    widths = [max(len(c), *(len(str(r[c])) for r in results)) for c in columns]
    print(" | ".join(c.ljust(w) for c, w in zip(columns, widths)))
    print("-+-".join("-" * w for w in widths))
    for r in results:
        print(" | ".join(str(r[c]).ljust(w) for c, w in zip(columns, widths)))


# ---------------------------------------------------------------------------------------------------- --profile


class Stopwatch:
    """The total seconds spent inside the functions it wraps, over all their calls (`seconds`, settable)."""

    def __init__(self):
        self.seconds = 0.0

    def wrap(self, function):
        """`function`, its time added to `seconds` on every call."""

        @functools.wraps(function)
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start

        return timed


def time_step_parts(model, dataset, distribution: str, algorithm: str, steps: int, warmup: int, batch: int) -> dict:
    """Seconds of `steps` ZO steps through `ZOTrainer` on the CPU (after `warmup` more): in all (`steps`), inside the
    loss closures (`forwards`, the forward passes) and inside `Noise.apply_` (`sweeps`); the rest is Trainer
    bookkeeping and data loading."""
    from unittest import mock

    from transformers import TrainerCallback

    from hf_zo import ZOConfig, ZOTrainer
    from hf_zo.noise import Noise

    forwards, sweeps = Stopwatch(), Stopwatch()

    class ResetAfterWarmup(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == warmup:
                forwards.seconds = sweeps.seconds = 0.0

    args = ZOConfig(
        output_dir="/tmp/hf_zo_profile",
        max_steps=steps + warmup,
        per_device_train_batch_size=batch,
        learning_rate=1e-6,
        zo_noise=distribution,
        zo_noise_algorithm=algorithm,
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
        use_cpu=True,
        logging_steps=10_000,
    )
    timer = StepTimer()
    with (
        mock.patch.object(Noise, "apply_", sweeps.wrap(Noise.apply_)),
        mock.patch.object(ZOTrainer, "compute_loss", forwards.wrap(ZOTrainer.compute_loss)),
    ):
        callbacks = [timer.callback, ResetAfterWarmup()]
        ZOTrainer(model=model, args=args, train_dataset=dataset, callbacks=callbacks).train()
    return {"steps": sum(timer.durations[warmup:]), "forwards": forwards.seconds, "sweeps": sweeps.seconds}


def time_one_sweep(params: list, sampler) -> dict:
    """Median seconds (of 3, after a warm-up that also builds `table` noise's table) of one pass of `sampler` over
    `params` (`(index, tensor)` pairs): generating the noise only (`generate`), generating it and adding it
    (`generate_and_add`), and the sweep training runs (`sweep`: for `philox` on the CPU, the compiled kernel's fused
    sweep, z never stored)."""
    from hf_zo.noise import NoiseUpdate

    def generate_only(position, start, chunk, scratch):
        sampler.chunk(scratch[0][: chunk.numel()], 1, params[position][0], start)

    def generate_and_add(position, start, chunk, scratch):
        chunk.add_(sampler.chunk(scratch[0][: chunk.numel()], 1, params[position][0], start), alpha=0.0)

    passes = {
        "generate": lambda: sampler.map_chunks(params, generate_only),
        "generate_and_add": lambda: sampler.map_chunks(params, generate_and_add),
        "sweep": lambda: sampler.apply_(params, [NoiseUpdate(terms={1: 1e-9})] * len(params)),
    }
    seconds = {}
    for name, run in passes.items():
        run()
        seconds[name] = statistics.median([time_call(run) for _ in range(3)])
    return seconds


def profile(shape: str, noise: str, steps: int, warmup: int, batch: int = 8, length: int = 64) -> dict:
    """One line of the profile: where the time of full fine-tuning's ZO steps on a random OPT of `shape` goes with
    `noise` (`distribution[:algorithm]`), and the cost of one sweep over the model, per element."""
    import torch

    from hf_zo.noise import Noise

    distribution, _, algorithm = noise.partition(":")
    algorithm = algorithm or "auto"
    model = build_model(shape, lora=False)
    dataset = make_dataset(SHAPES[shape]["vocab_size"], batch, length, steps + warmup)
    seconds = time_step_parts(model, dataset, distribution, algorithm, steps, warmup, batch)
    params = [(i, p.data) for i, p in enumerate(p for p in model.parameters() if p.requires_grad)]
    numel = sum(p.numel() for _, p in params)
    sampler = Noise(distribution, algorithm=algorithm)
    sweep = time_one_sweep(params, sampler)
    total, forwards, sweeps = seconds["steps"], seconds["forwards"], seconds["sweeps"]
    forward = forwards / (2 * steps)
    return {
        "shape": shape,
        "noise": f"{distribution}:{sampler.algorithm}" if distribution != "table" else distribution,
        "trainable_params": numel,
        "threads": torch.get_num_threads(),
        "step_s": round(total / steps, 4),
        "forward_s": round(forward, 4),
        "step/forward": round(total / steps / forward, 3),
        "share_forwards": round(forwards / total, 3),
        "share_sweeps": round(sweeps / total, 3),
        "share_other": round(1 - (forwards + sweeps) / total, 3),
        "sweeps_per_step_s": round(sweeps / steps, 4),
        "one_sweep_generation_s": round(sweep["generate"], 4),
        "one_sweep_generation_and_update_s": round(sweep["generate_and_add"], 4),
        "one_sweep_as_trained_s": round(sweep["sweep"], 4),
        "noise_ns_per_element": round(sweep["generate"] / numel * 1e9, 3),
        "sweep_ns_per_element": round(sweep["sweep"] / numel * 1e9, 3),
    }


def generation_speed(numel: int = 1 << 22, repeats: int = 25) -> dict:
    """ns per element of `torch.Tensor.normal_` and of the compiled kernel, on one thread and on all of torch's
    threads (wall time).

    On one thread the kernel's `fill` is timed, gaussian and rademacher (the latter is Philox alone: one sign bit per
    word, no Box-Muller); on all threads its parallel sweep (`apply`, ``x <- x + 0.5 z``, what a ZO step runs), while
    `normal_` is given the same threads (it uses one: its generator is sequential). The calls alternate, `repeats`
    rounds of one call each, so that both sides see the same moments of a shared machine; each is reported as its
    best round, and ``speedup`` is `normal_`'s best over the kernel's gaussian best.
    """
    import torch

    from hf_zo.philox import load_kernel

    kernel = load_kernel()
    threads = torch.get_num_threads()
    out, generator = torch.empty(numel), torch.Generator().manual_seed(0)

    def paired_rounds(calls: dict) -> dict:
        for call in calls.values():
            call()
        seconds = {name: [] for name in calls}
        for _ in range(repeats):
            for name, call in calls.items():
                start = time.perf_counter()
                call()
                seconds[name].append(time.perf_counter() - start)
        return seconds

    result = {}
    try:
        for num_threads in sorted({1, threads}):
            torch.set_num_threads(num_threads)
            calls = {"torch_normal": lambda: out.normal_(generator=generator)}
            if kernel is not None and num_threads == 1:
                calls["philox_gaussian"] = lambda: kernel.fill(out, 1, 0, 0, True)
                calls["philox_rademacher"] = lambda: kernel.fill(out, 1, 0, 0, False)
            elif kernel is not None:
                calls["philox_gaussian"] = lambda: kernel.apply([out], [0], [1.0], [[1]], [[0.5]], True)
            seconds = paired_rounds(calls)
            best = {name: min(times) / numel * 1e9 for name, times in seconds.items()}
            line = {f"{name}_ns_per_element": round(ns, 3) for name, ns in best.items()}
            if kernel is not None:
                line["speedup"] = round(best["torch_normal"] / best["philox_gaussian"], 2)
            result[f"threads_{num_threads}"] = line
    finally:
        torch.set_num_threads(threads)
    return result


def run_profile(args: argparse.Namespace) -> None:
    """`--profile`: the generation line (:func:`generation_speed`), then one line per shape and noise configuration,
    the gaussian ones after `gaussian:torch` with `generation_speedup_vs_torch`."""
    print(json.dumps(generation_speed()), flush=True)
    for shape in args.sizes:
        torch_ns = None
        for noise in args.noise:
            result = profile(shape, noise, args.steps, args.warmup, args.batch, args.length)
            if result["noise"] == "gaussian:torch":
                torch_ns = result["noise_ns_per_element"]
            elif result["noise"].startswith("gaussian") and torch_ns:
                result["generation_speedup_vs_torch"] = round(torch_ns / result["noise_ns_per_element"], 2)
            print(json.dumps(result), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", nargs="+", default=DEFAULT_SIZES, choices=sorted(SHAPES))
    parser.add_argument("--modes", nargs="+", default=["full", "lora"], choices=["full", "lora"])
    parser.add_argument("--steps", type=int, default=8, help="measured steps per phase (after the warm-up)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--batch", type=int, default=8, help="sequences per step")
    parser.add_argument("--length", type=int, default=64, help="tokens per sequence")
    parser.add_argument("--plot", default=str(ROOT / "docs" / "images" / "step_cost.png"), help="'' for no plot")
    parser.add_argument("--profile", action="store_true", help="where a step's time goes (full fine-tuning, CPU)")
    parser.add_argument(
        "--noise",
        nargs="+",
        default=["gaussian:torch", "gaussian:philox", "table"],
        help="--profile: the noise configurations, distribution[:algorithm]",
    )
    parser.add_argument("--single", nargs=2, metavar=("SHAPE", "MODE"), help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.profile:
        if (args.device, args.dtype) != ("cpu", "float32"):
            parser.error("--profile times float32 steps on the CPU: drop --device and --dtype")
        run_profile(args)
        return

    if args.single:
        shape, mode = args.single
        measured = measure(
            shape, mode == "lora", args.steps, args.warmup, args.length, args.batch, args.device, args.dtype
        )
        print(json.dumps(measured))
        return
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            print(json.dumps({"device": "cuda", "skipped": "CUDA is not available"}), flush=True)
            return

    results = []
    for shape in args.sizes:
        for mode in args.modes:
            command = [sys.executable, __file__, "--single", shape, mode, "--steps", str(args.steps)]
            command += ["--warmup", str(args.warmup), "--device", args.device, "--dtype", args.dtype]
            command += ["--batch", str(args.batch), "--length", str(args.length)]
            env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error")
            # stderr passes through: a failing configuration shows its traceback.
            out = subprocess.run(command, check=True, stdout=subprocess.PIPE, text=True, env=env).stdout
            result = json.loads(out.strip().splitlines()[-1])
            print(json.dumps(result), flush=True)
            results.append(result)
    print()
    print_table(results)
    if args.plot and not math.isnan(results[0]["forward_s"]):
        plot(results, Path(args.plot))
        print(f"\nplot written to {args.plot}")


if __name__ == "__main__":
    main()
