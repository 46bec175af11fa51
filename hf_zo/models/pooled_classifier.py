"""A sequence classifier on the pooled sentence embedding its checkpoint was trained to produce.

Sentence-transformers checkpoints (all-MiniLM-L6-v2, all-mpnet-base-v2, e5, bge, ...) are trained to give sentence
embeddings through a pooling step (mean, CLS or max over the tokens, described by `modules.json` and
`1_Pooling/config.json`), not through the encoder's own pooler. `AutoModelForSequenceClassification` puts its head on
that pooler (for BERT: a dense + tanh over the CLS token), which such a checkpoint never trained, so the head starts
from features the body was not trained to give. :class:`PooledEncoderForSequenceClassification` is the same encoder
with the checkpoint's pooling and a linear head; :func:`load_sequence_classifier` picks it whenever the checkpoint
has a pooling config, and `AutoModelForSequenceClassification` otherwise.

The model is a composite `PreTrainedModel` (the pattern of transformers' `EncoderDecoderModel`): its config nests
the encoder's config, so any encoder-only model that transformers implements and `AutoModel` loads works unchanged,
and `save_pretrained`, `from_pretrained` (also through `AutoModelForSequenceClassification` once `hf_zo` is
imported) and `push_to_hub` round-trip. What it cannot reproduce it refuses, naming the fix: checkpoint modules
besides the encoder, one pooling and `Normalize` (a `Dense` projection), encoder-decoder architectures (T5), and
encoders that run the checkpoint's own code (`trust_remote_code=True`), which a saved model would not load back.
"""

from __future__ import annotations

import json
import os

import torch
from torch import nn
from transformers import AutoConfig, AutoModel, AutoModelForSequenceClassification, PreTrainedConfig, PreTrainedModel

try:  # transformers >= 5.20 builds sub-configs from a declared spec
    from transformers.configuration_utils import SubConfigSpec
except ImportError:  # 5.16-5.19: a sub-config is a class; PooledEncoderConfig.__post_init__ builds it
    SubConfigSpec = None
from transformers.modeling_outputs import SequenceClassifierOutput
from transformers.models.auto.modeling_auto import (
    MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES,
    MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES,
)
from transformers.utils import cached_file, logging

logger = logging.get_logger(__name__)

__all__ = [
    "POOLING_MODES",
    "pooling_mismatch",
    "PooledEncoderConfig",
    "PooledEncoderForSequenceClassification",
    "load_sequence_classifier",
    "pool",
    "read_pooling_config",
]

POOLING_MODES = ("mean", "cls", "max", "mean_sqrt_len")
"""Pooling modes: sentence-transformers' `mean`, `cls`, `max` and `mean_sqrt_len_tokens`, one at a time."""

_SENTENCE_TRANSFORMERS_MODES = {"mean_sqrt_len_tokens": "mean_sqrt_len"}
"""sentence-transformers' names of the pooling modes whose hf_zo name differs (the others are the same)."""

_LEGACY_FLAGS = {
    # In sentence-transformers' order, which is the order it concatenates several modes in.
    "pooling_mode_cls_token": "cls",
    "pooling_mode_max_tokens": "max",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
    "pooling_mode_weightedmean_tokens": "weightedmean",
    "pooling_mode_lasttoken": "lasttoken",
}
"""The boolean flags that sentence-transformers wrote in `1_Pooling/config.json` before its `pooling_mode` key."""

_MODULES_COMPUTED = (".Transformer", ".Pooling", ".Normalize")
"""The `modules.json` types (by their class name) that `PooledEncoderForSequenceClassification` computes."""

_HUB_KEYS = ("revision", "token", "cache_dir", "local_files_only")


_ENCODER_SIZES = ("hidden_size", "num_hidden_layers", "num_attention_heads")
"""The encoder's sizes that `PooledEncoderConfig` repeats at its top level, where PEFT looks for them."""


def _encoder_config(encoder: PreTrainedConfig | dict | None) -> PreTrainedConfig:
    """`encoder` as a config: a dict through its `model_type`, `None` as BERT's defaults (transformers < 5.20)."""
    if isinstance(encoder, PreTrainedConfig):
        return encoder
    fields = dict(encoder or {})
    return AutoConfig.for_model(fields.pop("model_type", "bert"), **fields)


