"""Where does a ZO step's time go? A profile of `ZOTrainer` steps on a random OPT (OPT-125M shape by default).

Times, inside real training steps: the loss closures (forward passes), the noise sweeps, and everything else
(Trainer bookkeeping, data loading); then, outside training, the cost of one sweep split into noise generation
and the in-place update over memory. Prints one JSON line per noise distribution.

    python benchmarks/step_profile.py                   # opt-125m, full fine-tuning, gaussian and table noise
    python benchmarks/step_profile.py --shape small --noise gaussian
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
from hf_zo.noise import Noise


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
            zo_noise=noise,
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
    sampler = Noise(noise)

    def generate_only(position, start, chunk, scratch):
        sampler.chunk(scratch[0][: chunk.numel()], 1, params[position][0], start)

    def generate_and_add(position, start, chunk, scratch):
        chunk.add_(sampler.chunk(scratch[0][: chunk.numel()], 1, params[position][0], start), alpha=0.0)

    timings = {}
    for name, visit in (("generate", generate_only), ("generate_and_add", generate_and_add)):
        sampler.map_chunks(params, visit)  # warm-up (builds the table for "table")
        runs = []
        for _ in range(3):
            start = time.perf_counter()
            sampler.map_chunks(params, visit)
            runs.append(time.perf_counter() - start)
        timings[name] = statistics.median(runs)
    forward = forwards.seconds / (2 * steps)
    return {
        "shape": shape,
        "noise": noise,
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
        "noise_ns_per_element": round(timings["generate"] / numel * 1e9, 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="opt-125m", choices=sorted(SHAPES))
    parser.add_argument("--noise", nargs="+", default=["gaussian", "table"])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    args = parser.parse_args()
    for noise in args.noise:
        print(json.dumps(profile(args.shape, noise, args.steps, args.warmup)), flush=True)


if __name__ == "__main__":
    main()
