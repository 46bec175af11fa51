"""Accuracy, as an `evaluate` metric module shipped with hf_zo (loads offline with `evaluate.load(path)`)."""

import datasets
import evaluate
import numpy as np

_DESCRIPTION = "Accuracy: the fraction of predictions equal to their reference, (TP + TN) / N."

_KWARGS_DESCRIPTION = """
Args:
    predictions (`list[int]`): predicted labels.
    references (`list[int]`): true labels.
    normalize (`bool`, defaults to `True`): return the fraction (`True`) or the count (`False`) of correct ones.
    sample_weight (`list[float]`, *optional*): weight of each example.
Returns:
    accuracy (`float`): the fraction (or count) of correct predictions.
"""


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _KWARGS_DESCRIPTION)
class Accuracy(evaluate.Metric):
    """Accuracy of integer predictions."""

    def _info(self):
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation="",
            inputs_description=_KWARGS_DESCRIPTION,
            features=datasets.Features(
                {"predictions": datasets.Value("int32"), "references": datasets.Value("int32")}
            ),
        )

    def _compute(self, predictions, references, normalize=True, sample_weight=None):
        correct = (np.asarray(predictions) == np.asarray(references)).astype(np.float64)
        weights = np.ones_like(correct) if sample_weight is None else np.asarray(sample_weight, dtype=np.float64)
        total = float((correct * weights).sum())
        return {"accuracy": total / float(weights.sum()) if normalize else total}
