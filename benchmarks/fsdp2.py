"""ZO under FSDP2: the memory it saves on CPUs, and its GPU path against one process; one JSON line per figure.

    OMP_NUM_THREADS=1 python benchmarks/fsdp2.py memory   # peak RSS per process: 2 CPU processes against 1
    python benchmarks/fsdp2.py gpu                        # every GPU (NCCL) against 1 GPU (skips below 2 GPUs)

`memory`: a Llama of about 1.1B parameters (TinyLlama's shape, random weights, fp32) trains `--steps` ZO-SGD steps on
random tokens, once in one process and once sharded with FSDP2 over two processes launched with
`examples/accelerate_configs/fsdp2_cpu_2_processes.yaml`. Both build the model on the meta device and fill each
parameter with the counter-based noise of its elements (the unsharded process the whole tensor, each FSDP2 process
its own rows), so no process ever holds weights it does not keep and both runs start from the same weights. The
peak is the process's high-water resident set (`ru_maxrss`), imports included. It prints one line per process and
their ratio (the largest FSDP2 peak over the unsharded one). Both runs get glibc's `MALLOC_MMAP_THRESHOLD_`
(`--malloc_mmap_threshold`, 1 MiB; 0 keeps glibc's own): with glibc's default the threshold climbs to 32 MiB, so the
layers' gathered tensors below it come from the heap, whose freed holes stay resident (hundreds of MB at 22 layers).

`gpu`: examples/train.py on the embedded LLM sharded over every GPU, launched with
`examples/accelerate_configs/fsdp2_gpu_8.yaml` and `--num_processes` set to the GPU count, against one process on one
GPU with gradient accumulation over as many micro-batches. It reads the layout line and reports whether the saved
weights and the logged losses agree (bitwise, or the largest difference), with each run's seconds. With fewer than
two GPUs it prints a line with `"skipped"` and exits 0 (`benchmarks/gpu_check.py` runs it as its `fsdp2` part).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CPU_CONFIG = ROOT / "examples" / "accelerate_configs" / "fsdp2_cpu_2_processes.yaml"
GPU_CONFIG = ROOT / "examples" / "accelerate_configs" / "fsdp2_gpu_8.yaml"
SHAPE = dict(
    vocab_size=32000,
    hidden_size=2048,
    intermediate_size=5632,
    num_hidden_layers=22,
    num_attention_heads=32,
    num_key_value_heads=4,
    max_position_embeddings=2048,
    tie_word_embeddings=False,
)
"""TinyLlama-1.1B's shape."""


# ---------------------------------------------------------------------------------------------------------- memory


