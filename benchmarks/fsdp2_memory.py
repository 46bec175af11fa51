"""Peak resident memory per process of ZO training under FSDP2 (2 CPU processes) against one unsharded process.

    OMP_NUM_THREADS=1 python benchmarks/fsdp2_memory.py            # both runs; prints one JSON line per process
                                                                    # and the ratio

A Llama of about 1.1B parameters (TinyLlama's shape, random weights, fp32) trains `--steps` ZO-SGD steps on random
tokens, once in one process and once sharded with FSDP2 over two processes launched with
`examples/accelerate_configs/fsdp2_cpu_2_processes.yaml`. Both build the model on the meta device and fill each
parameter with the counter-based noise of its elements (the unsharded process the whole tensor, each FSDP2 process
its own rows), so no process ever holds weights it does not keep and both runs start from the same weights. The
peak is the process's high-water resident set (`ru_maxrss`), imports included.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "examples" / "accelerate_configs" / "fsdp2_cpu_2_processes.yaml"
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


def worker(steps: int, length: int, layers: int) -> None:
    """One process of a run: train and print its JSON line."""
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


def run(command: list[str]) -> list[dict]:
    """Run `command` (one thread per process) and return the JSON lines it printed."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    if result.returncode:
        sys.exit(result.stdout[-3000:] + result.stderr[-3000:])
    return [json.loads(line) for line in result.stdout.splitlines() if line.startswith('{"benchmark"')]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--length", type=int, default=32, help="tokens per sequence (batch of one)")
    parser.add_argument("--layers", type=int, default=SHAPE["num_hidden_layers"], help="decoder layers (a quick run)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.steps, args.length, args.layers)
        return
    script = [str(Path(__file__).resolve()), "--worker", "--steps", str(args.steps), "--length", str(args.length)]
    script += ["--layers", str(args.layers)]
    (unsharded,) = run([sys.executable, *script])
    accelerate = str(Path(sys.executable).parent / "accelerate")
    sharded = run([accelerate, "launch", "--config_file", str(CONFIG), *script])
    for line in (unsharded, *sharded):
        print(json.dumps(line))
    largest = max(line["peak_rss_bytes"] for line in sharded)
    ratio = largest / unsharded["peak_rss_bytes"]
    print(json.dumps(dict(benchmark="fsdp2_memory", mode="ratio", world=len(sharded), peak_rss_ratio=round(ratio, 3))))


if __name__ == "__main__":
    main()
