"""DistZO2 layouts on CPU: time per optimizer step and bytes communicated, at equal total cores.

Prints one JSON line per layout:

- ``single_2threads_accumulate1`` / ``_accumulate2``: one process with 2 intra-op threads (the references);
- ``pertp2_1thread``: 2 processes x 1 thread splitting the 2 signed forwards of each batch (same tokens per step as
  ``accumulate1``);
- ``dp2_1thread``: 2 processes x 1 thread on different batches (same tokens per step as ``accumulate2``);
- ``dp2_two_nodes_loopback``: the DP=2 run launched as two `torchrun` "nodes" (``--nnodes 2 --node_rank 0/1``)
  meeting on 127.0.0.1;
- ``single_2threads_dual_disk``: one process, dual engine with the blocks on the disk tier (the offload reference);
- ``pertp2_1thread_dual_disk`` / ``pertp2_1thread_dual_disk_sliced``: PertP=2 with the dual engine and the disk tier,
  each rank uploading whole blocks from its own files, or half of each block and all-gathering the rest (sliced
  upload; ``upload_bytes_sent_per_step`` counts those all-gathers, apart from the scalar ``zo_bytes_sent_per_step``).

Each line carries ``step_s`` (median wall time of an optimizer step) and ``step_s_min`` (the fastest, less sensitive
to other load on the machine), ``tokens_per_s`` (from the median), ``speedup`` and ``speedup_min`` (against the
single process with the same tokens per step), ``zo_bytes_sent_per_step`` (counted by the plugin's collectives, per
rank) and, for the same model, ``ddp_grad_bytes`` (the fp32 gradient a first-order DDP step all-reduces) and
``ddp_ring_bytes_sent_per_rank`` (what a ring all-reduce of it sends from each rank: ``2 (n - 1) / n`` times that).

    python benchmarks/distributed.py [--steps 8] [--hidden 256] [--layers 4] [--batch 8] [--seq 64] [--layouts offload]

On a machine with GPUs (``--device cuda``) the same script measures NCCL layouts: one GPU per process.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def worker(args: argparse.Namespace) -> None:
    """One rank of a measured layout (launched by `torchrun`); rank 0 prints the JSON line."""
    import torch
    from transformers import OPTConfig, OPTForCausalLM

    from hf_zo.engine import DualEngine
    from hf_zo.optim import ZOSGD
    from hf_zo.parallel import DistZOPlugin

    torch.set_num_threads(args.threads)
    offload = None if args.offload == "none" else args.offload
    plugin = DistZOPlugin(perturbation_parallel_size=args.pertp, offload=offload, sliced_upload=args.sliced)
    mesh = plugin.setup()
    device = torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")
    torch.manual_seed(0)
    config = OPTConfig(
        vocab_size=1024,
        hidden_size=args.hidden,
        num_hidden_layers=args.layers,
        ffn_dim=4 * args.hidden,
        num_attention_heads=max(1, args.hidden // 64),
        max_position_embeddings=args.seq,
        word_embed_proj_dim=args.hidden,
        dropout=0.0,
    )
    model = OPTForCausalLM(config)
    offloader = plugin.prepare_model(model, device)  # the blocks stay in storage; the rest moves below
    model = model.to(device).eval()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = plugin.prepare_optimizer(ZOSGD(params, lr=1e-5, eps=1e-3))
    if offloader is not None:
        optimizer.attach_engine(DualEngine(model, offloader=offloader))
    generator = torch.Generator().manual_seed(1000 + mesh.dp_rank)

    def closure_for(batch):
        def closure():
            return model(input_ids=batch, labels=batch).loss

        return closure

    times = []
    for step in range(args.warmup + args.steps):
        batches = [
            torch.randint(0, 1024, (args.batch, args.seq), generator=generator).to(device)
            for _ in range(args.accumulation)
        ]
        if step == args.warmup:
            plugin.comm_stats.reset()
            plugin.upload_stats.reset()
        start = time.perf_counter()
        for batch in batches:
            optimizer.estimate(closure_for(batch))
        optimizer.step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    optimizer.flush()
    if mesh.rank == 0:
        numel = sum(p.numel() for p in params)
        world = mesh.world_size
        step_s = statistics.median(times[args.warmup :])
        tokens = mesh.dp_size * args.accumulation * args.batch * args.seq
        grad_bytes = 4 * numel
        print(
            json.dumps(
                {
                    "layout": args.layout,
                    "processes": world,
                    "threads_per_process": args.threads,
                    "dp": mesh.dp_size,
                    "pertp": mesh.pertp_size,
                    "trainable_params": numel,
                    "tokens_per_step": tokens,
                    "step_s": round(step_s, 4),
                    "step_s_min": round(min(times[args.warmup :]), 4),
                    "tokens_per_s": round(tokens / step_s, 1),
                    "zo_bytes_sent_per_step": plugin.comm_stats.bytes_sent / args.steps,
                    "offload": args.offload,
                    "sliced_upload": args.sliced,
                    "upload_bytes_sent_per_step": plugin.upload_stats.bytes_sent / args.steps,
                    "ddp_grad_bytes": grad_bytes,
                    "ddp_ring_bytes_sent_per_rank": int(2 * (world - 1) / world * grad_bytes) if world > 1 else 0,
                }
            ),
            flush=True,
        )


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _worker_args(
    args: argparse.Namespace, layout: str, pertp: int, threads: int, accumulation: int, offload: str, sliced: bool
) -> list[str]:
    return [
        str(Path(__file__).resolve()),
        "--worker",
        f"--layout={layout}",
        f"--pertp={pertp}",
        f"--threads={threads}",
        f"--accumulation={accumulation}",
        f"--steps={args.steps}",
        f"--warmup={args.warmup}",
        f"--hidden={args.hidden}",
        f"--layers={args.layers}",
        f"--batch={args.batch}",
        f"--seq={args.seq}",
        f"--device={args.device}",
        f"--offload={offload}",
        *(["--sliced"] if sliced else []),
    ]


def _measure(
    args,
    layout: str,
    nproc: int,
    pertp: int,
    threads: int,
    accumulation: int,
    two_nodes=False,
    offload="none",
    sliced=False,
) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), PYTHONPATH=str(ROOT))
    if args.device == "cpu":
        env["ACCELERATE_USE_CPU"] = "true"
    torchrun = [str(BIN / "torchrun")]
    worker_args = _worker_args(args, layout, pertp, threads, accumulation, offload, sliced)
    if not two_nodes:
        command = [*torchrun, "--standalone", f"--nproc_per_node={nproc}", *worker_args]
        result = subprocess.run(command, env=env, capture_output=True, text=True)
        if result.returncode:
            raise RuntimeError(f"{layout} failed (rc {result.returncode}):\n{result.stderr[-4000:]}")
        output = result.stdout
    else:
        port = _free_port()
        nodes = [
            subprocess.Popen(
                [
                    *torchrun,
                    "--nnodes=2",
                    f"--node_rank={node}",
                    f"--nproc_per_node={nproc // 2}",
                    "--master_addr=127.0.0.1",
                    f"--master_port={port}",
                    *worker_args,
                ],
                env=env,
                stdout=subprocess.PIPE,
                text=True,
            )
            for node in (0, 1)
        ]
        outputs = [node.communicate()[0] for node in nodes]
        if any(node.returncode for node in nodes):
            raise RuntimeError(f"two-node launch failed: return codes {[node.returncode for node in nodes]}")
        output = outputs[0]
    return json.loads(output.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--layout", default="", help=argparse.SUPPRESS)
    parser.add_argument("--pertp", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--threads", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--accumulation", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--offload", default="none", help=argparse.SUPPRESS)
    parser.add_argument("--sliced", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument(
        "--layouts",
        choices=("all", "resident", "offload"),
        default="all",
        help="The resident layouts, the dual engine + disk offload layouts, or both.",
    )
    parser.add_argument("--steps", type=int, default=8, help="Measured optimizer steps per layout.")
    parser.add_argument("--warmup", type=int, default=2, help="Unmeasured steps first.")
    parser.add_argument("--hidden", type=int, default=256, help="Width of the OPT model.")
    parser.add_argument("--layers", type=int, default=4, help="Layers of the OPT model.")
    parser.add_argument("--batch", type=int, default=8, help="Sequences per micro-batch.")
    parser.add_argument("--seq", type=int, default=64, help="Tokens per sequence.")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="gloo on CPUs or NCCL on GPUs.")
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    if args.device == "cuda" and torch.cuda.device_count() < 2:
        print(json.dumps({"skipped": f"--device cuda needs 2 GPUs, found {torch.cuda.device_count()}"}))
        return
    cores = 2
    runs = []
    if args.layouts in ("all", "resident"):
        single1 = _measure(args, "single_2threads_accumulate1", 1, 1, cores, 1)
        single2 = _measure(args, "single_2threads_accumulate2", 1, 1, cores, 2)
        runs += [
            (single1, single1),
            (single2, single2),
            (_measure(args, "pertp2_1thread", 2, 2, 1, 1), single1),
            (_measure(args, "dp2_1thread", 2, 1, 1, 1), single2),
            (_measure(args, "dp2_two_nodes_loopback", 2, 1, 1, 1, two_nodes=True), single2),
        ]
    if args.layouts in ("all", "offload"):
        disk = dict(offload="disk")
        single = _measure(args, "single_2threads_dual_disk", 1, 1, cores, 1, **disk)
        runs += [
            (single, single),
            (_measure(args, "pertp2_1thread_dual_disk", 2, 2, 1, 1, **disk), single),
            (_measure(args, "pertp2_1thread_dual_disk_sliced", 2, 2, 1, 1, sliced=True, **disk), single),
        ]
    for result, reference in runs:
        result["speedup"] = round(reference["step_s"] / result["step_s"], 3)
        result["speedup_min"] = round(reference["step_s_min"] / result["step_s_min"], 3)
        print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
