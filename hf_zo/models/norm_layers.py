"""The normalisation layers of any model, as PEFT `target_modules`: ZO on the norms only (PEFT's `LNTuningConfig`)."""

from __future__ import annotations

import re

from torch import nn

__all__ = ["is_norm_module", "norm_module_names"]

# Norm classes in torch itself; transformers defines its own per model (`BertLayerNorm`, `LlamaRMSNorm`, ...), found
# by class name.
_TORCH_NORMS = (nn.LayerNorm, nn.RMSNorm)
_NORM_CLASS_SUFFIXES = ("LayerNorm", "RMSNorm")


def is_norm_module(module: nn.Module) -> bool:
    """Whether `module` is a layer or RMS normalisation: `nn.LayerNorm`, `nn.RMSNorm`, or a class whose name ends in
    ``LayerNorm`` or ``RMSNorm`` (transformers' per-model norms such as `LlamaRMSNorm` or `T5LayerNorm`)."""
    return isinstance(module, _TORCH_NORMS) or type(module).__name__.endswith(_NORM_CLASS_SUFFIXES)


def norm_module_names(model: nn.Module) -> list[str] | str:
    """The `target_modules` that select exactly the normalisation layers of `model` (see :func:`is_norm_module`).

    PEFT's `LNTuningConfig` finds the norms by itself only for the model types in its own table (BERT and OPT, for
    instance, are not there); these names work for any model:

    ```python
    from peft import LNTuningConfig, get_peft_model
    from hf_zo.models import norm_module_names

    config = LNTuningConfig(task_type="SEQ_CLS", target_modules=norm_module_names(model))
    model = get_peft_model(model, config)
    ```

    Usually the last components of the norms' paths (``["LayerNorm"]`` for BERT), which PEFT matches at any depth.
    When some other module shares such a name, those names would select it too, so the answer is then a regular
    expression that PEFT matches against whole paths and that names each norm's path.

    Args:
        model (`nn.Module`): the model, before `get_peft_model`.

    Returns:
        `list[str]` (sorted names) or `str` (a regular expression), for `target_modules`.

    Raises:
        ValueError: if the model has no normalisation layer.
    """
    norm_paths, other_last_names = [], set()
    for path, module in model.named_modules():
        if not path:
            continue
        if is_norm_module(module):
            norm_paths.append(path)
        else:
            other_last_names.add(path.rsplit(".", 1)[-1])
    if not norm_paths:
        raise ValueError(
            f"{type(model).__name__} has no normalisation layer (nn.LayerNorm, nn.RMSNorm or a class named *LayerNorm "
            "or *RMSNorm), so there is nothing for norm tuning to train; choose another PEFT method, such as LoRA."
        )
    last_names = {path.rsplit(".", 1)[-1] for path in norm_paths}
    if last_names & other_last_names:
        return "|".join(re.escape(path) for path in sorted(norm_paths))
    return sorted(last_names)
