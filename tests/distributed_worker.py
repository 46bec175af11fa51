"""The program that `tests/test_distributed.py` launches with `torchrun` / `accelerate launch` (or plain `python`).

Usage: ``python tests/distributed_worker.py SCENARIO OUT_DIR``; the single-process ``reference`` scenario is also
run in the test process itself (`run_scenario`). Each rank trains tiny models with `ZOTrainer` and
writes ``OUT_DIR/rank{rank}.pt``: the trainable parameters after each run, the bytes its ZO collectives sent per
optimizer step, its trajectory, and the checkpoint files it opened for writing. The test compares these across
ranks, layouts and against a single-process reference.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from transformers import OPTConfig, OPTForCausalLM, TrainerCallback  # noqa: E402
from transformers.utils import logging as hf_logging  # noqa: E402

from hf_zo import ZOConfig, ZOTrainer  # noqa: E402

from tiny_models import (  # noqa: E402
    classification_dataset,
    lm_dataset,
    pad_lm_batch,
    ragged_lm_dataset,
    tiny_bert_classifier,
    tiny_causal_lm,
)

STEPS = 4
DUAL = dict(zo_engine="dual")
DISK = dict(zo_engine="dual", zo_offload="disk")
SLICED = dict(DISK, zo_offload_sliced_upload=True)
LOZO = dict(zo_optimizer="lozo", zo_lozo_subspace_steps=2)  # the subspace changes within the run
HIZOO = dict(zo_optimizer="hizoo", zo_hizoo_smooth=1e-3)  # H moves visibly in 4 steps
FZOO = dict(zo_optimizer="fzoo", zo_num_perturbations=2, learning_rate=1e-5)  # its step is lr / eps * sqrt(d / N)
# The first-order head alone (no linear probe): its gradient sums are the one non-scalar exchange.
FIRST_ORDER_HEAD = dict(
    zo_head_init="none", zo_head_training="first_order", dataset=classification_dataset(64), steps=3
)
# The classifier trained by ZO alone, head included: BERT's run beside the causal LM families'.
ZO_HEAD = dict(zo_head_init="none", zo_head_training="zeroth_order", dataset=classification_dataset(32), steps=2)
# Examples of 3 to 16 tokens, batched by length (ZOConfig's default): 6 optimizer steps an epoch at a global batch
# of 4, so step 9 is in the second epoch and checkpoint-7 resumes there.
RAGGED = dict(dataset=ragged_lm_dataset(24, seed=3), data_collator=pad_lm_batch, steps=9)
WRITES: list[str] = []


def _record_checkpoint_writes(event: str, args: tuple) -> None:
    """Audit hook: remember every file opened for writing inside a checkpoint directory."""
    if event == "open" and isinstance(args[1], str) and any(m in args[1] for m in "wax"):
        path = str(args[0])
        if "checkpoint-" in path:
            WRITES.append(os.path.basename(path))


def _recording_save(save):
    """Wrap `torch.save` (which writes from C++, out of the audit hook's sight) to record checkpoint files too."""

    def wrapper(obj, f, *args, **kwargs):
        _record_checkpoint_writes("open", (f, "wb"))
        return save(obj, f, *args, **kwargs)

    return wrapper


def wide_opt(hidden: int) -> torch.nn.Module:
    """A 2-layer OPT of the given width (to show that communication does not grow with the model)."""
    torch.manual_seed(0)
    config = OPTConfig(
        vocab_size=64,
        hidden_size=hidden,
        num_hidden_layers=2,
        ffn_dim=2 * hidden,
        num_attention_heads=4,
        max_position_embeddings=64,
        word_embed_proj_dim=hidden,
        dropout=0.0,
        pad_token_id=1,
    )
    return OPTForCausalLM(config)


def lora(model: torch.nn.Module) -> torch.nn.Module:
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(1)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    return get_peft_model(model, config)


class DivergeAtStep(TrainerCallback):
    """Simulates a replica that drifts: nudges one weight after `step` steps (on the rank it is given to)."""

    def __init__(self, step: int):
        self.step = step

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if state.global_step == self.step:
            with torch.no_grad():
                next(p for p in model.parameters() if p.requires_grad).view(-1)[0] += 1e-3


class HangAtStep(TrainerCallback):
    """Simulates a hung rank: stops answering after `step` steps."""

    def __init__(self, step: int):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            time.sleep(600)


class StopInSecondStep(TrainerCallback):
    """Stops training after `micro_batches` micro-batches of the second optimizer step's accumulation."""

    def __init__(self, micro_batches: int):
        self.left = micro_batches

    def on_substep_end(self, args, state, control, **kwargs):
        if state.global_step == 1:
            self.left -= 1
            control.should_training_stop = self.left == 0


def train(
    out: Path,
    name: str,
    model: torch.nn.Module,
    accumulation: int = 1,
    steps: int = STEPS,
    save_steps: int | None = None,
    resume: str | None = None,
    callbacks=None,
    dataset=None,
    data_collator=None,
    **config,
) -> dict:
    """Train `model` for `steps` optimizer steps; return its trainable parameters and the bytes sent per step."""
    args = ZOConfig(
        output_dir=str(out / name),
        per_device_train_batch_size=2,
        gradient_accumulation_steps=accumulation,
        max_steps=steps,
        learning_rate=config.pop("learning_rate", 1e-3),
        weight_decay=0.01,
        zo_eps=1e-2,
        seed=7,
        logging_steps=1000,
        save_strategy="steps" if save_steps else "no",
        save_steps=save_steps or 500,
        report_to="none",
        disable_tqdm=True,
        use_cpu=True,
        dataloader_num_workers=0,
        **config,
    )
    dataset = lm_dataset(64, length=8) if dataset is None else dataset
    trainer = ZOTrainer(
        model=model, args=args, train_dataset=dataset, data_collator=data_collator, callbacks=callbacks
    )
    trainer.zo_plugin.comm_stats.reset()
    trainer.zo_plugin.upload_stats.reset()
    trainer.train(resume_from_checkpoint=resume)
    assert not isinstance(trainer.model_wrapped, torch.nn.parallel.DistributedDataParallel)
    assert not any(p.grad is not None for p in model.parameters())
    done = steps - (int(resume.rsplit("-", 1)[1]) if resume else 0)
    stats = trainer.zo_plugin.comm_stats.as_dict()
    params = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    return {
        "params": params,
        "bytes_per_step": stats["bytes_sent"] / done,
        "calls_per_step": stats["calls"] / done,
        "upload_bytes_per_step": trainer.zo_plugin.upload_stats.bytes_sent / done,
        "total_batch": trainer.get_total_train_batch_size(args),
        "trajectory": trainer.zo_trajectory.to_bytes(),
    }


def run_scenario(scenario: str, out: Path) -> dict:
    """Run the trainings of `scenario` on this rank; return ``{run name: results}``."""
    rank = int(os.environ.get("RANK", "0"))
    runs = {}
    if scenario == "pertp2":
        sys.addaudithook(_record_checkpoint_writes)
        torch.save = _recording_save(torch.save)
        runs["full"] = train(out, "full", tiny_causal_lm("opt"), save_steps=2)
        checkpoint = str(out / "full" / "checkpoint-2")
        runs["resumed"] = train(out, "resumed", tiny_causal_lm("opt"), resume=checkpoint)
        runs["wide"] = train(out, "wide", wide_opt(128), steps=2)
        runs["dual"] = train(out, "dual", tiny_causal_lm("opt"), **DUAL)
        runs["disk"] = train(out, "disk", tiny_causal_lm("opt"), **DISK)
        runs["disk_sliced"] = train(out, "disk_sliced", tiny_causal_lm("opt"), **SLICED)
        runs["lora_disk_sliced"] = train(out, "lora_disk_sliced", lora(tiny_causal_lm("llama")), **SLICED)
        runs["bert_first_order"] = train(out, "bert_first_order", tiny_bert_classifier(), **FIRST_ORDER_HEAD)
    elif scenario == "2x2":
        # The layout comes from ZOConfig here (the other launches use HF_ZO_PERTURBATION_PARALLEL_SIZE).
        runs["full"] = train(out, "full", tiny_causal_lm("opt"), zo_perturbation_parallel_size=2)
        for accumulation in (1, 2):
            runs[f"bert_first_order_accumulate{accumulation}"] = train(
                out,
                f"bert_first_order_accumulate{accumulation}",
                tiny_bert_classifier(),
                accumulation=accumulation,
                zo_perturbation_parallel_size=2,
                **FIRST_ORDER_HEAD,
            )
        runs["pertp4_q2"] = train(
            out, "pertp4", tiny_causal_lm("opt"), zo_perturbation_parallel_size=4, zo_num_perturbations=2
        )
        # DP replays the other group's micro-batch block by block, through the sliced upload too.
        runs["disk_sliced"] = train(
            out, "disk_sliced", tiny_causal_lm("opt"), zo_perturbation_parallel_size=2, **SLICED
        )
    elif scenario == "dp2":
        runs["full"] = train(out, "full", tiny_causal_lm("opt"))
        runs["verified"] = train(out, "verified", tiny_causal_lm("opt"), zo_verify_replicas_steps=1)
        runs["lora"] = train(out, "lora", lora(tiny_causal_lm("llama")))
        for family in ("qwen2", "gpt2"):
            runs[family] = train(out, family, tiny_causal_lm(family))
        runs["bert_zo"] = train(out, "bert_zo", tiny_bert_classifier(), **ZO_HEAD)
        runs["lozo"] = train(out, "lozo", tiny_causal_lm("opt"), **LOZO)
        runs["hizoo"] = train(out, "hizoo", tiny_causal_lm("opt"), **HIZOO)
        runs["fzoo"] = train(out, "fzoo", tiny_causal_lm("opt"), **FZOO)
        runs["disk"] = train(out, "disk", tiny_causal_lm("opt"), **DISK)
        runs["lora_dual"] = train(out, "lora_dual", lora(tiny_causal_lm("llama")), **DUAL)
        runs["lora_disk"] = train(out, "lora_disk", lora(tiny_causal_lm("llama")), **DISK)
        classify = dict(dataset=classification_dataset(32), steps=2)
        runs["bert"] = train(out, "bert", tiny_bert_classifier(), zo_head_training="zeroth_order", **classify)
        runs["bert_first_order"] = train(
            out, "bert_first_order", tiny_bert_classifier(), zo_head_training="first_order", **classify
        )
        runs["bert_first_order_accumulate2"] = train(
            out, "bert_first_order_accumulate2", tiny_bert_classifier(), accumulation=2, **FIRST_ORDER_HEAD
        )
        # Each rank's first micro-batch of step 2: global micro-batches 0 and 1, then the step is discarded.
        runs["stopped"] = train(out, "stopped", tiny_causal_lm("opt"), accumulation=2, callbacks=[StopInSecondStep(1)])
        runs["ragged"] = train(out, "ragged", tiny_causal_lm("opt"), save_steps=7, **RAGGED)
        checkpoint = str(out / "ragged" / "checkpoint-7")
        runs["ragged_resumed"] = train(out, "ragged_resumed", tiny_causal_lm("opt"), resume=checkpoint, **RAGGED)
    elif scenario == "reference":
        runs["full"] = train(out, "full", tiny_causal_lm("opt"))
        runs["full_accumulate2"] = train(out, "full_acc", tiny_causal_lm("opt"), accumulation=2)
        runs["full_q2"] = train(out, "full_q2", tiny_causal_lm("opt"), zo_num_perturbations=2)
        runs["lora_accumulate2"] = train(out, "lora_acc", lora(tiny_causal_lm("llama")), accumulation=2)
        runs["lozo_accumulate2"] = train(out, "lozo_acc", tiny_causal_lm("opt"), accumulation=2, **LOZO)
        runs["hizoo_accumulate2"] = train(out, "hizoo_acc", tiny_causal_lm("opt"), accumulation=2, **HIZOO)
        runs["fzoo_accumulate2"] = train(out, "fzoo_acc", tiny_causal_lm("opt"), accumulation=2, **FZOO)
        runs["lora"] = train(out, "lora", lora(tiny_causal_lm("llama")))
        for family in ("qwen2", "gpt2"):
            runs[f"{family}_accumulate2"] = train(out, f"{family}_acc", tiny_causal_lm(family), accumulation=2)
        runs["bert_zo_accumulate2"] = train(out, "bert_zo_acc", tiny_bert_classifier(), accumulation=2, **ZO_HEAD)
        runs["ragged_accumulate2"] = train(out, "ragged_acc", tiny_causal_lm("opt"), accumulation=2, **RAGGED)
        runs["stopped_accumulate4"] = train(
            out, "stopped_acc", tiny_causal_lm("opt"), accumulation=4, callbacks=[StopInSecondStep(2)]
        )
        for accumulation in (1, 2, 4):
            runs[f"bert_first_order_accumulate{accumulation}"] = train(
                out,
                f"bert_first_order_accumulate{accumulation}",
                tiny_bert_classifier(),
                accumulation=accumulation,
                **FIRST_ORDER_HEAD,
            )
    elif scenario == "diverge":
        diverge = [DivergeAtStep(2)] if rank == 1 else None
        train(out, "diverge", tiny_causal_lm("opt"), callbacks=diverge, zo_verify_replicas_steps=1)
    elif scenario == "hang":
        train(out, "hang", tiny_causal_lm("opt"), callbacks=[HangAtStep(1)] if rank == 1 else None)
    else:
        raise ValueError(f"Unknown scenario {scenario!r}.")
    return runs


def main(scenario: str, out: Path) -> None:
    torch.set_num_threads(1)
    hf_logging.set_verbosity_error()
    runs = run_scenario(scenario, out)
    with open(out / f"rank{os.environ.get('RANK', '0')}.pt", "wb") as f:
        torch.save({"runs": runs, "writes": WRITES}, f)


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
