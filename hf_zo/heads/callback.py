"""The head options of a `ZOTrainer` run (`ZOConfig.zo_head_*`): which modules are the head, and how they start
and train (:func:`prepare_zo_heads`, applied as the :class:`ZOHeads` callback)."""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch import nn
from tqdm.auto import tqdm
from transformers import TrainerCallback
from transformers.trainer_utils import get_last_checkpoint
from transformers.utils import logging

from ..models.pooled_classifier import pooling_mismatch
from ..parallel.mesh import ZOMesh
from .first_order import FirstOrderHead, schedule_scale
from .probe import fit_linear_probe, probe_examples

logger = logging.get_logger(__name__)

__all__ = [
    "HEAD_OPTIMIZER_NAME",
    "ZOHeads",
    "find_head_modules",
    "first_order_parameter_names",
    "head_parameter_names",
    "is_sequence_classifier",
    "prepare_zo_heads",
    "resolve_head_options",
]

HEAD_OPTIMIZER_NAME = "zo_head_optimizer.pt"
"""The file of a checkpoint holding the AdamW state of a head trained first-order (`zo_head_training`)."""

# What "auto" means for a sequence classifier; other models keep their head as it is.
AUTO_HEAD_INIT = "linear_probe"
AUTO_HEAD_TRAINING = "first_order"


