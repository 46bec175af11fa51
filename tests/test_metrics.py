"""The metric modules shipped with hf_zo load offline and agree with scikit-learn."""

from __future__ import annotations

import os

import numpy as np
import pytest
from transformers import EvalPrediction

from hf_zo.metrics import AVAILABLE_METRICS, METRICS_DIR, build_compute_metrics, load_metric, metric_path

PREDICTIONS = [0, 1, 2, 2, 1, 0, 1, 2, 0, 0]
REFERENCES = [0, 1, 1, 2, 1, 2, 0, 2, 0, 1]


def test_modules_ship_inside_the_package():
    for name in AVAILABLE_METRICS:
        path = metric_path(name)
        assert os.path.isfile(path) and path.startswith(METRICS_DIR)
    with pytest.raises(ValueError, match="Unknown metric 'bleu'; hf_zo ships"):
        metric_path("bleu")


def test_load_without_network(monkeypatch):
    import huggingface_hub

    def no_network(*args, **kwargs):
        raise AssertionError("the metric tried to reach the Hub")

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", no_network)
    accuracy = load_metric("accuracy").compute(predictions=PREDICTIONS, references=REFERENCES)
    assert accuracy == {"accuracy": 0.6}


@pytest.mark.parametrize("average", ["macro", "micro", "weighted"])
def test_f1_matches_sklearn(average):
    from sklearn.metrics import f1_score

    result = load_metric("f1").compute(predictions=PREDICTIONS, references=REFERENCES, average=average)
    assert result["f1"] == pytest.approx(f1_score(REFERENCES, PREDICTIONS, average=average))


def test_binary_f1_and_weighted_accuracy_match_sklearn():
    from sklearn.metrics import accuracy_score, f1_score

    predictions, references = [1, 1, 0, 0, 1], [1, 0, 0, 1, 1]
    weights = [1.0, 2.0, 1.0, 0.5, 1.0]
    assert load_metric("f1").compute(predictions=predictions, references=references)["f1"] == pytest.approx(
        f1_score(references, predictions)
    )
    accuracy = load_metric("accuracy").compute(predictions=predictions, references=references, sample_weight=weights)
    assert accuracy["accuracy"] == pytest.approx(accuracy_score(references, predictions, sample_weight=weights))
    with pytest.raises(ValueError, match="average='binary' needs at most 2 labels"):
        load_metric("f1").compute(predictions=PREDICTIONS, references=REFERENCES)


def test_compute_metrics_scores_the_argmax_of_the_logits():
    compute_metrics = build_compute_metrics(["accuracy", "f1"])
    logits = np.eye(3)[PREDICTIONS] + 0.1
    result = compute_metrics(EvalPrediction(predictions=logits, label_ids=np.array(REFERENCES)))
    assert result["accuracy"] == pytest.approx(0.6)
    f1 = load_metric("f1").compute(predictions=PREDICTIONS, references=REFERENCES, average="macro")["f1"]
    assert result["f1"] == pytest.approx(f1)  # three classes: macro F1
    binary = build_compute_metrics(["f1"])(EvalPrediction(np.array([[0.0, 1.0], [1.0, 0.0]]), np.array([1, 1])))
    assert binary == {"f1": pytest.approx(2 / 3)}
