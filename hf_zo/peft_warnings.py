"""Two warnings PEFT prints on every run of this stack that nobody can act on, and how hf_zo's entry points (the
`hf-zo` command, the demo, `examples/train.py`, `replay`) keep them out of a user's log."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator

__all__ = ["ignore_peft_warnings", "peft_warnings_ignored"]

_KNOWN_WARNINGS = (
    # PEFT's LN-tuning layer asks each norm for in/out features, which norms do not have, and warns "Unsupported
    # layer type" for every norm it wraps: expected with LN tuning.
    (r"Unsupported layer type .*(LayerNorm|RMSNorm)", UserWarning),
    # get_peft_model reads transformers' deprecated `is_gradient_checkpointing` (PEFT 0.21 with transformers 5).
    (r"`is_gradient_checkpointing` is deprecated", FutureWarning),
)


def ignore_peft_warnings() -> None:
    """Filter out, for the rest of the process, the two PEFT warnings that LN tuning and `get_peft_model` print on
    every run (an unsupported layer type for each norm; transformers' deprecated `is_gradient_checkpointing`). For
    scripts; library code uses :func:`peft_warnings_ignored`. Other warnings are untouched."""
    for message, category in _KNOWN_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category)


@contextlib.contextmanager
def peft_warnings_ignored() -> Iterator[None]:
    """Within the block, the warnings of :func:`ignore_peft_warnings` are filtered out; the filters are restored on
    exit."""
    with warnings.catch_warnings():
        ignore_peft_warnings()
        yield
