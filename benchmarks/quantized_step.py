"""ZO LoRA steps on a bitsandbytes 4-bit base on the GPU: peak GPU memory against 4-bit inference on the same batch.

A random Llama of `--shape` is written once in bf16 to a temporary folder, loaded as a user loads a QLoRA base
(`from_pretrained` with `hf_zo.models.base_quantization_config(load_in_4bit=True)`: NF4, compute dtype bf16, so
bitsandbytes' CUDA kernels run the matrix products), wrapped with LoRA r=8 on `q_proj`, `v_proj`, then:

- `inference`: one forward with labels under `torch.inference_mode()` on a batch of `--batch` x `--length` random
  tokens: `inference_peak_mib` is `torch.cuda.max_memory_allocated` over it (weights included);
- `zo`: `--steps` ZO steps of `ZOTrainer` (ZO-SGD, two forwards a step) on batches of the same shape:
  `zo_peak_mib` over the whole `train()`, and `train_s` its wall time.

Prints one JSON line: the model's footprint (`get_memory_footprint`), both peaks, `zo_peak/inference_peak` and the
losses; without a CUDA device or without bitsandbytes, one line with a `skipped` reason, exit code 0 (what
`benchmarks/gpu_check.py`'s `quantized` part and its dry run rely on).

    python benchmarks/quantized_step.py                          # on a GPU machine with bitsandbytes
    python benchmarks/quantized_step.py --shape tiny --steps 2   # a smaller model
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import tempfile
import time

SHAPES = {
    # TinyLlama-1.1B's widths with 8 of its 22 layers: about 0.5B parameters, 1 GB in bf16.
    "small": dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=8, num_attention_heads=32),
    "tiny": dict(hidden_size=256, intermediate_size=704, num_hidden_layers=2, num_attention_heads=4),
}


def skipped_reason() -> str | None:
    """Why this cannot run here, or `None`."""
    import torch

    if not torch.cuda.is_available():
        return "CUDA is not available"
    if importlib.util.find_spec("bitsandbytes") is None:
        return 'bitsandbytes is not installed (pip install "hf-zo[quant]")'
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="small", choices=list(SHAPES))
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--length", type=int, default=256)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    reason = skipped_reason()
    if reason is not None:
        print(json.dumps({"benchmark": "quantized_step", "skipped": reason}), flush=True)
        return

    import torch
    from datasets import Dataset
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    from hf_zo import ZOConfig, ZOTrainer
    from hf_zo.models import base_quantization_config

    config = LlamaConfig(vocab_size=32000, max_position_embeddings=2048, **SHAPES[args.shape])
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, config.vocab_size, (args.batch * (args.steps + 1), args.length), generator=generator)
    with tempfile.TemporaryDirectory() as folder:
        torch.manual_seed(0)
        with torch.device("cuda"):
            LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(folder)
        torch.cuda.empty_cache()
        quantization = base_quantization_config(load_in_4bit=True, compute_dtype=torch.bfloat16)
        base = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16, quantization_config=quantization)
    footprint = base.get_memory_footprint()
    model = get_peft_model(base, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]))

    batch = tokens[: args.batch].cuda()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    with torch.inference_mode():
        inference_loss = model(input_ids=batch, labels=batch).loss.item()
    torch.cuda.synchronize()
    inference_peak = torch.cuda.max_memory_allocated()
    del batch

    data = Dataset.from_dict({"input_ids": tokens.tolist(), "labels": tokens.tolist()})
    zo_args = ZOConfig(
        output_dir=tempfile.mkdtemp(prefix="quantized_step_"),
        per_device_train_batch_size=args.batch,
        max_steps=args.steps,
        learning_rate=1e-4,
        zo_eps=1e-3,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
        bf16=True,
    )
    trainer = ZOTrainer(model=model, args=zo_args, train_dataset=data)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    trainer.train()
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    zo_peak = torch.cuda.max_memory_allocated()
    losses = [log["loss"] for log in trainer.state.log_history if "loss" in log]
    figure = {
        "benchmark": "quantized_step",
        "gpu": torch.cuda.get_device_name(0),
        "shape": args.shape,
        "batch": f"{args.batch}x{args.length}",
        "footprint_mib": round(footprint / 2**20, 1),
        "inference_peak_mib": round(inference_peak / 2**20, 1),
        "zo_peak_mib": round(zo_peak / 2**20, 1),
        "zo_peak/inference_peak": round(zo_peak / inference_peak, 3),
        "train_s": round(seconds, 2),
        "inference_loss": round(inference_loss, 4),
        "losses": [round(loss, 4) for loss in losses],
    }
    print(json.dumps(figure), flush=True)


if __name__ == "__main__":
    main()
