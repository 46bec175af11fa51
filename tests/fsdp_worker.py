"""The program that `tests/test_fsdp.py` launches with `accelerate launch` and the FSDP2 CPU config (or runs in its own
process, one thread, for the single-process reference).

Usage: ``python tests/fsdp_worker.py SCENARIO OUT_DIR`` (SCENARIO: `fsdp2`, `reference`, `sharded`,
`hsdp`, `reference_hsdp`). Each rank trains tiny models with `ZOTrainer`, saves them with `save_model`, and writes
``OUT_DIR/rank{rank}.pt``: per run, the whole trainable parameters after training (gathered from the shards), the
logged loss of every step, and the tensors and trajectory of the saved folder (rank 0).
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from distributed_worker import lora  # noqa: E402
from safetensors.torch import load_file  # noqa: E402
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict  # noqa: E402
from transformers.utils import logging as hf_logging  # noqa: E402

from hf_zo import ZOConfig, ZOTrainer  # noqa: E402
from hf_zo.trajectory import TRAJECTORY_NAME  # noqa: E402

from tiny_models import classification_dataset, lm_dataset, tiny_bert_classifier, tiny_causal_lm  # noqa: E402

STEPS = 3
FAMILIES = ("opt", "llama", "qwen2", "gpt2")


def trainable_parameters(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The whole values of the trainable parameters of `model` (gathered from every rank's shards under FSDP2)."""
    whole = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    return {n: whole[n].detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def train(
    out: Path, name: str, model: torch.nn.Module, accumulation: int = 1, dataset=None, resume=None, **config
) -> dict:
    """Train `model` for `STEPS` steps (from checkpoint `resume` if given) and save it; return its parameters,
    losses and saved tensors."""
    config = {"save_strategy": "no", **config}
    args = ZOConfig(
        output_dir=str(out / name),
        per_device_train_batch_size=2,
        gradient_accumulation_steps=accumulation,
        max_steps=STEPS,
        learning_rate=1e-3,
        weight_decay=0.01,
        zo_eps=1e-2,
        seed=7,
        logging_steps=1,
        report_to="none",
        disable_tqdm=True,
        use_cpu=True,
        dataloader_num_workers=0,
        **config,
    )
    dataset = lm_dataset(64, length=8) if dataset is None else dataset
    trainer = ZOTrainer(model=model, args=args, train_dataset=dataset)
    trainer.train(resume_from_checkpoint=resume)
    trainer.save_model()
    params = trainable_parameters(model)
    saved, trajectory = {}, None
    if trainer.args.should_save:
        for file in ("model.safetensors", "adapter_model.safetensors"):
            if (out / name / file).exists():
                saved = load_file(str(out / name / file))
        trajectory = (out / name / TRAJECTORY_NAME).read_bytes()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    return {"params": params, "losses": losses, "saved": saved, "trajectory": trajectory}


def run_scenario(scenario: str, out: Path) -> dict:
    """Run the trainings of `scenario` on this rank; return ``{run name: results}``. `hsdp` (four processes, two
    groups of two shards) and its reference (one process, gradient accumulation 4) train the Llama, whole and with
    LoRA."""
    if scenario == "sharded":  # launched with fsdp_state_dict_type SHARDED_STATE_DICT
        checkpoint = dict(save_strategy="steps", save_steps=2)
        runs = {}
        for run, make in (
            ("llama", lambda: tiny_causal_lm("llama")),
            ("llama_lora", lambda: lora(tiny_causal_lm("llama"))),
        ):
            runs[run] = train(out, run, make(), **checkpoint)
            runs[f"{run}_resumed"] = train(out, f"{run}_resumed", make(), resume=str(out / run / "checkpoint-2"))
        return runs
    if scenario in ("hsdp", "reference_hsdp"):
        accumulation = 4 if scenario == "reference_hsdp" else 1
        return {
            "llama": train(out, "llama", tiny_causal_lm("llama"), accumulation),
            "llama_lora": train(out, "llama_lora", lora(tiny_causal_lm("llama")), accumulation),
        }
    accumulation = 2 if scenario == "reference" else 1
    checkpoint = dict(save_strategy="steps", save_steps=2)  # checkpoint-2, which the FSDP2 launch resumes from
    runs = {}
    for family in FAMILIES:
        runs[family] = train(out, family, tiny_causal_lm(family), accumulation, **checkpoint)
    runs["llama_lora"] = train(out, "llama_lora", lora(tiny_causal_lm("llama")), accumulation, **checkpoint)
    if scenario == "fsdp2":
        for run, model in (("opt", tiny_causal_lm("opt")), ("llama_lora", lora(tiny_causal_lm("llama")))):
            resume = str(out / run / "checkpoint-2")
            runs[f"{run}_resumed"] = train(out, f"{run}_resumed", model, resume=resume)
    classify = dict(zo_head_init="none", zo_head_training="zeroth_order", dataset=classification_dataset(32))
    runs["bert"] = train(out, "bert", tiny_bert_classifier(), accumulation, **classify)
    return runs


def main(scenario: str, out: Path) -> None:
    torch.set_num_threads(1)
    hf_logging.set_verbosity_error()
    logging.basicConfig(format="%(message)s")
    logging.getLogger("hf_zo").setLevel(logging.INFO)  # the layout line
    runs = run_scenario(scenario, out)
    with open(out / f"rank{os.environ.get('RANK', '0')}.pt", "wb") as f:
        torch.save(runs, f)


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
