"""Step time and peak memory of the sequential engine, the dual engine and the dual engine with offloaded blocks.

CPU section (always). For each shape (random OPT, fp32) and engine (`sequential`, `dual`, `dual+disk` with a warm
page cache): the median and minimum seconds per ZO-SGD step, measured in one process that interleaves the three
engines step by step so that all see the same machine load (ratios use the minimum, the least disturbed step); and,
in a fresh process per engine, the peak anonymous resident memory over two steps above the process's size before
the model was built (the disk tier's blocks are file-backed pages and do not count; their total is printed next to
it). Target: `dual+disk` step time <= 1.25x `dual`.

GPU section (only when CUDA is available). A ~1.3B-parameter random OPT in bf16: the dual engine with every block
resident on the GPU, against `dual+cpu` (blocks in pinned host memory) with prefetch 1 and with prefetch 0 (no
overlap of transfers and compute), and against `dual+disk` (blocks in memory-mapped files, uploaded from the page
cache). Reports step time, `torch.cuda.max_memory_allocated`, the bound `resident modules + (prefetch + 1) blocks +
activations` (activations measured on the resident run), the ratio to resident and the overlap (time without
prefetch / time with). Targets: `dual+cpu` <= 1.15x resident, peak <= the bound; the disk tier's ratio is reported
on its own summary line.

Every measurement prints one JSON line; each section ends with a summary line of ratios.

    python benchmarks/offload.py                          # CPU: opt-125m and deep shapes (+ GPU when present)
    python benchmarks/offload.py --quick                  # small shapes, few steps (about a minute on 2 cores)
    python benchmarks/offload.py --sizes deep --batch 2 --length 64 --steps 3
    python benchmarks/offload.py --gpu-only --gpu-batch 8 --gpu-length 512 --steps 3 --warmup 1
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

from common import random_opt

SHAPES = {
    "tiny": dict(hidden_size=128, num_hidden_layers=8, ffn_dim=512, num_attention_heads=4, vocab_size=1024),
    "small": dict(hidden_size=256, num_hidden_layers=16, ffn_dim=1024, num_attention_heads=4, vocab_size=4096),
    "opt-125m": dict(hidden_size=768, num_hidden_layers=12, ffn_dim=3072, num_attention_heads=12, vocab_size=50272),
    "deep": dict(hidden_size=1024, num_hidden_layers=32, ffn_dim=4096, num_attention_heads=16, vocab_size=8192),
    "opt-1.3b": dict(hidden_size=2048, num_hidden_layers=24, ffn_dim=8192, num_attention_heads=32, vocab_size=50272),
}
CPU_ENGINES = ["sequential", "dual", "dual+disk"]
ROOT = Path(__file__).resolve().parent.parent


def build_model(shape: str, dtype=None):
    """A random OPT of the named shape, in eval mode."""
    import torch

    return random_opt(SHAPES[shape], dtype=str(dtype or torch.float32).removeprefix("torch.")).eval()


def block_and_resident_bytes(model) -> tuple[int, int]:
    """Bytes of one block, and of everything that is not a block (the resident modules)."""
    from hf_zo.engine import find_blocks

    blocks = find_blocks(model)
    block = sum(p.nbytes for p in blocks[0].parameters())
    total = sum(p.nbytes for p in model.parameters())
    return block, total - block * len(blocks)


def anonymous_rss() -> int:
    """This process's anonymous resident memory in bytes (Linux), or its peak RSS elsewhere."""
    try:
        with open("/proc/self/status") as status:
            return next(int(line.split()[1]) * 1024 for line in status if line.startswith("RssAnon:"))
    except OSError:
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class PeakSampler:
    """Samples `anonymous_rss` every few milliseconds on a background thread and keeps the maximum."""

    def __init__(self, interval: float = 0.002):
        self.peak = anonymous_rss()
        self._interval = interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            self.peak = max(self.peak, anonymous_rss())

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return max(self.peak, anonymous_rss())


def make_optimizer(model, engine: str, offloader=None):
    from hf_zo.engine import DualEngine
    from hf_zo.optim import ZOSGD

    optimizer = ZOSGD([p for p in model.parameters() if p.requires_grad], lr=1e-7, eps=1e-3, seed=0)
    if engine != "sequential":
        optimizer.attach_engine(DualEngine(model, offloader=offloader))
    return optimizer


def time_steps(optimizer, closure, warmup: int, steps: int, synchronize=lambda: None) -> tuple[float, float]:
    """Median and minimum seconds of `steps` optimizer steps after `warmup` untimed ones (the minimum is the least
    disturbed by other load on the machine, and is what the ratios use)."""
    for _ in range(warmup):
        optimizer.step(closure)
    synchronize()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        optimizer.step(closure)
        synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times), min(times)


