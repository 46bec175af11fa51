"""hf_zo's defaults in one place: the learning rate and eps `ZOConfig` uses when they are left unset (chosen by what
the model trains, by the loss and by the optimizer) and `examples/train.py`'s prompt recipe.

ZO learning rates differ by orders of magnitude between fine-tuning methods (MeZO's grid: 1e-6 for all weights, 1e-4
for LoRA, 1e-3 for prefix tuning), so no single number can be `TrainingArguments`' 5e-5. :func:`defaults_table` renders
every default as the table of docs/hyperparameters.md (tests/test_defaults.py keeps the two equal); the measurements
behind them are in docs/results/.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn
from transformers.utils import logging

from ..prompts import PromptClassification

logger = logging.get_logger(__name__)

__all__ = [
    "LABEL_WORD_LORA_TARGET_DEFAULTS",
    "LABEL_WORD_METHOD_DEFAULTS",
    "METHOD_DEFAULTS",
    "OPTIMIZER_METHOD_DEFAULTS",
    "MethodDefaults",
    "PROMPT_LORA_LAYERS_LEFT_OUT",
    "PROMPT_LORA_TARGET_MODULES",
    "PROMPT_ZO_DEFAULTS",
    "defaults_table",
    "fill_method_defaults",
    "log_zo_settings",
    "lora_target_names",
    "prompt_lora_layers",
    "prompt_lora_target_modules",
    "trains_label_words",
    "trained_method",
]


@dataclass(frozen=True)
class MethodDefaults:
    """The ZO learning rate and eps for one fine-tuning method, and where they come from."""

    learning_rate: float
    zo_eps: float
    source: str


METHOD_DEFAULTS: dict[str, MethodDefaults] = {
    "full": MethodDefaults(1e-6, 1e-3, "MeZO's grid for full fine-tuning"),
    "lora": MethodDefaults(1e-4, 1e-2, "MeZO's grid for LoRA"),
    "ln_tuning": MethodDefaults(3e-4, 1e-3, "chosen on all-MiniLM-L6-v2 with held-out SST-2 phrases"),
    "prefix": MethodDefaults(1e-3, 1e-1, "MeZO's grid for prefix tuning"),
}
"""Defaults by method (docs/hyperparameters.md)."""

LABEL_WORD_METHOD_DEFAULTS: dict[str, MethodDefaults] = {
    "lora": MethodDefaults(
        2e-3,
        1e-2,
        "chosen on SmolLM2-135M-Instruct, LoRA r 8 on q/v, SST-2 prompts (docs/results/accuracy.md); a ZO step "
        "grows with the trained parameters, so lower it for larger models (MeZO: 1e-4 on OPT-13B)",
    ),
}
"""Defaults by method when the loss is the cross-entropy over a prompt's label words
(`hf_zo.prompts.PromptClassification` with ``loss="classification"``, MeZO's prompt-based classification), where
they differ from :data:`METHOD_DEFAULTS`: the label-word loss is far smaller than a full-vocabulary loss, and so is
its ZO step at one rate (docs/results/accuracy.md, docs/results/trl.md)."""

LABEL_WORD_LORA_TARGET_DEFAULTS: dict[frozenset[str], MethodDefaults] = {
    frozenset({"q_proj"}): MethodDefaults(
        4e-3,
        1e-2,
        "chosen on SmolLM2-135M-Instruct, LoRA r 8 on q_proj alone, SST-2 prompts (docs/results/accuracy.md): the "
        "query projections' estimate has more signal against its noise than q and v together, so the step can be "
        "longer",
    ),
}
"""Label-word defaults for LoRA by the modules it adapts (their names without the layer path), where they differ from
:data:`LABEL_WORD_METHOD_DEFAULTS`' LoRA entry: the ZO step a LoRA adapter takes depends on which weights it
perturbs, not only on how many."""

PROMPT_LORA_TARGET_MODULES = ("q_proj",)
"""LoRA's default targets for a prompt task on a causal LM (:func:`prompt_lora_target_modules`): the attention's query
projections, the weights whose ZO estimate had the best signal against its noise on the embedded LLM
(docs/results/accuracy.md)."""

PROMPT_LORA_LAYERS_LEFT_OUT = 1 / 3
"""The share of a causal LM's lowest layers that LoRA leaves alone for a prompt task (:func:`prompt_lora_layers`): on
the embedded LLM their query projections carried little of the label-word loss's gradient signal and much of its
noise, and leaving them frozen lets each ZO step run them once for all its forwards (`ZOConfig.zo_reuse_frozen_prefix`;
docs/results/accuracy.md)."""

PROMPT_ZO_DEFAULTS: dict[str, object] = {
    "zo_optimizer": "fzoo",
    "zo_num_perturbations": 4,
    "zo_noise": "rademacher",
    "learning_rate": 6e-5,
    "zo_eps": 1e-2,
}
"""The `ZOConfig` fields of `examples/train.py --recipe prompt`, for LoRA on a prompt task: FZOO's four one-sided
Rademacher estimates around one centre loss, its step normalised by their spread, at twice FZOO's general LoRA rate
(the setting that lowered the held-out label-word loss furthest on the embedded LLM: docs/results/accuracy.md)."""

OPTIMIZER_METHOD_DEFAULTS: dict[str, dict[str, MethodDefaults]] = {
    "fzoo": {
        "lora": MethodDefaults(3e-5, 1e-2, "chosen on SmolLM2-135M-Instruct, SST-2 prompts (docs/results/accuracy.md)")
    },
}
"""Defaults by method of the optimizers whose learning rate has another scale than MeZO's: FZOO normalises its
step by the spread of the perturbed losses, so its step is about ``lr / eps * sqrt(trainable / N)`` long."""

# PEFT's method names (`PeftType` values) that train like the methods above.
_PEFT_METHODS = {
    "LORA": "lora",
    "ADALORA": "lora",
    "LOHA": "lora",
    "LOKR": "lora",
    "LN_TUNING": "ln_tuning",
    "PREFIX_TUNING": "prefix",
    "PROMPT_TUNING": "prefix",
    "P_TUNING": "prefix",
}


def trained_method(model: nn.Module) -> str:
    """The key of :data:`METHOD_DEFAULTS` for what `model` trains: its PEFT method, or ``"full"`` without PEFT.

    Raises:
        ValueError: for a PEFT method without measured defaults.
    """
    peft_config = getattr(model, "active_peft_config", None)  # a peft.PeftModel
    if peft_config is None and getattr(model, "_hf_peft_config_loaded", False):  # transformers' `add_adapter`
        peft_config = model.peft_config[model.active_adapters()[0]]
    if peft_config is None:
        return "full"
    peft_type = getattr(peft_config.peft_type, "value", peft_config.peft_type)
    if peft_type not in _PEFT_METHODS:
        raise ValueError(
            f"ZOConfig has no default learning_rate or zo_eps for the PEFT method {peft_type}; set both (for example "
            "learning_rate=1e-4, zo_eps=1e-2 as for LoRA, then tune them; docs/hyperparameters.md)."
        )
    return _PEFT_METHODS[peft_type]


def lora_target_names(model: nn.Module) -> frozenset[str]:
    """The names (without the layer path, e.g. ``"q_proj"``) of the modules that carry `model`'s LoRA layers."""
    from peft.tuners.lora import LoraLayer

    adapted = (name for name, module in model.named_modules() if isinstance(module, LoraLayer))
    return frozenset(name.rsplit(".", 1)[-1] for name in adapted)


def prompt_lora_target_modules(model: nn.Module) -> list[str] | None:
    """LoRA's `target_modules` for a prompt task on the causal LM `model`: :data:`PROMPT_LORA_TARGET_MODULES` when
    `model` has modules of those names (Llama, Mistral, Qwen, OPT, ...), else ``None`` (PEFT's choice for the
    architecture)."""
    names = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
    return list(PROMPT_LORA_TARGET_MODULES) if names.issuperset(PROMPT_LORA_TARGET_MODULES) else None


def prompt_lora_layers(model: nn.Module) -> list[int] | None:
    """LoRA's `layers_to_transform` for a prompt task on the causal LM `model`: its layers above the lowest
    :data:`PROMPT_LORA_LAYERS_LEFT_OUT` (10 to 29 of SmolLM2-135M's 30), or ``None`` (every layer) when its config
    gives no layer count."""
    config = getattr(model, "config", None)
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    layers = getattr(config, "num_hidden_layers", None)
    if not isinstance(layers, int) or layers < 2:
        return None
    return list(range(int(layers * PROMPT_LORA_LAYERS_LEFT_OUT), layers))


def trains_label_words(compute_loss_func) -> bool:
    """Whether `compute_loss_func` (a `Trainer`'s) is the label-word cross-entropy of a `PromptClassification`."""
    task = getattr(compute_loss_func, "__self__", None)
    return isinstance(task, PromptClassification) and task.loss == "classification"


def fill_method_defaults(args, model: nn.Module, compute_loss_func=None) -> None:
    """Set `args.learning_rate` and `args.zo_eps` that are ``None`` to the defaults of what `model` trains.

    The order: the optimizer's own measured defaults (:data:`OPTIMIZER_METHOD_DEFAULTS`), those for the label-word
    loss of prompt classification when `compute_loss_func` is it (:data:`LABEL_WORD_LORA_TARGET_DEFAULTS` for LoRA
    on the modules it names, else :data:`LABEL_WORD_METHOD_DEFAULTS`), those of the method. Values the user set are
    kept; the ones filled in are logged, and later logs, checkpoints and trajectories carry them like set values.
    """
    unset = [name for name in ("learning_rate", "zo_eps") if getattr(args, name) is None]
    if not unset:
        return
    method = trained_method(model)
    defaults = METHOD_DEFAULTS[method]
    if method in LABEL_WORD_METHOD_DEFAULTS and trains_label_words(compute_loss_func):
        defaults = LABEL_WORD_METHOD_DEFAULTS[method]
        if method == "lora":
            defaults = LABEL_WORD_LORA_TARGET_DEFAULTS.get(lora_target_names(model), defaults)
    optimizer = getattr(args, "zo_optimizer", None)
    if optimizer in OPTIMIZER_METHOD_DEFAULTS:
        measured = OPTIMIZER_METHOD_DEFAULTS[optimizer]
        if method not in measured:
            raise ValueError(
                f"zo_optimizer={optimizer!r} has no measured default learning_rate or zo_eps for method {method!r} "
                f"(only for {sorted(measured)}); set both (its step is about lr / eps * sqrt(trainable / N) long: "
                "docs/prompts.md)."
            )
        defaults = measured[method]
    for name in unset:
        setattr(args, name, getattr(defaults, name))
    chosen = ", ".join(f"{name}={getattr(defaults, name):g}" for name in unset)
    logger.info(f"ZOConfig: {chosen} for method {method!r} ({defaults.source}); set them to override.")


def defaults_table() -> str:
    """Every default of this module as a Markdown table: what trains, with which loss and optimizer, and the learning
    rate and eps `ZOConfig` fills in (docs/hyperparameters.md holds this table)."""
    rows = [("what trains", "loss", "optimizer", "learning_rate", "zo_eps", "source")]
    for method, d in METHOD_DEFAULTS.items():
        rows.append(
            (
                method,
                "any",
                "zo_sgd (and the other MeZO-scale ones)",
                f"{d.learning_rate:g}",
                f"{d.zo_eps:g}",
                d.source,
            )
        )
    for method, d in LABEL_WORD_METHOD_DEFAULTS.items():
        rows.append((method, "prompt label words", "zo_sgd", f"{d.learning_rate:g}", f"{d.zo_eps:g}", d.source))
    for targets, d in LABEL_WORD_LORA_TARGET_DEFAULTS.items():
        what = f"lora on {', '.join(sorted(targets))}"
        rows.append((what, "prompt label words", "zo_sgd", f"{d.learning_rate:g}", f"{d.zo_eps:g}", d.source))
    for optimizer, by_method in OPTIMIZER_METHOD_DEFAULTS.items():
        for method, d in by_method.items():
            rows.append((method, "any", optimizer, f"{d.learning_rate:g}", f"{d.zo_eps:g}", d.source))
    recipe = PROMPT_ZO_DEFAULTS
    rows.append(
        (
            "lora, `examples/train.py --recipe prompt`",
            "prompt label words",
            f"{recipe['zo_optimizer']} (N={recipe['zo_num_perturbations']}, {recipe['zo_noise']})",
            f"{recipe['learning_rate']:g}",
            f"{recipe['zo_eps']:g}",
            "PROMPT_ZO_DEFAULTS (docs/results/accuracy.md)",
        )
    )
    lines = ["| " + " | ".join(row) + " |" for row in rows]
    lines.insert(1, "| " + " | ".join("---" for _ in rows[0]) + " |")
    return "\n".join(lines) + "\n"


def log_zo_settings(args) -> None:
    """Log, when training starts, the estimator, learning rate and eps the run trains with (defaults filled in
    included), so that what ran is never a guess; `args.should_log` chooses the process (the main one)."""
    if not getattr(args, "should_log", True):
        return
    logger.warning(
        f"ZO training with zo_optimizer={args.zo_optimizer}, learning_rate={args.learning_rate:g}, "
        f"zo_eps={args.zo_eps:g}, zo_num_perturbations={args.zo_num_perturbations}, zo_noise={args.zo_noise} "
        "(defaults: docs/hyperparameters.md)"
    )
