"""`python -m hf_zo.demo` (`make demo`): zeroth-order fine-tuning of a real pretrained model, fully offline.

By default it fine-tunes the embedded causal LM (SmolLM2-135M-Instruct, `hf_zo.models.embedded_llm_path`) on a
prompt task, MeZO's way (`hf_zo/demo/llm.py`); `--model minilm` runs the sentence-encoder classifier demo
(all-MiniLM-L6-v2 with a linear-probed head, `hf_zo/demo/minilm.py`). Both use the small sentiment data set shipped
in `hf_zo/demo/data` and print their before/after figures as a table and one JSON line.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field

DEMO_MODELS = ("llm", "minilm")


@dataclass
class DemoArguments:
    """Knobs of the demo (all optional; unset ones take the chosen model's defaults)."""

    model: str = field(
        default="llm", metadata={"help": "The embedded model to fine-tune.", "choices": list(DEMO_MODELS)}
    )
    max_steps: int | None = field(default=None, metadata={"help": "ZO optimizer steps (llm: 50, minilm: 600)."})
    learning_rate: float | None = field(default=None, metadata={"help": "ZO learning rate (llm: 2e-3, minilm: 1e-3)."})
    zo_eps: float = field(default=1e-2, metadata={"help": "Perturbation scale."})
    batch_size: int = field(default=16, metadata={"help": "Training batch size."})
    lora_rank: int = field(default=8, metadata={"help": "LoRA rank on the attention query/value projections."})
    output_dir: str = field(default="outputs/demo", metadata={"help": "Where the adapter is saved."})
    seed: int = field(default=42, metadata={"help": "Random seed."})

    def __post_init__(self):
        for name in ("max_steps", "batch_size", "lora_rank"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"--{name} must be at least 1, got {value}; leave it out for its default.")
        if self.max_steps is None:
            self.max_steps = 50 if self.model == "llm" else 600
        if self.learning_rate is None:
            self.learning_rate = 2e-3 if self.model == "llm" else 1e-3


def main(argv: list[str] | None = None) -> dict:
    """Run the demo and return its summary (also printed as a table and one JSON line)."""
    from transformers import HfArgumentParser

    (demo,) = HfArgumentParser(DemoArguments).parse_args_into_dataclasses(args=argv)
    if demo.model == "llm":
        from .llm import run
    else:
        from .minilm import run
    summary = run(demo)
    width = max(len(k) for k in summary)
    print("\nhf_zo demo: zeroth-order fine-tuning, offline")
    for key, value in summary.items():
        print(f"  {key:<{width}}  {value}")
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    try:
        main()
    except ValueError as error:  # a bad option: its message names the fix, the traceback adds nothing
        sys.exit(f"error: {error}")
