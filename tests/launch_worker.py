"""What `tests/test_launch.py` starts with `accelerate launch`: `examples/train.py`'s `main()`, then a record per rank.

Usage: ``accelerate launch --config_file CONFIG tests/launch_worker.py RECORD_DIR TRAIN_ARGS...``. After the example
has trained, saved and evaluated exactly as it does from the command line, each rank writes
``RECORD_DIR/rank{rank}.json``: a checksum of its trainable parameters, its evaluation metrics and the layout the
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


def load_example():
    spec = importlib.util.spec_from_file_location("hf_zo_example_train", ROOT / "examples" / "train.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up while they are built
    spec.loader.exec_module(module)
    return module


def main(record_dir: str, argv: list[str]) -> None:
    trainer, metrics = load_example().main(argv)
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
    main(sys.argv[1], sys.argv[2:])
