"""F1 score, as an `evaluate` metric module shipped with hf_zo (loads offline with `evaluate.load(path)`)."""

import datasets
import evaluate
import numpy as np

_DESCRIPTION = "F1: the harmonic mean of precision and recall, 2 * TP / (2 * TP + FP + FN)."

_KWARGS_DESCRIPTION = """
Args:
    predictions (`list[int]`): predicted labels.
    references (`list[int]`): true labels.
    average (`str`, defaults to `"binary"`): `"binary"` (F1 of `pos_label`), `"macro"` (unweighted mean over
        labels), `"micro"` (global counts) or `"weighted"` (mean weighted by each label's support).
    pos_label (`int`, defaults to 1): the positive label when `average="binary"`.
Returns:
    f1 (`float`): the F1 score; 0.0 for a label that is never predicted nor present.
"""


def _f1(tp: float, fp: float, fn: float) -> float:
    denominator = 2 * tp + fp + fn
    return 2 * tp / denominator if denominator else 0.0


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _KWARGS_DESCRIPTION)
class F1(evaluate.Metric):
    """F1 of integer predictions, binary or averaged over labels."""

    def _info(self):
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation="",
            inputs_description=_KWARGS_DESCRIPTION,
            features=datasets.Features(
                {"predictions": datasets.Value("int32"), "references": datasets.Value("int32")}
            ),
        )

    def _compute(self, predictions, references, average="binary", pos_label=1):
        predictions, references = np.asarray(predictions), np.asarray(references)
        labels = np.union1d(predictions, references)
        counts = {
            label: (
                float(np.sum((predictions == label) & (references == label))),
                float(np.sum((predictions == label) & (references != label))),
                float(np.sum((predictions != label) & (references == label))),
            )
            for label in labels
        }
        if average == "binary":
            if len(labels) > 2:
                raise ValueError(f"average='binary' needs at most 2 labels, got {labels.tolist()}; use 'macro'.")
            return {"f1": _f1(*counts.get(pos_label, (0.0, 0.0, 0.0)))}
        if average == "micro":
            return {"f1": _f1(*(sum(c[i] for c in counts.values()) for i in range(3)))}
        scores = np.array([_f1(*counts[label]) for label in labels])
        if average == "macro":
            return {"f1": float(scores.mean()) if len(scores) else 0.0}
        if average == "weighted":
            support = np.array([np.sum(references == label) for label in labels], dtype=np.float64)
            return {"f1": float((scores * support).sum() / support.sum()) if support.sum() else 0.0}
        raise ValueError(f"Unknown average {average!r}; choose 'binary', 'macro', 'micro' or 'weighted'.")
