"""PEFT: only adapter tensors move; saved adapters reload to identical outputs."""

import pytest
import torch
from peft import (
    LNTuningConfig,
    LoraConfig,
    PeftModel,
    PrefixTuningConfig,
    PromptTuningConfig,
    TaskType,
    get_peft_model,
)
from transformers import BertForSequenceClassification

from hf_zo import ZOConfig, ZOTrainer
from hf_zo.models import is_norm_module, norm_module_names

from tiny_models import lm_dataset, tiny_bert_classifier, tiny_causal_lm

PEFT_CONFIGS = {
    "lora": lambda: LoraConfig(task_type=TaskType.CAUSAL_LM, r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
    "prefix": lambda: PrefixTuningConfig(task_type=TaskType.CAUSAL_LM, num_virtual_tokens=4),
    "prompt": lambda: PromptTuningConfig(task_type=TaskType.CAUSAL_LM, num_virtual_tokens=4),
}


@pytest.mark.parametrize("family", ["opt", "llama"])
@pytest.mark.parametrize("method", sorted(PEFT_CONFIGS))
def test_only_adapters_change_and_reload_matches(tmp_path, method, family):
    model = get_peft_model(tiny_causal_lm(family), PEFT_CONFIGS[method]())
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    args = ZOConfig(
        output_dir=str(tmp_path),
        max_steps=4,
        per_device_train_batch_size=4,
        learning_rate=1e-2,
        zo_eps=1e-2,
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
        use_cpu=True,
    )
    trainer = ZOTrainer(model=model, args=args, train_dataset=lm_dataset(8))
    trainer.train()
    for name, param in model.named_parameters():
        if name in trainable:
            assert not torch.equal(param, before[name]), f"adapter {name} did not move"
        else:
            assert torch.equal(param, before[name]), f"frozen {name} changed"

    trainer.save_model(str(tmp_path / "adapter"))
    reloaded = PeftModel.from_pretrained(tiny_causal_lm(family), str(tmp_path / "adapter")).eval()
    model.eval()
    batch = torch.arange(2, 18).view(2, 8)
    with torch.no_grad():
        assert torch.equal(model(input_ids=batch).logits, reloaded(input_ids=batch).logits)


def test_sequence_classification_lora_with_head(tmp_path):
    from tiny_models import classification_dataset

    config = LoraConfig(task_type=TaskType.SEQ_CLS, r=4, target_modules=["query", "value"])
    model = get_peft_model(tiny_bert_classifier(), config)
    head = {n for n, p in model.named_parameters() if p.requires_grad and "classifier" in n}
    assert head, "PEFT marks the new head trainable (modules_to_save)"
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    args = ZOConfig(
        output_dir=str(tmp_path),
        max_steps=3,
        per_device_train_batch_size=4,
        learning_rate=1e-2,
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
        use_cpu=True,
    )
    ZOTrainer(model=model, args=args, train_dataset=classification_dataset(8)).train()
    for name in head:
        assert not torch.equal(dict(model.named_parameters())[name], before[name])


@pytest.mark.parametrize(
    "build, expected",
    [
        (tiny_bert_classifier, ["LayerNorm"]),
        (lambda: tiny_causal_lm("opt"), ["final_layer_norm", "self_attn_layer_norm"]),
        (lambda: tiny_causal_lm("llama"), ["input_layernorm", "norm", "post_attention_layernorm"]),
    ],
    ids=["bert", "opt", "llama"],
)
def test_norm_module_names_make_ln_tuning_train_exactly_the_norms(build, expected):
    model = build()
    assert norm_module_names(model) == expected
    norm_weights = {
        f"{path}.{name}"
        for path, module in model.named_modules()
        if is_norm_module(module)
        for name, _ in module.named_parameters()
    }
    assert norm_weights
    task = TaskType.SEQ_CLS if isinstance(model, BertForSequenceClassification) else TaskType.CAUSAL_LM
    tuned = get_peft_model(model, LNTuningConfig(task_type=task, target_modules=norm_module_names(model)))
    trainable = {
        name.removeprefix("base_model.model.").replace(".ln_tuning_layers.default", "")
        for name, param in tuned.named_parameters()
        if param.requires_grad and ".ln_tuning_layers." in name
    }
    assert trainable == norm_weights


def test_norm_module_names_never_select_a_module_that_shares_a_norms_name():
    class SharedName(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = torch.nn.LayerNorm(4)
            self.block = torch.nn.Module()
            self.block.norm = torch.nn.Linear(4, 4)  # not a norm, but named like one
            self.block.out = torch.nn.RMSNorm(4)

    names = norm_module_names(SharedName())
    assert names == "block\\.out|norm"
    tuned = get_peft_model(SharedName(), LNTuningConfig(target_modules=names))
    assert not any(p.requires_grad for n, p in tuned.named_parameters() if "block.norm" in n)
    assert {n for n, p in tuned.named_parameters() if p.requires_grad} == {
        f"base_model.model.{path}.ln_tuning_layers.default.weight" for path in ("norm", "block.out")
    } | {"base_model.model.norm.ln_tuning_layers.default.bias"}


def test_norm_module_names_without_norms_says_so():
    with pytest.raises(ValueError, match="Sequential has no normalisation layer.*LoRA"):
        norm_module_names(torch.nn.Sequential(torch.nn.Linear(2, 2)))