# ---------------------------------------------------------------------------------------------------- workers


def cpu_timing_worker(shape: str, batch: int, length: int, steps: int, warmup: int, prefetch: int) -> dict:
    """Seconds per step of every CPU engine, interleaved step by step so that all see the same machine load."""
    import torch

    from hf_zo.engine import offload_model

    ids = torch.randint(2, SHAPES[shape]["vocab_size"], (batch, length), generator=torch.Generator().manual_seed(0))
    runs = {}
    for engine in CPU_ENGINES:
        model = build_model(shape)
        offloader = offload_model(model, "disk", device="cpu", prefetch=prefetch) if engine == "dual+disk" else None
        runs[engine] = (
            make_optimizer(model, engine, offloader),
            lambda model=model: model(input_ids=ids, labels=ids).loss,
        )
    times = {engine: [] for engine in CPU_ENGINES}
    for step in range(warmup + steps):
        order = CPU_ENGINES[step % len(CPU_ENGINES) :] + CPU_ENGINES[: step % len(CPU_ENGINES)]
        for engine in order:
            optimizer, closure = runs[engine]
            start = time.perf_counter()
            optimizer.step(closure)
            if step >= warmup:
                times[engine].append(time.perf_counter() - start)
    return {engine: (statistics.median(t), min(t)) for engine, t in times.items()}


def cpu_memory_worker(shape: str, engine: str, batch: int, length: int, prefetch: int) -> dict:
    """Peak anonymous memory of one engine over two steps, above the process's size before the model was built."""
    import torch

    from hf_zo.engine import offload_model

    start = anonymous_rss()
    model = build_model(shape)
    block, resident = block_and_resident_bytes(model)
    offloader = offload_model(model, "disk", device="cpu", prefetch=prefetch) if engine == "dual+disk" else None
    optimizer = make_optimizer(model, engine, offloader)
    ids = torch.randint(2, SHAPES[shape]["vocab_size"], (batch, length), generator=torch.Generator().manual_seed(0))
    sampler = PeakSampler()
    for _ in range(2):
        optimizer.step(lambda: model(input_ids=ids, labels=ids).loss)
    optimizer.flush()
    peak = sampler.stop()
    return dict(
        peak_anon_mib=round((peak - start) / 2**20, 1),
        blocks_mib=round(block * SHAPES[shape]["num_hidden_layers"] / 2**20, 1),
        block_mib=round(block / 2**20, 2),
        resident_mib=round(resident / 2**20, 1),
    )


def gpu_worker(engine: str, prefetch: int, batch: int, length: int, steps: int, warmup: int) -> dict:
    import torch

    from hf_zo.engine import offload_model

    device = torch.device("cuda")
    model = build_model("opt-1.3b", dtype=torch.bfloat16)
    block, resident = block_and_resident_bytes(model)
    offloader = None
    if engine in ("dual+cpu", "dual+disk"):
        offloader = offload_model(model, engine.removeprefix("dual+"), device=device, prefetch=prefetch)
    model.to(device)  # offloaded blocks ignore the move: only the resident modules go to the GPU
    optimizer = make_optimizer(model, "dual", offloader)
    ids = torch.randint(2, SHAPES["opt-1.3b"]["vocab_size"], (batch, length), device=device)

    def closure():
        return model(input_ids=ids, labels=ids).loss

    torch.cuda.synchronize()
    weights_on_gpu = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step_s, min_step_s = time_steps(optimizer, closure, warmup, steps, synchronize=torch.cuda.synchronize)
    optimizer.flush()
    peak = torch.cuda.max_memory_allocated()
    return dict(
        section="gpu",
        shape="opt-1.3b",
        dtype="bfloat16",
        engine=engine,
        prefetch=prefetch if offloader is not None else None,
        batch=batch,
        length=length,
        step_s=round(step_s, 4),
        min_step_s=round(min_step_s, 4),
        peak_gpu_mib=round(peak / 2**20, 1),
        weights_on_gpu_mib=round(weights_on_gpu / 2**20, 1),
        activations_mib=round((peak - weights_on_gpu) / 2**20, 1),
        block_mib=round(block / 2**20, 1),
        resident_mib=round(resident / 2**20, 1),
    )


WORKERS = {"cpu_timing": cpu_timing_worker, "cpu_memory": cpu_memory_worker, "gpu": gpu_worker}

# ---------------------------------------------------------------------------------------------------- driver


