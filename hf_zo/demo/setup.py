"""The LLM demo's set-up, shared by the demo (`hf_zo/demo/llm.py`) and its memory phases (`hf_zo/demo/phase.py`): the
prompt task on the demo's sentiment sentences and the embedded LLM with its LoRA adapter."""

from __future__ import annotations

import torch

from . import DATA_DIR

TEMPLATE = "{sentence} It was"
LABEL_WORDS = (" terrible", " great")


def demo_task(tokenizer):
    """The prompt task and the demo's tokenized sentiment data (`train`, `test`)."""
    from datasets import load_dataset

    from hf_zo.prompts import PromptClassification

    task = PromptClassification(tokenizer, TEMPLATE, LABEL_WORDS)
    files = {"train": str(DATA_DIR / "sentiment_train.jsonl"), "test": str(DATA_DIR / "sentiment_test.jsonl")}
    return task, task.tokenize(load_dataset("json", data_files=files))


def demo_model(lora_rank: int):
    """The embedded LLM in fp32 with LoRA (rank `lora_rank`) on q_proj and v_proj."""
    from peft import LoraConfig, TaskType, get_peft_model
    from transformers import AutoModelForCausalLM

    from hf_zo.models import embedded_llm_path
    from hf_zo.peft_warnings import peft_warnings_ignored

    model = AutoModelForCausalLM.from_pretrained(embedded_llm_path(), dtype=torch.float32)
    lora = LoraConfig(
        task_type=TaskType.CAUSAL_LM, r=lora_rank, lora_alpha=2 * lora_rank, target_modules=["q_proj", "v_proj"]
    )
    with peft_warnings_ignored():
        return get_peft_model(model, lora)


def demo_batch(batch_size: int):
    """The prompt task and the first `batch_size` training rows: the batch the memory phases measure."""
    from transformers import AutoTokenizer

    from hf_zo.models import embedded_llm_path

    task, data = demo_task(AutoTokenizer.from_pretrained(embedded_llm_path()))
    return task, [data["train"][i] for i in range(batch_size)]
