"""Metrics that work offline: `evaluate` metric modules shipped inside hf_zo, and a `compute_metrics` builder.

`evaluate.load("accuracy")` fetches the module from the Hub; `load_metric("accuracy")` loads the copy shipped here,
so evaluation works on a machine without network access.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence

import evaluate
import numpy as np
from transformers import EvalPrediction

METRICS_DIR = os.path.dirname(os.path.abspath(__file__))
AVAILABLE_METRICS = ("accuracy", "f1")


def metric_path(name: str) -> str:
    """Path of the metric module `name` shipped with hf_zo (pass it to `evaluate.load`)."""
    if name not in AVAILABLE_METRICS:
        raise ValueError(f"Unknown metric {name!r}; hf_zo ships {list(AVAILABLE_METRICS)}.")
    return os.path.join(METRICS_DIR, name, f"{name}.py")


def load_metric(name: str) -> evaluate.EvaluationModule:
    """`evaluate.load` of the metric module `name` shipped with hf_zo (no network access)."""
    return evaluate.load(metric_path(name))


def build_compute_metrics(
    metrics: Sequence[str] = ("accuracy",), f1_average: str | None = None
) -> Callable[[EvalPrediction], dict[str, float]]:
    """A `compute_metrics` for `Trainer` that scores the argmax of the predictions against the labels.

    Args:
        metrics (`Sequence[str]`, defaults to `("accuracy",)`): names among `"accuracy"` and `"f1"`.
        f1_average (`str`, *optional*): `average` of F1; default `"binary"` for two classes, `"macro"` otherwise.

    Returns:
        `Callable[[EvalPrediction], dict[str, float]]`: maps the evaluation logits (or candidate scores, for
        prompt-based classification) and labels to `{"accuracy": ..., "f1": ...}`.
    """
    modules = {name: load_metric(name) for name in metrics}

    def compute_metrics(prediction: EvalPrediction) -> dict[str, float]:
        logits = prediction.predictions[0] if isinstance(prediction.predictions, tuple) else prediction.predictions
        predictions = np.asarray(logits).argmax(-1)
        references = np.asarray(prediction.label_ids)
        results = {}
        for name, module in modules.items():
            kwargs = {}
            if name == "f1":
                num_classes = max(np.asarray(logits).shape[-1], 2)
                kwargs["average"] = f1_average or ("binary" if num_classes == 2 else "macro")
            results.update(module.compute(predictions=predictions, references=references, **kwargs))
        return results

    return compute_metrics


__all__ = ["AVAILABLE_METRICS", "METRICS_DIR", "build_compute_metrics", "load_metric", "metric_path"]
