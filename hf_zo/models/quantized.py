"""Quantized base models through transformers' own quantization config for bitsandbytes (4-bit and 8-bit).

ZO fine-tunes a quantized base the QLoRA way, without the backward pass: a PEFT adapter in full precision is what
ZO perturbs and updates, and no quantized weight is ever written. This module builds the config that
`from_pretrained(..., quantization_config=...)` takes from the flags TRL's `ModelConfig` names (`load_in_4bit`,
`load_in_8bit`, `bnb_4bit_quant_type`, `use_bnb_nested_quant`), tells whether a model is quantized and how, and turns
a model's quantization into a JSON record and back, so that a trajectory's replay quantizes the base the same way.
Needs the `quant` extra: ``pip install "hf-zo[quant]"``.
"""

from __future__ import annotations

import enum
import gc
import importlib.util
import os

import torch

from ..heap import return_freed_memory
from ..pages import MappedPages
from .streamed_checkpoint import StreamedCheckpoint, local_safetensors_files

__all__ = [
    "QUANTIZATION_INSTALL",
    "SUPPORTED_QUANT_METHODS",
    "base_quantization_config",
    "from_pretrained_quantized",
    "is_quantized",
    "quant_method",
    "quantization_config_from_record",
    "quantization_record",
    "release_loading_memory",
]

QUANTIZATION_INSTALL = 'pip install "hf-zo[quant]"'
"""The command that installs bitsandbytes."""

SUPPORTED_QUANT_METHODS = ("bitsandbytes",)
"""The transformers quantization methods (`quantization_config.quant_method`) whose bases ZO trains an adapter on."""

_BNB_4BIT_QUANT_TYPES = ("nf4", "fp4")


def base_quantization_config(
    load_in_4bit: bool = False,
    load_in_8bit: bool = False,
    bnb_4bit_quant_type: str = "nf4",
    use_bnb_nested_quant: bool = False,
    compute_dtype: torch.dtype = torch.float32,
):
    """The quantization config of a base model, for `from_pretrained(..., quantization_config=...)`.

    Args:
        load_in_4bit (`bool`, defaults to `False`): bitsandbytes 4-bit weights (QLoRA's base).
        load_in_8bit (`bool`, defaults to `False`): bitsandbytes 8-bit weights (LLM.int8()).
        bnb_4bit_quant_type (`str`, defaults to `"nf4"`): the 4-bit data type, `"nf4"` or `"fp4"`.
        use_bnb_nested_quant (`bool`, defaults to `False`): quantize the 4-bit scales too (double quantization).
        compute_dtype (`torch.dtype`, defaults to `torch.float32`): the dtype the 4-bit layers compute in.

    Returns:
        `BitsAndBytesConfig` or `None`: `None` when nothing is asked for (full precision).

    Raises:
        ValueError: both widths asked for, or an unknown 4-bit data type.
        ImportError: bitsandbytes is not installed (the message gives the install command).
    """
    from transformers import BitsAndBytesConfig

    asked = [name for name, on in (("load_in_4bit", load_in_4bit), ("load_in_8bit", load_in_8bit)) if on]
    if len(asked) > 1:
        raise ValueError(f"Choose one quantization of the base, got {asked}: keep one of them.")
    if load_in_4bit and bnb_4bit_quant_type not in _BNB_4BIT_QUANT_TYPES:
        raise ValueError(
            f"bnb_4bit_quant_type must be one of {list(_BNB_4BIT_QUANT_TYPES)}, got {bnb_4bit_quant_type!r}."
        )
    if load_in_4bit or load_in_8bit:
        _require("bitsandbytes")
        if load_in_8bit:
            return BitsAndBytesConfig(load_in_8bit=True)
        return BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type=bnb_4bit_quant_type,
            bnb_4bit_use_double_quant=use_bnb_nested_quant,
            bnb_4bit_compute_dtype=compute_dtype,
        )
    return None


