"""Share a fine-tune as its trajectory on the Hugging Face Hub: a few kilobytes and a model card."""

from __future__ import annotations

import os

from huggingface_hub import CommitOperationAdd, HfApi

from .format import TRAJECTORY_NAME, ZOTrajectory


def push_trajectory_to_hub(
    repo_id: str,
    trajectory: ZOTrajectory | str | os.PathLike,
    base_model: str | None = None,
    initial_adapter: str | None = None,
    private: bool | None = None,
    token: str | None = None,
    revision: str | None = None,
    commit_message: str = "Upload ZO trajectory",
):
    """Push a trajectory instead of weights: kilobytes, not gigabytes, with a model card that explains how to rebuild.

    Args:
        repo_id (`str`): the Hub model repository (created if missing).
        trajectory (`ZOTrajectory` or path): the trajectory, or a file or folder holding one.
        base_model (`str`, *optional*): the base model's Hub id, if the recorded name is a local path.
        initial_adapter (`str`, *optional*):
            For a PEFT run recorded in format version 1 (which does not store the initial adapter), the Hub id or
            path of the adapter before training.
        private (`bool`, *optional*): whether a created repository is private.
        token (`str`, *optional*): the Hub token.
        revision (`str`, *optional*): the branch to push to.
        commit_message (`str`): the commit message.

    Returns:
        `huggingface_hub.CommitInfo`: the commit.
    """
    if not isinstance(trajectory, ZOTrajectory):
        trajectory = ZOTrajectory.load(trajectory)
    api = HfApi(token=token)
    api.create_repo(repo_id, private=private, exist_ok=True)
    card = trajectory_model_card(trajectory, repo_id, base_model, initial_adapter)
    operations = [
        CommitOperationAdd(TRAJECTORY_NAME, trajectory.to_bytes()),
        CommitOperationAdd("README.md", card.encode("utf-8")),
    ]
    return api.create_commit(repo_id, operations, commit_message=commit_message, revision=revision)


def trajectory_model_card(
    trajectory: ZOTrajectory, repo_id: str, base_model: str | None = None, initial_adapter: str | None = None
) -> str:
    """The README of a trajectory repository: what it is and how to rebuild the fine-tuned model from it.

    Args:
        trajectory (`ZOTrajectory`): the trajectory.
        repo_id (`str`): the repository it is pushed to.
        base_model (`str`, *optional*): the base model's Hub id (default: the recorded name).
        initial_adapter (`str`, *optional*): for a PEFT run of format version 1, the adapter before training.
    """
    header, base = trajectory.header, trajectory.header["base_model"]
    peft = base["peft"]
    base_model = base_model or (peft or {}).get("base_model_name_or_path") or base["name_or_path"]
    optimizer, model_class, dtype = header["optimizer"], base["model_class"], base.get("dtype") or "float32"
    # hf_zo's pooled classifier is built from the sentence encoder's checkpoint, as the run built it.
    pooled = model_class == "PooledEncoderForSequenceClassification"
    loader = "load_sequence_classifier" if pooled else f"{model_class}.from_pretrained"
    model_import = "" if pooled else f"from transformers import {model_class}\n"
    hf_zo_names = "ZOTrajectory, load_sequence_classifier, replay" if pooled else "ZOTrajectory, replay"
    load = f'{loader}("{base_model}", dtype="{dtype}")'
    num_labels = (base.get("config") or {}).get("id2label")
    if num_labels and model_class.endswith("ForSequenceClassification"):
        load = load[:-1] + f", num_labels={len(num_labels)})"
    if peft and "initial_tensors" not in header:
        adapter = initial_adapter or "INITIAL_ADAPTER"
        source, imports = adapter, f"from peft import PeftModel\n{model_import}"
        load = f'PeftModel.from_pretrained({load}, "{adapter}", is_trainable=True)'
        note = (
            f"\nThis run trained a {peft['peft_type']} adapter, so the replay starts from the adapter *before* "
            f"training (`{adapter}`: saved with `model.save_pretrained` before `trainer.train()`), whose "
            "`adapter_config.json` names the base model.\n"
        )
    else:
        source, imports = base_model, model_import
        note = f"\nThe trajectory holds the initial {peft['peft_type']} adapter: `replay` adds it.\n" if peft else ""
    return f"""---
base_model: {base_model}
library_name: hf-zo
tags:
- zeroth-order
- hf-zo
- zo-trajectory
---

# {repo_id}

This repository holds no weights: it holds the zeroth-order fine-tuning trajectory of
[{base_model}](https://huggingface.co/{base_model}), {len(trajectory)} optimizer steps of `{optimizer["class"]}` stored
as seeds and scalars ({len(trajectory.to_bytes()):,} bytes, with the tensors seeds do not regenerate). Replaying it
onto the base model regenerates every perturbation from its seed and rebuilds the fine-tuned weights, bitwise on a
`{header["device_type"]}` device.

## Rebuild the fine-tuned model

```bash
pip install hf-zo
hf-zo replay {source} {repo_id} ./fine-tuned
```
{note}
or in Python:

```python
{imports}from hf_zo import {hf_zo_names}

model = {load}
model = replay(model, ZOTrajectory.from_pretrained("{repo_id}"), show_progress=True)
model.save_pretrained("./fine-tuned")
```

`replay` checks the base against the recorded checksum first and the result against the checksum of the trained
weights. `hf-zo inspect {repo_id}` prints the hyper-parameters and step statistics.

## Run

| | |
| --- | --- |
| optimizer | `{optimizer["class"]}`, eps {optimizer["eps"]}, {optimizer["noise"]["distribution"]} noise \
({optimizer["noise"]["algorithm"]} algorithm), \
{optimizer["num_perturbations"]} perturbation(s) per micro-batch, seed {optimizer["seed"]} |
| steps | {trajectory.first_step} to {trajectory.next_step - 1} |
| base checksum (SHA-256) | `{header["checksums"]["start"]["sha256"]}` |
| trajectory format | version {header["format_version"]} |
"""
