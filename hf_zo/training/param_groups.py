"""The parameter groups a `ZOTrainer` builds its ZO optimizer over: which parameters ZO trains, the noise index of
each, and which get weight decay."""

from __future__ import annotations

from collections.abc import Collection

import torch

__all__ = ["zo_param_groups"]


def zo_param_groups(
    model: torch.nn.Module, decay_names: Collection[str], excluded: Collection[str], weight_decay: float
) -> list[dict]:
    """The optimizer's parameter groups over the trainable parameters of `model`, except those named in `excluded`
    (a head trained first-order).

    Each parameter's noise index (the group's `"indices"`) is its position among the model's trainable parameters,
    counted before any is excluded, so that the noise of the others does not depend on what is left out. The
    parameters named in `decay_names` get `weight_decay`, the others (biases and norm weights, as in MeZO) none.
    Empty groups are dropped.
    """
    decay_names = set(decay_names)
    groups = {True: {"params": [], "indices": []}, False: {"params": [], "indices": []}}
    trainable = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    for index, (name, param) in enumerate(trainable):
        if name in excluded:  # trained first-order; the other indices stay put
            continue
        groups[name in decay_names]["params"].append(param)
        groups[name in decay_names]["indices"].append(index)
    groups[True]["weight_decay"] = weight_decay
    groups[False]["weight_decay"] = 0.0
    return [g for g in groups.values() if g["params"]]
