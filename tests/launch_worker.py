"""What `tests/test_launch.py` starts with `accelerate launch`: an example's `main()`, then a record per rank.

Usage: ``accelerate launch --config_file CONFIG tests/launch_worker.py EXAMPLE RECORD_DIR ARGS...``, with EXAMPLE
``train`` (examples/train.py) or ``sft`` (examples/sft.py). After the example has trained, saved and evaluated exactly
as it does from the command line, each rank writes ``RECORD_DIR/rank{rank}.json``: a checksum of its trainable
parameters, its evaluation metrics (for ``sft``, the last evaluation of its `--eval_strategy`) and the layout the
Trainer believed it was in.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

from hf_zo.parallel.replicas import parameter_checksum

ROOT = Path(__file__).resolve().parents[1]


def load_example(name: str):
    """examples/`name`.py as a module (it is a script, not part of a package)."""
    spec = importlib.util.spec_from_file_location(f"hf_zo_example_{name}", ROOT / "examples" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up while they are built
    spec.loader.exec_module(module)
    return module


def run_example(name: str, argv: list[str]):
    """Run examples/`name`.py's `main()` on `argv`; return the trainer and its final evaluation metrics."""
    example = load_example(name)
    if name == "train":
        return example.main(argv)
    trainer = example.main(*example.make_parser().parse_args_and_config(argv))
    evaluations = [log for log in trainer.state.log_history if "eval_loss" in log]
    return trainer, evaluations[-1] if evaluations else {}


def main(example: str, record_dir: str, argv: list[str]) -> None:
    trainer, metrics = run_example(example, argv)
    trainable = sorted((n, p) for n, p in trainer.model.named_parameters() if p.requires_grad)
    record = {
        "checksum": parameter_checksum(p for _, p in trainable),
        "metrics": metrics,
        "global_step": trainer.state.global_step,
        "world_size": trainer.args.world_size,
        "parallel_mode": str(trainer.args.parallel_mode),
    }
    with open(Path(record_dir) / f"rank{os.environ.get('RANK', '0')}.json", "w") as f:
        json.dump(record, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3:])