def is_sequence_classifier(model: nn.Module) -> bool:
    """Whether `model` (possibly PEFT-wrapped) is a `*ForSequenceClassification` model with a categorical head."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    config = getattr(base, "config", None)
    return (
        type(base).__name__.endswith("ForSequenceClassification")
        and getattr(config, "num_labels", 0) > 1
        and getattr(config, "problem_type", None) in (None, "single_label_classification")
    )


def resolve_head_options(model: nn.Module, head_init: str, head_training: str) -> tuple[str, str]:
    """Turn `"auto"` into the choice for `model`: linear probe and first-order head for a sequence classifier.

    Returns:
        `tuple[str, str]`: the effective `(head_init, head_training)`.
    """
    classifier = is_sequence_classifier(model)
    if head_init == "auto":
        head_init = AUTO_HEAD_INIT if classifier else "none"
    if head_training == "auto":
        head_training = AUTO_HEAD_TRAINING if classifier else "zeroth_order"
    return head_init, head_training


def find_head_modules(model: nn.Module, names: Iterable[str] | None = None) -> dict[str, nn.Module]:
    """The head modules of `model`, by qualified name.

    Args:
        model (`nn.Module`): the model, possibly PEFT-wrapped (a head in `modules_to_save` is found through its
            wrapper).
        names (`Iterable[str]`, *optional*): module names, matched against the end of each qualified module name
            (`"classifier"` matches `base_model.model.classifier`). Without names, the head is the last `nn.Linear`
            with trainable weights and `out_features == config.num_labels` (BERT's `classifier`, RoBERTa's
            `classifier.out_proj`).

    Returns:
        `dict[str, nn.Module]`: the outermost matching modules, in model order (the last one produces the logits).
    """
    modules = dict(model.named_modules())
    if names:
        matches = set()
        for wanted in names:
            named = [n for n in modules if n == wanted or n.endswith("." + wanted)]
            if not named:
                raise ValueError(f"zo_head_modules names {wanted!r}, but no module of {type(model).__name__} has it.")
            matches.update(named)
        outermost = [n for n in modules if n in matches and not any(n.startswith(m + ".") for m in matches)]
        return {n: modules[n] for n in outermost}
    num_labels = getattr(getattr(model, "config", None), "num_labels", None)
    linears = [
        name
        for name, module in modules.items()
        if isinstance(module, nn.Linear) and module.out_features == num_labels and module.weight.requires_grad
    ]
    if not linears:
        raise ValueError(
            f"Could not find the classification head of {type(model).__name__}: no trainable nn.Linear with "
            f"out_features == num_labels ({num_labels}). Name it with zo_head_modules (e.g. ['classifier'])."
        )
    return {linears[-1]: modules[linears[-1]]}


def head_parameter_names(model: nn.Module, heads: Mapping[str, nn.Module]) -> list[str]:
    """Qualified names of the trainable parameters inside `heads`, in `model.named_parameters()` order."""
    prefixes = tuple(name + "." for name in heads)
    return [name for name, p in model.named_parameters() if p.requires_grad and name.startswith(prefixes)]


def first_order_parameter_names(model: nn.Module, args) -> set[str]:
    """Names of the parameters of `model` that `args.zo_head_training` trains first-order, which the ZO optimizer
    leaves out (empty when the head trains zeroth-order)."""
    _, head_training = resolve_head_options(model, args.zo_head_init, args.zo_head_training)
    if head_training != "first_order":
        return set()
    return set(head_parameter_names(model, find_head_modules(model, args.zo_head_modules)))


class ZOHeads(TrainerCallback):
    """The head options of one `ZOTrainer.train()` call; built by :func:`prepare_zo_heads`.

    Attributes:
        names (`list[str]`): qualified names of the head modules (empty if no head option is active).
        zo_excluded (`set[str]`): parameter names that the ZO optimizer must leave alone (the first-order head).
        first_order (`FirstOrderHead` or `None`): the first-order trainer of the heads, if any.
    """

    def __init__(self, names: list[str] | None = None, zo_excluded=(), first_order: FirstOrderHead | None = None):
        self.names = list(names or [])
        self.zo_excluded = set(zo_excluded)
        self.first_order = first_order

    def capture(self):
        """Context manager around one ZO forward + loss (see :meth:`FirstOrderHead.capture`)."""
        return self.first_order.capture() if self.first_order is not None else contextlib.nullcontext()

    def backward(self, loss):
        """Accumulate the first-order head's gradients of `loss`; returns `loss` detached."""
        return self.first_order.backward(loss) if self.first_order is not None else loss

    def end_micro_batch(self) -> None:
        """Mark the end of a micro-batch's forward passes (see :meth:`FirstOrderHead.end_micro_batch`)."""
        if self.first_order is not None:
            self.first_order.end_micro_batch()

    def on_optimizer_step(self, args, state, control, lr_scheduler=None, optimizer=None, **kwargs):
        if self.first_order is not None:
            self.first_order.step(schedule_scale(lr_scheduler, optimizer, args.learning_rate))

    def on_epoch_end(self, args, state, control, **kwargs):
        # Gradients left at an epoch's end come from a stop between two optimizer steps: dropped, as the ZO
        # optimizer drops that partial step's records (`ZOFlushCallback`).
        if self.first_order is not None:
            self.first_order.discard_step()

    def save_checkpoint(self, checkpoint: str) -> None:
        """Write the first-order head's AdamW state into the checkpoint folder `checkpoint` (nothing if no head trains
        first-order).

        `ZOTrainer` calls it on the folder it stages the checkpoint in, with the ZO optimizer's state, so that the
        checkpoint is published (and pushed to the Hub) with it, never without.
        """
        if self.first_order is None:
            return
        os.makedirs(checkpoint, exist_ok=True)
        torch.save(self.first_order.optimizer.state_dict(), os.path.join(checkpoint, HEAD_OPTIMIZER_NAME))

    def load_checkpoint(self, checkpoint: str) -> None:
        """Restore the first-order head's AdamW state saved in `checkpoint`.

        Raises:
            `ValueError`: when the head is trained first-order but `checkpoint` has no such state (resuming without it
            would restart the head's AdamW moments, so the run would not continue as it was).
        """
        if self.first_order is None:
            return
        path = os.path.join(checkpoint, HEAD_OPTIMIZER_NAME)
        if not os.path.isfile(path):
            raise ValueError(
                f"Checkpoint {checkpoint} has no {HEAD_OPTIMIZER_NAME}, the AdamW state of the head that "
                "zo_head_training='first_order' trains: it was removed, or the checkpoint comes from a run that "
                "trained its head otherwise. Resume from a complete checkpoint with the run's zo_head_* options, or "
                "train into a new output_dir."
            )
        self.first_order.optimizer.load_state_dict(torch.load(path, weights_only=True))

    def close(self) -> None:
        """Detach from the model (hooks removed)."""
        if self.first_order is not None:
            self.first_order.close()