def build_model(sharded: bool, layers: int):
    """The Llama, its parameters filled with seeded noise (x 0.02), sharded with FSDP2 first when `sharded`; and the
    plugin that sharded it (`None` otherwise)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from hf_zo.noise import Noise, local_shard
    from hf_zo.parallel import DistZOPlugin

    config = LlamaConfig(**dict(SHAPE, num_hidden_layers=layers))
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    plugin = None
    if sharded:
        plugin = DistZOPlugin()
        plugin.prepare_model(model)
    model.to_empty(device="cpu")
    rotary = type(model.model.rotary_emb)(config=config)  # its buffers, left empty by `to_empty`
    for name, buffer in rotary.named_buffers():
        getattr(model.model.rotary_emb, name).copy_(buffer)
    noise = Noise("gaussian")
    with torch.no_grad():
        for index, param in enumerate(model.parameters()):
            shard, offset = local_shard(param)
            noise.fill_(shard.view(-1), 1234, index, offset, param.numel()).mul_(0.02)
    return model, plugin


def memory_worker(steps: int, length: int, layers: int) -> None:
    """One process of a `memory` run: train and print its JSON line."""
    import torch

    from hf_zo.optim import ZOSGD
    from hf_zo.parallel.fsdp import param_bytes

    torch.set_num_threads(1)
    sharded = int(os.environ.get("WORLD_SIZE", "1")) > 1
    model, plugin = build_model(sharded, layers)
    model.eval()
    optimizer = ZOSGD([p for p in model.parameters()], lr=1e-6, eps=1e-3, seed=0, cache_noise=False)
    if plugin is not None:
        plugin.prepare_optimizer(optimizer)
    rank = int(os.environ.get("RANK", "0"))
    tokens = torch.randint(0, SHAPE["vocab_size"], (1, length), generator=torch.Generator().manual_seed(rank))

    def closure():
        return model(input_ids=tokens, labels=tokens).loss

    losses = []
    for _ in range(steps):
        losses.append(optimizer.step(closure))
    optimizer.flush()
    local, total = param_bytes(model)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    mode = "fsdp2" if sharded else "unsharded"
    print(
        json.dumps(
            dict(
                benchmark="fsdp2_memory",
                mode=mode,
                rank=rank,
                peak_rss_bytes=peak,
                local_param_bytes=local,
                total_param_bytes=total,
                loss=losses[-1],
            )
        ),
        flush=True,
    )
    if plugin is not None:
        plugin.destroy()


def run_memory_lines(command: list[str], mmap_threshold: int) -> list[dict]:
    """Run `command` (one thread per process, glibc's mmap threshold at `mmap_threshold` bytes unless 0) and return
    the JSON lines it printed."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    if mmap_threshold:
        env["MALLOC_MMAP_THRESHOLD_"] = str(mmap_threshold)
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    if result.returncode:
        sys.exit(result.stdout[-3000:] + result.stderr[-3000:])
    return [json.loads(line) for line in result.stdout.splitlines() if line.startswith('{"benchmark"')]


def memory(args: argparse.Namespace) -> None:
    """Both runs of `memory`, one after the other; print their lines and the ratio."""
    if args.worker:
        memory_worker(args.steps, args.length, args.layers)
        return
    script = [str(Path(__file__).resolve()), "memory", "--worker", "--steps", str(args.steps)]
    script += ["--length", str(args.length), "--layers", str(args.layers)]
    threshold = args.malloc_mmap_threshold
    (unsharded,) = run_memory_lines([sys.executable, *script], threshold)
    accelerate = str(Path(sys.executable).parent / "accelerate")
    sharded = run_memory_lines([accelerate, "launch", "--config_file", str(CPU_CONFIG), *script], threshold)
    for line in (unsharded, *sharded):
        print(json.dumps(line))
    largest = max(line["peak_rss_bytes"] for line in sharded)
    ratio = round(largest / unsharded["peak_rss_bytes"], 3)
    record = dict(benchmark="fsdp2_memory", mode="ratio", world=len(sharded), peak_rss_ratio=ratio)
    print(json.dumps(dict(record, layers=args.layers, malloc_mmap_threshold=threshold or None)))


# ---------------------------------------------------------------------------------------------------------- gpu


def run_timed(command: list[str], env: dict) -> tuple[str, float]:
    """Run `command` from the repository root; return its output and seconds (exit on failure)."""
    start = time.perf_counter()
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    if result.returncode:
        print(json.dumps(dict(benchmark="fsdp2_gpu", error=(result.stdout + result.stderr)[-2000:])))
        sys.exit(1)
    return result.stdout + result.stderr, time.perf_counter() - start


def gpu(args: argparse.Namespace) -> None:
    """The `gpu` comparison: the FSDP2 launch over every GPU, then the one-GPU reference."""
    import torch

    gpus = torch.cuda.device_count()
    if gpus < 2:
        print(json.dumps(dict(benchmark="fsdp2_gpu", gpus=gpus, skipped="needs 2 or more GPUs")))
        return
    from safetensors.torch import load_file

    from hf_zo.models import embedded_llm_path

    out = Path(args.out or tempfile.mkdtemp(prefix="fsdp2_gpu_"))
    data = ROOT / "examples" / "data" / "sst2"
    arguments = ["--model_name_or_path", embedded_llm_path(), "--task_name", "sst2", "--num_train", "256"]
    arguments += ["--train_file", str(data / "train.tsv"), "--validation_file", str(data / "validation.tsv")]
    arguments += ["--max_steps", str(args.steps), "--per_device_train_batch_size", "4", "--logging_steps", "1"]
    arguments += ["--do_eval", "false", "--save_strategy", "no", "--report_to", "none", "--log_level", "info"]
    env = dict(os.environ, PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1")
    accelerate = str(Path(sys.executable).parent / "accelerate")
    train = str(ROOT / "examples" / "train.py")
    launch = [accelerate, "launch", "--config_file", str(GPU_CONFIG), "--num_processes", str(gpus)]
    launch += ["--mixed_precision", "no"]
    output, sharded_s = run_timed([*launch, train, *arguments, "--output_dir", str(out / "fsdp2")], env)
    lines = [line for line in output.splitlines() if "hf_zo layout:" in line]
    layout = lines[0][lines[0].index("hf_zo layout:") :] if lines else None
    one = [sys.executable, train, *arguments, "--gradient_accumulation_steps", str(gpus)]
    _, one_s = run_timed([*one, "--output_dir", str(out / "one")], dict(env, CUDA_VISIBLE_DEVICES="0"))

    sharded, reference = load_file(out / "fsdp2" / "model.safetensors"), load_file(out / "one" / "model.safetensors")
    largest = max(float((sharded[k].float() - reference[k].float()).abs().max()) for k in reference)
    losses = [
        [e["loss"] for e in json.loads((out / run / "trainer_state.json").read_text())["log_history"] if "loss" in e]
        for run in ("fsdp2", "one")
    ]
    record = dict(benchmark="fsdp2_gpu", gpus=gpus, layout=layout, weights_bitwise=largest == 0.0)
    record.update(largest_weight_difference=largest, losses_fsdp2=losses[0], losses_one_process=losses[1])
    record.update(fsdp2_s=round(sharded_s, 1), one_process_s=round(one_s, 1))
    print(json.dumps(record))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    on_cpu = commands.add_parser("memory", help="peak RSS per process: FSDP2 on 2 CPU processes against 1 process")
    on_cpu.add_argument("--steps", type=int, default=2)
    on_cpu.add_argument("--length", type=int, default=32, help="tokens per sequence (batch of one)")
    on_cpu.add_argument("--layers", type=int, default=SHAPE["num_hidden_layers"], help="decoder layers (a quick run)")
    on_cpu.add_argument(
        "--malloc_mmap_threshold",
        type=int,
        default=2**20,
        help="glibc's MALLOC_MMAP_THRESHOLD_ (bytes; 0: glibc's own)",
    )
    on_cpu.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    on_cpu.set_defaults(run=memory)
    on_gpus = commands.add_parser("gpu", help="FSDP2 over every GPU against one GPU with gradient accumulation")
    on_gpus.add_argument("--steps", type=int, default=3)
    on_gpus.add_argument("--out", default=None, help="folder for the two runs (default: a temporary one)")
    on_gpus.set_defaults(run=gpu)
    args = parser.parse_args()
    args.run(args)


if __name__ == "__main__":
    main()
