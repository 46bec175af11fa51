"""The FSDP2 path on GPUs: examples/train.py on the embedded LLM sharded over every GPU (NCCL) against one process with
gradient accumulation over as many micro-batches; one JSON line.

    python benchmarks/fsdp2_gpu.py [--steps 3] [--out DIR]

With fewer than two GPUs it prints a line with `"skipped"` and exits 0. Otherwise it launches
`examples/accelerate_configs/fsdp2_gpu_8.yaml` with `--num_processes` set to the GPU count, reads the layout line,
runs the single-process reference on one GPU, and reports whether the saved weights and the logged losses agree
(bitwise, or the largest difference), with each run's seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "examples" / "accelerate_configs" / "fsdp2_gpu_8.yaml"


def run(command: list[str], env: dict) -> tuple[str, float]:
    """Run `command` from the repository root; return its output and seconds (exit on failure)."""
    start = time.perf_counter()
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    if result.returncode:
        print(json.dumps(dict(benchmark="fsdp2_gpu", error=(result.stdout + result.stderr)[-2000:])))
        sys.exit(1)
    return result.stdout + result.stderr, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out", default=None, help="folder for the two runs (default: a temporary one)")
    args = parser.parse_args()
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
    launch = [accelerate, "launch", "--config_file", str(CONFIG), "--num_processes", str(gpus), "--mixed_precision"]
    output, sharded_s = run([*launch, "no", train, *arguments, "--output_dir", str(out / "fsdp2")], env)
    lines = [line for line in output.splitlines() if "hf_zo layout:" in line]
    layout = lines[0][lines[0].index("hf_zo layout:") :] if lines else None
    one = [sys.executable, train, *arguments, "--gradient_accumulation_steps", str(gpus)]
    _, one_s = run([*one, "--output_dir", str(out / "one")], dict(env, CUDA_VISIBLE_DEVICES="0"))

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


if __name__ == "__main__":
    main()
