"""Bad configurations and inputs fail at construction with a message that names the value and the fix."""

import pytest
from datasets import Dataset

from hf_zo import ZOConfig, ZOTrainer
from hf_zo.optim import ZOSGD

from tiny_models import lm_dataset, tiny_causal_lm


def _config(tmp_path, **kw):
    return ZOConfig(output_dir=str(tmp_path), report_to=[], use_cpu=True, **kw)


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("zo_eps", 0.0, "zo_eps must be > 0, got 0.0"),
        ("zo_eps", -1e-3, "zo_eps must be > 0, got -0.001"),
        ("zo_optimizer", "adamw", "Unknown zo_optimizer 'adamw'; choose one of"),
        ("zo_noise", "uniform", "Unknown zo_noise 'uniform'; choose one of"),
        ("zo_num_perturbations", 0, "zo_num_perturbations must be an integer >= 1, got 0"),
        ("zo_momentum", 1.5, "zo_momentum must be in \\[0, 1\\), got 1.5"),
        ("zo_max_consecutive_skips", 0, "zo_max_consecutive_skips must be an integer >= 1, got 0"),
    ],
)
def test_invalid_zo_config_values(tmp_path, field, value, message):
    with pytest.raises(ValueError, match=message):
        _config(tmp_path, **{field: value})


def test_model_without_trainable_parameters(tmp_path):
    model = tiny_causal_lm("opt").requires_grad_(False)
    with pytest.raises(ValueError, match="has no trainable parameters.*get_peft_model"):
        ZOTrainer(model=model, args=_config(tmp_path), train_dataset=lm_dataset(4))


def test_dataset_without_labels(tmp_path):
    data = Dataset.from_list([{"input_ids": [2, 3, 4, 5], "attention_mask": [1, 1, 1, 1]}] * 4)
    with pytest.raises(ValueError, match="The training batches have no labels.*DataCollatorForLanguageModeling"):
        ZOTrainer(model=tiny_causal_lm("opt"), args=_config(tmp_path), train_dataset=data)


def test_empty_dataset(tmp_path):
    data = Dataset.from_dict({"input_ids": [], "labels": []})
    with pytest.raises(ValueError, match="train_dataset is empty"):
        ZOTrainer(model=tiny_causal_lm("opt"), args=_config(tmp_path), train_dataset=data)


def test_first_order_optimizer_is_rejected(tmp_path):
    import torch

    model = tiny_causal_lm("opt")
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(TypeError, match="ZOTrainer needs a ZOOptimizer, got SGD"):
        ZOTrainer(model=model, args=_config(tmp_path), train_dataset=lm_dataset(4), optimizers=(sgd, None))


def test_optimizer_without_parameters():
    with pytest.raises(ValueError, match="empty parameter list"):
        ZOSGD([], lr=0.1)
    with pytest.raises(ValueError, match="got no parameters: check that some have requires_grad=True"):
        ZOSGD([{"params": []}], lr=0.1)
