"""Where does a ZO step's time go? A profile of `ZOTrainer` steps on a random OPT (OPT-125M shape by default).

Times, inside real training steps: the loss closures (forward passes), the noise sweeps, and everything else
(Trainer bookkeeping, data loading); then, outside training, the cost of one sweep over the model split into noise
generation (chunks of noise written to memory, on the sweep's threads) and the in-place update. Prints one JSON line
per noise configuration (`distribution:algorithm`), with the generation cost in ns per element; for the gaussian
configurations also `generation_speedup_vs_torch`, how many times faster than the `torch` algorithm (PyTorch's
`normal_`, on the same threads) the configuration generates. A first line compares `torch.Tensor.normal_` with the
compiled kernel, on one thread and on all of torch's threads (see `generation_speed`).

    python benchmarks/step_profile.py                   # opt-125m: gaussian with both algorithms, table noise
    python benchmarks/step_profile.py --shape small --noise gaussian:philox
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from step_cost import SHAPES, StepTimer, build_model, make_dataset
from transformers import TrainerCallback

from hf_zo import ZOConfig, ZOTrainer
from hf_zo.noise import Noise, NoiseUpdate


class _Stopwatch:
    def __init__(self):
        self.seconds = 0.0

    def wrap(self, function):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start

        return timed


def profile(shape: str, noise: str, steps: int, warmup: int, batch: int = 8, length: int = 64) -> dict:
    distribution, _, algorithm = noise.partition(":")
    algorithm = algorithm or "auto"
    model = build_model(shape, lora=False)
    dataset = make_dataset(SHAPES[shape]["vocab_size"], batch, length, steps + warmup)
    forwards, sweeps = _Stopwatch(), _Stopwatch()
    original_apply = Noise.apply_
    Noise.apply_ = sweeps.wrap(original_apply)
    original_compute_loss = ZOTrainer.compute_loss
    ZOTrainer.compute_loss = forwards.wrap(original_compute_loss)
    timer = StepTimer()

    class ResetAfterWarmup(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == warmup:
                forwards.seconds = sweeps.seconds = 0.0

    try:
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
        trainer = ZOTrainer(
            model=model, args=args, train_dataset=dataset, callbacks=[timer.callback, ResetAfterWarmup()]
        )
        trainer.train()
    finally:
        Noise.apply_ = original_apply
        ZOTrainer.compute_loss = original_compute_loss
    total = sum(timer.durations[warmup:])

    # One sweep of the whole model, split into generation and update.
    params = [(i, p.data) for i, p in enumerate(p for p in model.parameters() if p.requires_grad)]
    numel = sum(p.numel() for _, p in params)
    sampler = Noise(distribution, algorithm=algorithm)

    def generate_only(position, start, chunk, scratch):
        sampler.chunk(scratch[0][: chunk.numel()], 1, params[position][0], start)

    def generate_and_add(position, start, chunk, scratch):
        chunk.add_(sampler.chunk(scratch[0][: chunk.numel()], 1, params[position][0], start), alpha=0.0)

    def sweep():
        # What training runs: for 'philox' on the CPU, the compiled kernel's fused sweep (z never stored).
        sampler.apply_(params, [NoiseUpdate(terms={1: 1e-9})] * len(params))

    timings = {}
    for name, run in (
        ("generate", lambda: sampler.map_chunks(params, generate_only)),
        ("generate_and_add", lambda: sampler.map_chunks(params, generate_and_add)),
        ("sweep", sweep),
    ):
        run()  # warm-up (builds the table for "table")
        runs = []
        for _ in range(3):
            start = time.perf_counter()
            run()
            runs.append(time.perf_counter() - start)
        timings[name] = statistics.median(runs)
    forward = forwards.seconds / (2 * steps)
    return {
        "shape": shape,
        "noise": f"{distribution}:{sampler.algorithm}" if distribution != "table" else distribution,
        "trainable_params": numel,
        "threads": torch.get_num_threads(),
        "step_s": round(total / steps, 4),
        "forward_s": round(forward, 4),
        "step/forward": round(total / steps / forward, 3),
        "share_forwards": round(forwards.seconds / total, 3),
        "share_sweeps": round(sweeps.seconds / total, 3),
        "share_other": round(1 - (forwards.seconds + sweeps.seconds) / total, 3),
        "sweeps_per_step_s": round(sweeps.seconds / steps, 4),
        "one_sweep_generation_s": round(timings["generate"], 4),
        "one_sweep_generation_and_update_s": round(timings["generate_and_add"], 4),
        "one_sweep_as_trained_s": round(timings["sweep"], 4),
        "noise_ns_per_element": round(timings["generate"] / numel * 1e9, 3),
        "sweep_ns_per_element": round(timings["sweep"] / numel * 1e9, 3),
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="opt-125m", choices=sorted(SHAPES))
    parser.add_argument("--noise", nargs="+", default=["gaussian:torch", "gaussian:philox", "table"])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    args = parser.parse_args()
    print(json.dumps(generation_speed()), flush=True)
    torch_ns = None
    for noise in args.noise:
        result = profile(args.shape, noise, args.steps, args.warmup)
        if result["noise"] == "gaussian:torch":
            torch_ns = result["noise_ns_per_element"]
        elif result["noise"].startswith("gaussian") and torch_ns:
            result["generation_speedup_vs_torch"] = round(torch_ns / result["noise_ns_per_element"], 2)
        print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