class PooledEncoderConfig(PreTrainedConfig):
    r"""Configuration of :class:`PooledEncoderForSequenceClassification`.

    Args:
        encoder (`PreTrainedConfig` or `dict`, *optional*): the encoder's configuration (any `AutoModel` type).
        pooling_mode (`str`, *optional*, defaults to `"mean"`): one of `POOLING_MODES`, over the non-padding tokens.
        normalize (`bool`, *optional*, defaults to `False`): L2-normalise the pooled embedding (sentence-transformers'
            `Normalize` module).
        classifier_dropout (`float`, *optional*, defaults to `0.0`): dropout before the linear head.
        **kwargs: the `PreTrainedConfig` fields (`num_labels`, `id2label`, `problem_type`, ...).
    """

    model_type = "hf_zo_pooled_encoder"
    if SubConfigSpec is not None:
        sub_configs_defaults = {"encoder": SubConfigSpec(config_class=AutoConfig, model_type="bert")}
    else:
        sub_configs = {"encoder": AutoConfig}

    encoder: PreTrainedConfig | dict | None = None
    pooling_mode: str = "mean"
    normalize: bool = False
    classifier_dropout: float = 0.0

    def __post_init__(self, **kwargs):
        if SubConfigSpec is None:  # what `sub_configs_defaults` does from transformers 5.20 on
            self.encoder = _encoder_config(self.encoder)
        if self.pooling_mode not in POOLING_MODES:
            raise ValueError(f"Unknown pooling_mode {self.pooling_mode!r}; choose one of {list(POOLING_MODES)}.")
        super().__post_init__(**kwargs)
        # PEFT's prompt learning (and other tools) read the model's sizes from the top-level config: copy the
        # encoder's, so that a prompt-tuning config needs no `num_layers` / `token_dim` / `num_attention_heads`.
        for size in _ENCODER_SIZES:
            if hasattr(self.encoder, size):
                setattr(self, size, getattr(self.encoder, size))

    def get_text_config(self, decoder: bool | None = None, encoder: bool | None = None) -> PreTrainedConfig:
        """The encoder's config, which holds the text side of this model (its vocabulary, as PEFT's prompt tuning
        and `resize_token_embeddings` read it); the model has no decoder, so `decoder=True` alone gets this config."""
        if decoder and not encoder:
            return super().get_text_config(decoder=decoder, encoder=encoder)
        return self.encoder


def pool(hidden: torch.Tensor, attention_mask: torch.Tensor | None, mode: str) -> torch.Tensor:
    """Pool token states `(batch, tokens, hidden)` into `(batch, hidden)` over the tokens where `attention_mask` is 1.

    Same arithmetic as sentence-transformers' `Pooling` module for the mode; `cls` is the first non-padding token
    (the first token of every row unless the batch is padded on the left).
    """
    if attention_mask is None:
        attention_mask = torch.ones(hidden.shape[:2], dtype=torch.long, device=hidden.device)
    if mode == "cls":
        first = attention_mask.to(torch.int32).argmax(dim=1)  # argmax returns the first of the maxima
        return hidden[torch.arange(hidden.shape[0], device=hidden.device), first.to(hidden.device)]
    mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
    if mode == "max":
        return hidden.masked_fill(mask == 0, torch.finfo(hidden.dtype).min).max(dim=1).values
    counts = mask.sum(dim=1).clamp_min(1e-9)
    summed = (hidden * mask).sum(dim=1)
    return summed / (counts.sqrt() if mode == "mean_sqrt_len" else counts)


