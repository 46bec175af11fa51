"""Share a fine-tune as its trajectory on the Hugging Face Hub: a few kilobytes and a model card."""

from __future__ import annotations

import os

from .format import TRAJECTORY_NAME, ZOTrajectory


def push_trajectory_to_hub(
    repo_id: str,
    trajectory: ZOTrajectory | str | os.PathLike,
    base_model: str | None = None,
    private: bool | None = None,
    token: str | None = None,
    revision: str | None = None,
    commit_message: str = "Upload ZO trajectory",
):
    """Push a trajectory instead of weights: a few kilobytes, with a model card that explains how to rebuild.

    Args:
        repo_id (`str`): the Hub model repository (created if missing).
        trajectory (`ZOTrajectory` or path): the trajectory, or a file or folder holding one.
        base_model (`str`, *optional*): the base model's Hub id, if the recorded name is a local path.
        private (`bool`, *optional*): whether a created repository is private.
        token (`str`, *optional*): the Hub token.
        revision (`str`, *optional*): the branch to push to.
        commit_message (`str`): the commit message.

    Returns:
        `huggingface_hub.CommitInfo`: the commit.
    """
    from huggingface_hub import CommitOperationAdd, HfApi

    if not isinstance(trajectory, ZOTrajectory):
        trajectory = ZOTrajectory.load(trajectory)
    api = HfApi(token=token)
    api.create_repo(repo_id, private=private, exist_ok=True)
    card = trajectory_model_card(trajectory, repo_id, base_model)
    operations = [
        CommitOperationAdd(TRAJECTORY_NAME, trajectory.to_bytes()),
        CommitOperationAdd("README.md", card.encode("utf-8")),
    ]
    return api.create_commit(repo_id, operations, commit_message=commit_message, revision=revision)


def trajectory_model_card(trajectory: ZOTrajectory, repo_id: str, base_model: str | None = None) -> str:
    """The README of a trajectory repository: what it is and how to rebuild the fine-tuned model from it."""
    header, base = trajectory.header, trajectory.header["base_model"]
    base_model = base_model or base["name_or_path"]
    optimizer = header["optimizer"]
    size = len(trajectory.to_bytes())
    peft_note = (
        f"\nThis run trained a PEFT adapter ({base['peft']['peft_type']}): `BASE` is the folder of the *initial* "
        "adapter (saved with `model.save_pretrained` before training), whose `adapter_config.json` names the base "
        "model.\n"
        if base["peft"]
        else ""
    )
    return f"""---
base_model: {base_model}
library_name: hf-zo
tags:
- zeroth-order
- hf-zo
- zo-trajectory
---

# {repo_id}

This repository holds no weights. It holds the zeroth-order fine-tuning trajectory of
[{base_model}](https://huggingface.co/{base_model}): {len(trajectory)} optimizer steps of
`{optimizer["class"]}` stored as seeds and scalars ({size:,} bytes). Replaying it onto the base model regenerates
every perturbation from its seed and rebuilds the fine-tuned weights, bitwise on a `{header["device_type"]}` device.

## Rebuild the fine-tuned model

```bash
pip install hf-zo
hf-zo replay {base_model} {repo_id} ./fine-tuned
```
{peft_note}
or in Python:

```python
from transformers import AutoModel
from hf_zo import ZOTrajectory, replay

model = AutoModel.from_pretrained("{base_model}")  # the class of the run: {base["model_class"]}
replay(model, ZOTrajectory.from_pretrained("{repo_id}"))
```

`replay` checks the base against the recorded checksum first and the result against the checksum of the trained
weights. `hf-zo inspect {repo_id}` prints the hyper-parameters and step statistics.

## Run

| | |
| --- | --- |
| optimizer | `{optimizer["class"]}`, eps {optimizer["eps"]}, {optimizer["noise"]["distribution"]} noise, \
{optimizer["num_perturbations"]} perturbation(s) per micro-batch, seed {optimizer["seed"]} |
| steps | {trajectory.first_step} to {trajectory.next_step - 1} |
| base checksum (SHA-256) | `{header["checksums"]["start"]["sha256"]}` |
| trajectory format | version {header["format_version"]} |
"""
