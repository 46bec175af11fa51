"""PEFT: only adapter tensors move; saved adapters reload to identical outputs."""

import pytest
import torch
from peft import LoraConfig, PeftModel, PrefixTuningConfig, PromptTuningConfig, TaskType, get_peft_model

from hf_zo import ZOConfig, ZOTrainer

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