class PooledEncoderForSequenceClassification(PreTrainedModel):
    """An `AutoModel` encoder, the pooling of `config.pooling_mode` over its last hidden states, and a linear head.

    Build it from a sentence-transformers checkpoint with :meth:`from_encoder` (or :func:`load_sequence_classifier`);
    a saved one loads with `from_pretrained`. The head is named `classifier`, so PEFT's sequence-classification
    task keeps it in `modules_to_save` and `ZOTrainer`'s head options find it.

    Args:
        config (`PooledEncoderConfig`): the configuration.
        encoder (`PreTrainedModel`, *optional*): an encoder to use instead of a new one built from `config.encoder`.
    """

    config_class = PooledEncoderConfig
    base_model_prefix = "encoder"
    supports_gradient_checkpointing = True
    _supports_sdpa = True

    def __init__(self, config: PooledEncoderConfig, encoder: PreTrainedModel | None = None):
        super().__init__(config)
        self.encoder = encoder if encoder is not None else AutoModel.from_config(config.encoder)
        _drop_unused_pooler(self.encoder)
        self._no_split_modules = getattr(self.encoder, "_no_split_modules", None)
        self.dropout = nn.Dropout(config.classifier_dropout)
        self.classifier = nn.Linear(config.encoder.hidden_size, config.num_labels)
        self.post_init()

    def _init_weights(self, module: nn.Module) -> None:
        if module is self.classifier:
            nn.init.normal_(module.weight, std=getattr(self.config.encoder, "initializer_range", 0.02))
            nn.init.zeros_(module.bias)

    @classmethod
    def from_encoder(
        cls,
        name_or_path: str | os.PathLike,
        pooling_mode: str | None = None,
        normalize: bool | None = None,
        classifier_dropout: float = 0.0,
        **kwargs,
    ) -> PooledEncoderForSequenceClassification:
        """Load the encoder of a checkpoint and put a new linear head on its pooled output.

        The checkpoint's modules must be ones this class computes (the encoder, one pooling, an optional
        `Normalize`); anything else (a `Dense` projection, several pooling modes, a mode outside `POOLING_MODES`)
        fails naming it, unless `pooling_mode` is given, which puts the head on that pooling of the encoder's token
        states instead. Encoder-decoder architectures (T5, ...) and encoders that run custom code
        (`trust_remote_code=True`) fail: this class could not load them back once saved.

        Args:
            name_or_path (`str` or `os.PathLike`): Hub id or local folder of the encoder checkpoint.
            pooling_mode (`str`, *optional*): overrides the checkpoint's pooling config (one of `POOLING_MODES`).
                Required when the checkpoint has none.
            normalize (`bool`, *optional*): overrides whether the checkpoint normalises its embeddings.
            classifier_dropout (`float`, defaults to 0.0): dropout before the head.
            **kwargs: `num_labels`, `id2label`, `label2id`, `problem_type` go to the config; the rest (`dtype`,
                `device_map`, `revision`, `token`, ...) to `AutoModel.from_pretrained`. The head is put on the
                device the encoder's output lands on.

        Returns:
            `PooledEncoderForSequenceClassification`: the pretrained encoder with a newly initialised head.
        """
        label_keys = ("num_labels", "id2label", "label2id", "problem_type")
        label_kwargs = {k: kwargs.pop(k) for k in label_keys if k in kwargs}
        hub_kwargs = {k: kwargs[k] for k in _HUB_KEYS if k in kwargs}
        encoder_config = AutoConfig.from_pretrained(name_or_path, **_config_kwargs(kwargs))
        _refuse_unloadable_encoder(name_or_path, encoder_config)
        checkpoint = read_pooling_config(name_or_path, **hub_kwargs)
        if pooling_mode is None:
            pooling_mode = _checkpoint_pooling_mode(name_or_path, checkpoint)
        elif checkpoint is not None and checkpoint["unsupported_modules"]:
            logger.warning(
                "%s: the head reads the %r pooling of the encoder's token states, without the checkpoint's %s.",
                name_or_path,
                pooling_mode,
                ", ".join(checkpoint["unsupported_modules"]),
            )
        encoder = AutoModel.from_pretrained(name_or_path, **kwargs)
        _refuse_unloadable_encoder(name_or_path, encoder_config, encoder)
        config = PooledEncoderConfig(
            encoder=encoder.config,
            pooling_mode=pooling_mode,
            normalize=bool(checkpoint and checkpoint["normalize"]) if normalize is None else normalize,
            classifier_dropout=classifier_dropout,
            pad_token_id=encoder.config.pad_token_id,
            # The composite config sets its attention implementation on its sub-configs: keep the encoder's.
            attn_implementation=encoder.config._attn_implementation,
            **label_kwargs,
        )
        config.name_or_path = str(name_or_path)
        model = cls(config, encoder=encoder)
        # Only the new head moves: the encoder is where `AutoModel` put it (in its dtype, on the devices of
        # `device_map`), and casting the whole model would also cast modules an encoder keeps in float32.
        head_device = _output_device(encoder)
        model.classifier.to(device=head_device, dtype=encoder.dtype)
        if getattr(encoder, "hf_device_map", None):
            # transformers reads the top-level model's map (to save offloaded weights, and Trainer to leave a
            # dispatched model where it is): the encoder's map under its attribute name, plus the head.
            model.hf_device_map = _composite_device_map(encoder, head_device)
        return model.eval()  # eval, as `from_pretrained` returns models

    def get_input_embeddings(self) -> nn.Module:
        return self.encoder.get_input_embeddings()

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        output_hidden_states: bool | None = None,
        output_attentions: bool | None = None,
        **kwargs,
    ) -> SequenceClassifierOutput:
        """Encode, pool, classify; with `labels`, the loss of `config.problem_type` (as BERT's classifiers).

        Returns:
            `SequenceClassifierOutput`: `loss` (with labels), `logits`, and the encoder's `hidden_states` and
            `attentions` when asked for.
        """
        inputs = dict(
            input_ids=input_ids,
            attention_mask=attention_mask,
            token_type_ids=token_type_ids,
            position_ids=position_ids,
            inputs_embeds=inputs_embeds,
            output_hidden_states=output_hidden_states,
            output_attentions=output_attentions,
        )
        # Encoders differ in which of these they accept (no token types in RoBERTa-style models): pass those given.
        outputs = self.encoder(**{k: v for k, v in inputs.items() if v is not None}, **kwargs)
        hidden = outputs[0]
        if attention_mask is not None and attention_mask.shape[1] != hidden.shape[1]:
            raise ValueError(
                f"attention_mask covers {attention_mask.shape[1]} tokens but the encoder returned {hidden.shape[1]}."
            )
        pooled = pool(hidden, attention_mask, self.config.pooling_mode)
        if self.config.normalize:
            pooled = nn.functional.normalize(pooled, p=2, dim=-1)
        logits = self.classifier(self.dropout(pooled))
        loss = None if labels is None else self._loss(logits, labels)
        return SequenceClassifierOutput(
            loss=loss,
            logits=logits,
            hidden_states=getattr(outputs, "hidden_states", None),
            attentions=getattr(outputs, "attentions", None),
        )

    def _loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        problem = self.config.problem_type
        if problem is None:
            integral = labels.dtype in (torch.long, torch.int)
            problem = "regression" if self.config.num_labels == 1 else "single_label_classification"
            problem = "multi_label_classification" if problem != "regression" and not integral else problem
            self.config.problem_type = problem
        if problem == "regression":
            return nn.functional.mse_loss(logits.squeeze(-1), labels.squeeze(-1).to(logits.dtype))
        if problem == "single_label_classification":
            return nn.functional.cross_entropy(logits.view(-1, self.config.num_labels), labels.view(-1))
        return nn.functional.binary_cross_entropy_with_logits(logits, labels.to(logits.dtype))