def from_pretrained_quantized(model_class, model_name_or_path: str, quantization_config=None, **kwargs):
    """`model_class.from_pretrained(model_name_or_path, quantization_config=quantization_config, **kwargs)`, reading a
    local full-precision checkpoint one tensor at a time when it is quantized on the fly.

    transformers quantizes each weight from one mapping of the checkpoint that stays open until loading ends, so a
    base quantized on load holds the whole full-precision model at the end of loading (556 MB on SmolLM2-135M, whose
    4-bit base is 160 MB). Here the weights of a local safetensors folder come from a :class:`StreamedCheckpoint`
    instead, each read into memory that is freed once it is quantized, so loading peaks near the quantized model's
    size. Anything else (no quantization, a base saved quantized, a Hub id, a `.bin` checkpoint, a `subfolder` or
    `variant`) goes to `from_pretrained` unchanged. The model is the same either way: same config, same weights.

    Args:
        model_class: a transformers model class or auto class (`AutoModelForCausalLM`, ...).
        model_name_or_path (`str`): the checkpoint, as `from_pretrained` takes it.
        quantization_config: the quantization config (:func:`base_quantization_config`), or `None`.
        **kwargs: the other `from_pretrained` arguments (`dtype`, `config`, ...).
    """
    from transformers import AutoConfig, GenerationConfig
    from transformers.utils import GENERATION_CONFIG_NAME

    files = local_safetensors_files(model_name_or_path)
    config = kwargs.pop("config", None)
    if quantization_config is not None and files is not None and not {"subfolder", "variant"} & set(kwargs):
        if config is None:
            config = AutoConfig.from_pretrained(model_name_or_path, trust_remote_code=kwargs.get("trust_remote_code"))
        if getattr(config, "quantization_config", None) is None:  # quantized on load, not saved quantized
            kwargs.pop("revision", None)  # a local folder has no revisions
            if hasattr(model_class, "_model_mapping"):  # an auto class: the model class it picks for this config
                model_class = model_class._model_mapping[type(config)]
            with StreamedCheckpoint(files) as checkpoint:
                model = model_class.from_pretrained(
                    None, config=config, state_dict=checkpoint, quantization_config=quantization_config, **kwargs
                )
            model.name_or_path = model.config.name_or_path = str(model_name_or_path)
            if model.can_generate() and os.path.isfile(os.path.join(model_name_or_path, GENERATION_CONFIG_NAME)):
                model.generation_config = GenerationConfig.from_pretrained(model_name_or_path)
            return model
    if config is not None:
        kwargs["config"] = config
    if quantization_config is not None:  # an explicit None would load a base saved quantized as a float one
        kwargs["quantization_config"] = quantization_config
    return model_class.from_pretrained(model_name_or_path, **kwargs)


def is_quantized(model: torch.nn.Module) -> bool:
    """Whether `model` (or the base model of a PEFT model) was loaded with a quantization config."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return bool(getattr(base, "is_quantized", False) or getattr(base, "hf_quantizer", None) is not None)


def quant_method(model: torch.nn.Module) -> str | None:
    """The quantization method of `model` (or of a PEFT model's base) as transformers names it (`"bitsandbytes"`,
    `"torchao"`, `"gptq"`, ...), or `None` for a model in full precision."""
    config = _quantization_config(model)
    if config is None:
        return None
    method = config.get("quant_method") if isinstance(config, dict) else getattr(config, "quant_method", None)
    return str(_plain(method))


def quantization_record(model: torch.nn.Module) -> dict | None:
    """The quantization config `model` (or a PEFT model's base) was loaded with, as JSON-serializable values (what a
    trajectory records), or `None` for a model in full precision."""
    config = _quantization_config(model)
    if config is None:
        return None
    return _plain(config.to_dict() if hasattr(config, "to_dict") else dict(config))


def _quantization_config(model: torch.nn.Module):
    if not is_quantized(model):
        return None
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    quantizer = getattr(base, "hf_quantizer", None)
    return quantizer.quantization_config if quantizer is not None else base.config.quantization_config


def quantization_config_from_record(record: dict):
    """The quantization config (a transformers `QuantizationConfigMixin`) of a :func:`quantization_record`: pass it to
    `from_pretrained(..., quantization_config=...)` to quantize a base the way the recorded one was."""
    from transformers.quantizers import AutoQuantizationConfig

    if record.get("quant_method") == "bitsandbytes":
        _require("bitsandbytes")
    return AutoQuantizationConfig.from_dict(dict(record))


def release_loading_memory(model: torch.nn.Module) -> int:
    """Hand back the memory that loading a quantized `model` leaves behind, before it trains.

    `from_pretrained` maps the full-precision checkpoint and quantizes each weight from it; the tensors left
    unquantized (embeddings, norms, the LM head) stay views of that mapping, which keeps every page read through it
    resident, the full-precision weights of the quantized layers included, and the allocator keeps the quantization's
    temporaries. This returns the freed heap to the system (glibc's `malloc_trim`) and reclaims the pages of every
    mapping the model's tensors still lie in (`MADV_PAGEOUT`, which keeps any page a write has changed): nothing is
    copied, so nothing is added to the peak, and the unquantized weights' pages come back from the file as they are
    read, as a full-precision model's do. A model in full precision is left as it is: its weights are the mapping.

    Returns:
        `int`: the bytes of the file mappings released (0 where the model is not quantized or holds no mapping).
    """
    if not is_quantized(model):
        return 0
    gc.collect()
    return_freed_memory()
    return MappedPages(private=True).release_mappings([*model.parameters(), *model.buffers()])


def _require(package: str) -> None:
    if importlib.util.find_spec(package) is None:
        raise ImportError(f"A base quantized with {package} needs it installed, and it is not: {QUANTIZATION_INSTALL}")


def _plain(value):
    """`value` with enums as their values and dtypes as names: what `json.dumps` writes and reads back equal."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, enum.Enum):
        return _plain(value.value)
    if isinstance(value, torch.dtype):
        return str(value).removeprefix("torch.")
    return value