def run_worker(kind: str, **kwargs) -> dict:
    """Run one measurement in a fresh process (clean peak memory) and return its JSON result."""
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    # A fixed mmap threshold makes glibc hand freed tensors back at once: RSS then tracks live memory.
    env.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")
    command = [sys.executable, __file__, "--worker", kind, "--worker-args", json.dumps(kwargs)]
    result = subprocess.run(command, capture_output=True, text=True, env=env)
    if result.returncode:
        raise RuntimeError(f"worker {kind} {kwargs} failed:\n{result.stderr[-4000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def cpu_section(args) -> None:
    common = dict(batch=args.batch, length=args.length, prefetch=args.prefetch)
    for shape in args.sizes:
        timing = run_worker("cpu_timing", shape=shape, steps=args.steps, warmup=args.warmup, **common)
        results = {}
        for engine in CPU_ENGINES:
            memory = run_worker("cpu_memory", shape=shape, engine=engine, **common)
            median, minimum = timing[engine]
            results[engine] = dict(
                section="cpu",
                shape=shape,
                engine=engine,
                batch=args.batch,
                length=args.length,
                prefetch=args.prefetch if engine == "dual+disk" else None,
                step_s=round(median, 4),
                min_step_s=round(minimum, 4),
                **memory,
            )
            print(json.dumps(results[engine]), flush=True)
        summary = dict(
            section="cpu",
            shape=shape,
            summary=True,
            dual_over_sequential=round(results["dual"]["min_step_s"] / results["sequential"]["min_step_s"], 3),
            disk_over_dual=round(results["dual+disk"]["min_step_s"] / results["dual"]["min_step_s"], 3),
            disk_over_dual_target=1.25,
            disk_peak_over_dual_peak=round(
                results["dual+disk"]["peak_anon_mib"] / max(results["dual"]["peak_anon_mib"], 1e-9), 3
            ),
        )
        print(json.dumps(summary), flush=True)


def gpu_section(args) -> None:
    common = dict(batch=args.gpu_batch, length=args.gpu_length, steps=args.steps, warmup=args.warmup)
    resident = run_worker("gpu", engine="resident", prefetch=0, **common)
    print(json.dumps(resident), flush=True)
    offloaded = {}
    for prefetch in (args.prefetch, 0):
        offloaded[prefetch] = run_worker("gpu", engine="dual+cpu", prefetch=prefetch, **common)
        print(json.dumps(offloaded[prefetch]), flush=True)
    best = offloaded[args.prefetch]
    bound = best["resident_mib"] + (args.prefetch + 1) * best["block_mib"] + resident["activations_mib"]
    print(
        json.dumps(
            dict(
                section="gpu",
                summary=True,
                offload_over_resident=round(best["min_step_s"] / resident["min_step_s"], 3),
                offload_over_resident_target=1.15,
                overlap_no_prefetch_over_prefetch=round(offloaded[0]["min_step_s"] / best["min_step_s"], 3),
                peak_gpu_mib=best["peak_gpu_mib"],
                bound_mib=round(bound, 1),
                within_bound=best["peak_gpu_mib"] <= bound,
                resident_peak_gpu_mib=resident["peak_gpu_mib"],
            )
        ),
        flush=True,
    )
    # Last and on its own line: a failure of the disk tier leaves the figures above intact.
    disk = run_worker("gpu", engine="dual+disk", prefetch=args.prefetch, **common)
    print(json.dumps(disk), flush=True)
    print(
        json.dumps(
            dict(
                section="gpu",
                summary=True,
                disk_over_resident=round(disk["min_step_s"] / resident["min_step_s"], 3),
                disk_peak_gpu_mib=disk["peak_gpu_mib"],
                disk_within_bound=disk["peak_gpu_mib"] <= bound,
            )
        ),
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", nargs="+", default=["opt-125m", "deep"], choices=sorted(SHAPES))
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--length", type=int, default=64)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--prefetch", type=int, default=1)
    parser.add_argument("--quick", action="store_true", help="tiny and small shapes, 3 steps after 1 warm-up")
    parser.add_argument("--gpu-only", action="store_true")
    parser.add_argument("--gpu-batch", type=int, default=8)
    parser.add_argument("--gpu-length", type=int, default=512)
    parser.add_argument("--worker", choices=sorted(WORKERS), help=argparse.SUPPRESS)
    parser.add_argument("--worker-args", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(WORKERS[args.worker](**json.loads(args.worker_args))))
        return
    if args.quick:
        args.sizes, args.steps, args.warmup = ["tiny", "small"], 3, 1
    if not args.gpu_only:
        cpu_section(args)
    import torch

    if torch.cuda.is_available():
        gpu_section(args)
    else:
        print(json.dumps(dict(section="gpu", skipped="CUDA is not available")), flush=True)


if __name__ == "__main__":
    main()