def _drop_unused_pooler(encoder: nn.Module) -> None:
    """Remove the encoder's own pooler (BERT-style models skip it when it is `None`): the head reads the pooled
    token states instead, and an unused pooler would only add parameters that training perturbs for nothing."""
    if isinstance(getattr(encoder, "pooler", None), nn.Module):
        encoder.pooler = None


def _config_kwargs(kwargs: dict) -> dict:
    """The hub options in `kwargs`, and `trust_remote_code` when given, as `AutoConfig.from_pretrained` takes them."""
    return {k: kwargs[k] for k in (*_HUB_KEYS, "trust_remote_code") if k in kwargs}


def _runs_custom_code(obj: object) -> bool:
    # transformers imports the code a checkpoint ships (trust_remote_code=True) as modules of this package.
    return type(obj).__module__.startswith("transformers_modules")


def _refuse_unloadable_encoder(
    name_or_path: str | os.PathLike, config: PreTrainedConfig, encoder: nn.Module | None = None
) -> None:
    """Fail, naming why and what to do instead, on an encoder that a saved `PooledEncoderForSequenceClassification`
    would not rebuild: one whose config or model class is the checkpoint's own code, or an encoder-decoder model."""
    custom = next((obj for obj in (config, encoder) if obj is not None and _runs_custom_code(obj)), None)
    if custom is not None:
        where = f"{type(custom).__module__.rsplit('.', 1)[-1]}.{type(custom).__name__}"  # the checkpoint's file
        raise ValueError(
            f"{name_or_path} runs its own code ({where}, with trust_remote_code=True): a saved "
            "PooledEncoderForSequenceClassification keeps the encoder's config but not its code, so it would not "
            "load back. Use a checkpoint of an architecture transformers implements, or "
            "AutoModelForSequenceClassification.from_pretrained(..., trust_remote_code=True) if the checkpoint's "
            "code has a sequence-classification head."
        )
    model_type = getattr(config, "model_type", None)
    seq2seq = model_type in MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES or model_type in (
        MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES
    )
    # A T5 encoder saved alone (T5EncoderModel) writes is_encoder_decoder=False, yet AutoModel builds the whole
    # T5Model from its config: the model type says what AutoModel builds.
    if seq2seq or getattr(config, "is_encoder_decoder", False):
        raise ValueError(
            f"{name_or_path} is a {model_type!r} checkpoint, an encoder-decoder architecture: AutoModel builds it "
            "with a decoder (which a sentence-transformers checkpoint does not train, and whose forward needs "
            "decoder inputs), and PooledEncoderForSequenceClassification holds encoder-only models. Use an "
            "encoder-only sentence-transformers checkpoint (BERT, MPNet, XLM-RoBERTa, ...)."
        )


