"""What `ZOTrainer` does with the arguments it is given before `Trainer` sees them (:func:`prepare_zo_args`): a
plain `TrainingArguments` becomes a `ZOConfig` (:func:`to_zo_config`), hf_zo's loggers take the process's log level
(:func:`follow_process_log_level`), and the learning rate and eps left unset are chosen by what the model trains."""

from __future__ import annotations

import copy
import dataclasses
import logging as std_logging

import torch
from transformers import TrainingArguments
from transformers.utils import logging

from .config import ZOConfig

logger = logging.get_logger(__name__)

__all__ = ["follow_process_log_level", "prepare_zo_args", "to_zo_config"]

_WARNED_DEFAULTS = ("learning_rate", "lr_scheduler_type", "max_grad_norm", "train_sampling_strategy")


def to_zo_config(args: TrainingArguments, config_class: type[ZOConfig] = ZOConfig) -> ZOConfig:
    """`args` as a `config_class` (a `ZOConfig`), keeping every value; warns about the ones left at
    `TrainingArguments`' defaults for first-order training where `ZOConfig`'s differ (a set value cannot be told from
    a default, so both are kept)."""
    init_fields = {f.name for f in dataclasses.fields(config_class) if f.init}
    values = {k: v for k, v in args.to_dict().items() if k in init_fields}
    values["hub_token"] = args.hub_token
    first_order_defaults = {f.name: f.default for f in dataclasses.fields(TrainingArguments) if f.init}
    zo_defaults = {f.name: f.default for f in dataclasses.fields(config_class) if f.init}
    kept = [
        f"{name}={values[name]!r} (ZOConfig's default: {zo_defaults[name] or 'chosen by what the model trains'!r})"
        for name in _WARNED_DEFAULTS
        if name in values
        and values[name] == first_order_defaults.get(name)
        and first_order_defaults.get(name) != zo_defaults.get(name)
    ]
    if kept:
        logger.warning(
            "ZOTrainer was given a TrainingArguments and keeps its values, among them %s, which are "
            "TrainingArguments' defaults for first-order training (a learning rate of 5e-5 diverges for all weights "
            "under ZO). Pass a ZOConfig to get the ZO defaults, or set these values explicitly.",
            ", ".join(kept),
        )
    return config_class(**values)


def follow_process_log_level(args: TrainingArguments) -> None:
    """Give hf_zo's loggers the level `Trainer` gives transformers' (`log_level` on the main process,
    `log_level_replica` on the others; transformers' verbosity when `"passive"`), and print their records to stderr
    when the application has configured no logging, as transformers' own handler does. A `"passive"` level leaves
    an application's own logging configuration (`logging.basicConfig`) in charge."""
    library, configured = std_logging.getLogger("hf_zo"), bool(std_logging.getLogger().handlers)
    if (args.log_level if args.should_log else args.log_level_replica) != "passive" or not configured:
        library.setLevel(args.get_process_log_level())
    if not library.handlers and not configured:
        library.addHandler(std_logging.StreamHandler())
        library.propagate = False


def prepare_zo_args(
    args: TrainingArguments | None,
    model: torch.nn.Module | str | None,
    config_class: type[ZOConfig] = ZOConfig,
) -> ZOConfig:
    """The `config_class` a trainer of `model` runs with, given the `args` it was passed.

    `None` becomes the defaults with `output_dir` named after the model (an instance or a name to load), a plain
    `TrainingArguments` is converted (:func:`to_zo_config`), and hf_zo's loggers follow its log level. The learning
    rate and `zo_eps` left unset are filled in a copy, so the caller's `args` stay unset: by what the model trains,
    once the trainer's model is final (`ZOTrainerMixin.create_accelerator_and_postprocess`), or in `create_optimizer`.
    """
    if args is None:
        named = model if isinstance(model, str) else getattr(getattr(model, "config", None), "_name_or_path", None)
        model_name = named or "model"
        args = config_class(output_dir=f"{model_name.split('/')[-1]}-ZO")
    elif not isinstance(args, config_class):
        args = to_zo_config(args, config_class)
    follow_process_log_level(args)
    if args.learning_rate is None or args.zo_eps is None:
        args = copy.copy(args)  # filled in by what the model trains, later; the caller's stay unset
    return args