def _check_probe_fits(model: nn.Module) -> None:
    """Fail when the model's head is not a softmax over classes: the probe fits a multinomial logistic regression,
    so regression targets would be truncated to integers and multi-hot labels read as class indices."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    config = getattr(base, "config", None)
    problem_type = getattr(config, "problem_type", None)
    if problem_type in ("regression", "multi_label_classification") or getattr(config, "num_labels", 2) == 1:
        kind = problem_type or "regression (num_labels=1)"
        raise ValueError(
            f"zo_head_init='linear_probe' fits a single-label classifier's head (a softmax over num_labels >= 2 "
            f"classes), but this model's problem_type is {kind}. Set zo_head_init='none' (or 'auto', which "
            "leaves such heads as they are)."
        )


def prepare_zo_heads(
    model: nn.Module,
    args,
    mesh: ZOMesh,
    *,
    train_dataset=None,
    probe_dataloader: Callable[[Any], Iterable] | None = None,
    gather: Callable | None = None,
    show_progress: bool = True,
    resume_from_checkpoint: str | bool | None = None,
    fit_probe: bool = True,
) -> ZOHeads:
    """Apply `args.zo_head_*` to `model` at the start of training.

    Fits the linear probe (unless resuming, as the checkpoint holds the head, or `fit_probe` is `False`, as for a
    head an earlier `train()` call fitted and trained) and sets up the first-order head, whose parameters
    `ZOTrainer.create_optimizer` then leaves out of the ZO parameter set.

    Args:
        model (`nn.Module`): the model about to train.
        args (`ZOConfig`): the run's arguments (`zo_head_*`, `seed`, `weight_decay`, `output_dir`, batch sizes).
        mesh (`ZOMesh`): the run's layout, over which the first-order head sums its gradients.
        train_dataset (*optional*): the examples the probe is fitted on.
        probe_dataloader (`Callable`, *optional*): turns the probe's examples into batches, sharded over the
            processes like evaluation (`Trainer.get_test_dataloader`); needed to fit the probe.
        gather (`Callable`, *optional*): gathers a tensor from every process (`Accelerator.gather_for_metrics`);
            `None` in a single process.
        show_progress (`bool`): show the probe's progress bar (the local main process, unless `disable_tqdm`).
        resume_from_checkpoint (`str` or `bool`, *optional*): as for `Trainer.train`; the first-order head's state is
            loaded from that checkpoint.
        fit_probe (`bool`): fit the linear probe if `zo_head_init` asks for it.

    Returns:
        `ZOHeads`: to register as a callback of the trainer.
    """
    head_init, head_training = resolve_head_options(model, args.zo_head_init, args.zo_head_training)
    if head_init == "none" and head_training == "zeroth_order":
        return ZOHeads()
    heads = find_head_modules(model, args.zo_head_modules)
    if (mismatch := pooling_mismatch(model)) is not None:
        logger.warning(mismatch)
    if head_init == "linear_probe" and fit_probe and not resume_from_checkpoint:
        _check_probe_fits(model)
        if train_dataset is None:
            raise ValueError("zo_head_init='linear_probe' needs a train_dataset to fit the head on.")
        name, head = list(heads.items())[-1]  # the module that produces the logits
        max_samples = args.zo_head_init_max_samples
        examples = probe_examples(train_dataset, max_samples, args.seed)
        batches = probe_dataloader(examples)
        total = None
        with contextlib.suppress(TypeError):  # a DataLoader over an IterableDataset has no length
            total = len(batches)
        if max_samples is not None:
            needed = math.ceil(max_samples / (args.eval_batch_size * args.world_size))
            total = needed if total is None else min(total, needed)
        # One forward per example: on long inputs the probe takes minutes, so it shows progress like evaluation does.
        with tqdm(
            batches,
            total=total,
            desc="Linear probe",
            leave=False,
            disable=not show_progress,
        ) as progress:
            accuracy = fit_linear_probe(
                model, head, progress, max_samples=max_samples, l2=args.zo_head_init_l2, gather=gather
            )
        logger.info("Linear probe fitted into %s (training accuracy %.4f).", name, accuracy)
    if head_training != "first_order":
        return ZOHeads(list(heads))
    names = head_parameter_names(model, heads)
    named = dict(model.named_parameters())
    first_order = FirstOrderHead(
        heads,
        [named[n] for n in names],
        lr=args.zo_head_learning_rate,
        weight_decay=args.weight_decay,
        mesh=mesh,
    )
    zo_heads = ZOHeads(list(heads), names, first_order)
    if resume_from_checkpoint:
        checkpoint = resume_from_checkpoint
        if checkpoint is True:
            checkpoint = get_last_checkpoint(args.output_dir)
        if checkpoint:
            zo_heads.load_checkpoint(checkpoint)
    return zo_heads