def _checkpoint_pooling_mode(name_or_path: str | os.PathLike, checkpoint: dict | None) -> str:
    """The one pooling mode of `checkpoint` (from `read_pooling_config`), or an error naming what is not computed
    and the fix."""
    if checkpoint is None:
        raise ValueError(
            f"{name_or_path} has no sentence-transformers pooling config (a modules.json with a Pooling module): "
            f"pass pooling_mode, one of {list(POOLING_MODES)}, to choose the pooling (or load it with "
            "AutoModelForSequenceClassification)."
        )
    if checkpoint["unsupported_modules"]:
        raise ValueError(
            f"{name_or_path} has {', '.join(checkpoint['unsupported_modules'])} in its modules.json, which "
            "PooledEncoderForSequenceClassification does not compute, so its head would not read the embedding the "
            f"checkpoint was trained to give. Pass pooling_mode (one of {list(POOLING_MODES)}) to put the head on "
            "that pooling of the encoder's token states without them, or load the checkpoint with "
            "AutoModelForSequenceClassification."
        )
    modes = checkpoint["pooling_modes"]
    if len(modes) != 1 or modes[0] not in POOLING_MODES:
        raise ValueError(
            f"{name_or_path} pools with {modes}; PooledEncoderForSequenceClassification uses exactly one of "
            f"{list(POOLING_MODES)}: pass pooling_mode to choose it (or load the checkpoint with "
            "AutoModelForSequenceClassification)."
        )
    return modes[0]


def _output_device(encoder: PreTrainedModel) -> torch.device:
    """The device the encoder's last hidden states land on: that of its first parameter, where inputs go (for a
    model dispatched by `device_map`, accelerate returns the outputs on the inputs' device); when that parameter
    is offloaded, accelerate's main device (the first in the map that is not `cpu` or `disk`, else `cpu`)."""
    device = encoder.device
    if device.type != "meta":
        return device
    devices = [d for d in (getattr(encoder, "hf_device_map", None) or {}).values() if d not in ("cpu", "disk")]
    return torch.device(devices[0]) if devices else torch.device("cpu")


def _composite_device_map(encoder: PreTrainedModel, head_device: torch.device) -> dict:
    """The encoder's `hf_device_map` with its module names under `encoder.`, less the removed pooler, plus the head
    on `head_device`, written as the map already writes that device (so that Trainer counts one device, not two)."""
    device_map = {}
    for name, device in encoder.hf_device_map.items():
        try:
            encoder.get_submodule(name)
        except AttributeError:  # the pooler, which `_drop_unused_pooler` removed
            continue
        device_map[f"encoder.{name}" if name else "encoder"] = device
    same = [d for d in device_map.values() if d != "disk" and torch.device(d) == head_device]
    device_map["classifier"] = same[0] if same else str(head_device)
    return device_map


def read_pooling_config(name_or_path: str | os.PathLike, **hub_kwargs) -> dict | None:
    """The pooling of a sentence-transformers checkpoint, from its `modules.json` and pooling module config.

    Reads both formats of `1_Pooling/config.json`: the `pooling_mode` key (a mode or a list of modes) that current
    sentence-transformers releases write, and the `pooling_mode_*_tokens` flags of older ones (neither: `mean`, as
    sentence-transformers loads it). `include_prompt` is not read: it only matters when sentence-transformers
    encodes with a prompt, and the classifier pools over every token it is given.

    Args:
        name_or_path (`str` or `os.PathLike`): Hub id or local folder.
        **hub_kwargs: `revision`, `token`, `cache_dir`, `local_files_only`, as for `cached_file`.

    Returns:
        `dict` or `None`: ``{"pooling_modes": list[str], "normalize": bool, "unsupported_modules": list[str]}``:
        the modes (hf_zo's names, `POOLING_MODES`, for those it implements; sentence-transformers' for the others,
        `weightedmean` and `lasttoken`), whether a `Normalize` module follows, and the modules other than the
        encoder, the pooling and `Normalize` (e.g. a `Dense` projection), each as its type and path. `None` when
        the checkpoint is not a sentence-transformers one (no `modules.json` or no `Pooling` module in it).
    """

    def read_json(filename: str):
        path = cached_file(
            str(name_or_path),
            filename,
            _raise_exceptions_for_missing_entries=False,
            _raise_exceptions_for_connection_errors=False,
            **hub_kwargs,
        )
        if path is None:
            return None
        with open(path, encoding="utf-8") as file:
            return json.load(file)

    modules = read_json("modules.json")
    if not modules:
        return None
    pooling = next((m for m in modules if m.get("type", "").endswith(".Pooling")), None)
    if pooling is None:
        return None
    config = read_json(f"{pooling['path']}/config.json" if pooling.get("path") else "config.json")
    if config is None:
        return None
    if "pooling_mode" in config:
        modes = config["pooling_mode"]
        modes = [modes] if isinstance(modes, str) else list(modes)
    else:
        # sentence-transformers reads these flags as the list of those set, and as mean when none is.
        modes = [mode for flag, mode in _LEGACY_FLAGS.items() if config.get(flag)] or ["mean"]
    unsupported = [
        f"{m.get('type')} (at {m.get('path', '')!r})"
        for m in modules
        if not m.get("type", "").endswith(_MODULES_COMPUTED)
    ]
    return {
        "pooling_modes": [_SENTENCE_TRANSFORMERS_MODES.get(mode, mode) for mode in modes],
        "normalize": any(m.get("type", "").endswith(".Normalize") for m in modules),
        "unsupported_modules": unsupported,
    }


def pooling_mismatch(model: nn.Module) -> str | None:
    """Why `model`'s head does not see the features its checkpoint was trained for, or `None` if it does.

    True of a `*ForSequenceClassification` loaded with `AutoModelForSequenceClassification` from a
    sentence-transformers checkpoint (looked up locally only: `config.name_or_path`'s pooling config).
    """
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    path = getattr(getattr(base, "config", None), "name_or_path", "")
    if isinstance(base, PooledEncoderForSequenceClassification) or not path or not os.path.isdir(path):
        return None
    try:
        pooling = read_pooling_config(path, local_files_only=True)
    except (OSError, ValueError):
        return None
    if pooling is None or not type(base).__name__.endswith("ForSequenceClassification"):
        return None
    # With modules the pooled classifier does not compute, it loads only when told which pooling to read.
    choose = ", pooling_mode=..." if pooling["unsupported_modules"] else ""
    return (
        f"{path} is a sentence-transformers checkpoint trained with {pooling['pooling_modes']} pooling, but the head "
        f"of {type(base).__name__} reads the encoder's own pooler, which that checkpoint never trained. Load it with "
        f"hf_zo.load_sequence_classifier(path, num_labels=...{choose}) so that the head sees the pooled embedding."
    )


def load_sequence_classifier(name_or_path: str | os.PathLike, **kwargs) -> PreTrainedModel:
    """Load a sequence classifier whose head sees the features its checkpoint was trained for.

    A sentence-transformers checkpoint (one with a pooling config) gives a
    :class:`PooledEncoderForSequenceClassification` with the checkpoint's pooling; any other checkpoint (including
    a saved `PooledEncoderForSequenceClassification`) loads with `AutoModelForSequenceClassification`.

    Args:
        name_or_path (`str` or `os.PathLike`): Hub id or local folder.
        **kwargs: `num_labels`, `dtype`, `device_map`, `trust_remote_code`, ... as for `from_pretrained`; for a
            sentence-transformers checkpoint also `pooling_mode`, `normalize` and `classifier_dropout`, as for
            :meth:`PooledEncoderForSequenceClassification.from_encoder`.

    Returns:
        `PreTrainedModel`: the classifier.
    """
    hub_kwargs = {k: kwargs[k] for k in _HUB_KEYS if k in kwargs}
    config = AutoConfig.from_pretrained(name_or_path, **_config_kwargs(kwargs))
    if not isinstance(config, PooledEncoderConfig) and read_pooling_config(name_or_path, **hub_kwargs) is not None:
        return PooledEncoderForSequenceClassification.from_encoder(name_or_path, **kwargs)
    return AutoModelForSequenceClassification.from_pretrained(name_or_path, **kwargs)


AutoConfig.register(PooledEncoderConfig.model_type, PooledEncoderConfig)
AutoModelForSequenceClassification.register(PooledEncoderConfig, PooledEncoderForSequenceClassification)
