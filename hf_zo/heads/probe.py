"""Linear probing (MeZO's LP-then-MeZO): a logistic regression on the frozen features a head receives.

Before ZO starts, the head's input features are collected over a random sample of the training set (one forward pass
per example, no gradients) and a logistic regression fitted on them is written into the head's last `nn.Linear`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

import torch
from torch import nn
from torch.utils.data import IterableDataset, Subset
from transformers.utils import logging

logger = logging.get_logger(__name__)

__all__ = [
    "PROBE_L2_GRID",
    "collect_head_inputs",
    "cross_validated_l2",
    "example_lengths",
    "fit_linear_probe",
    "fit_logistic_regression",
    "last_trainable_linear",
    "probe_examples",
]


def last_trainable_linear(head: nn.Module) -> nn.Linear:
    """The last `nn.Linear` with a trainable weight inside `head` (the head itself if it is one)."""
    linears = [m for m in head.modules() if isinstance(m, nn.Linear) and m.weight.requires_grad]
    if not linears:
        raise ValueError(f"The head {type(head).__name__} has no trainable nn.Linear to fit a linear probe into.")
    return linears[-1]


def example_lengths(dataset, length_column_name: str = "length", input_name: str = "input_ids") -> list[int] | None:
    """The length of every example of `dataset`, or `None` when it cannot be read.

    A `datasets.Dataset` gives its `length_column_name` column, or the lengths of its `input_name` column (one column
    read, not every row decoded). Another map-style data set gives the length of `input_name` in each example when
    its examples are mappings that hold it.

    Args:
        dataset: a map-style data set.
        length_column_name (`str`, defaults to `"length"`): a column of precomputed lengths
            (`TrainingArguments.length_column_name`).
        input_name (`str`, defaults to `"input_ids"`): the model input whose length counts.

    Returns:
        `list[int] | None`: one length per example, in the data set's order.
    """
    columns = getattr(dataset, "column_names", None)
    if columns is not None:
        if length_column_name in columns:
            return [int(length) for length in dataset[length_column_name]]
        if input_name in columns:
            return [len(ids) for ids in dataset[input_name]]
        return None
    if len(dataset) == 0 or not isinstance(dataset[0], Mapping) or input_name not in dataset[0]:
        return None
    return [len(dataset[index][input_name]) for index in range(len(dataset))]


@torch.no_grad()
def collect_head_inputs(
    model: nn.Module,
    linear: nn.Linear,
    batches: Iterable[Mapping],
    max_samples: int | None = None,
    gather: Callable[[tuple[torch.Tensor, torch.Tensor]], tuple[torch.Tensor, torch.Tensor]] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run `model` over `batches` (eval mode, no gradients) and collect the inputs of `linear` and the labels.

    Args:
        model (`nn.Module`): the model whose forward feeds `linear`.
        linear (`nn.Linear`): the layer whose inputs are collected.
        batches (`Iterable[Mapping]`): model inputs with `labels` (or `label`).
        max_samples (`int`, *optional*): stop after this many examples.
        gather (*optional*): in a multi-process run where each process holds a shard of `batches`, a function that
            gathers one batch's `(features, labels)` from every process (e.g. `Accelerator.gather_for_metrics`), so
            that every process collects the same examples in the same order as a single process would.

    Returns:
        `tuple[torch.Tensor, torch.Tensor]`: features `(n, in_features)` in fp32 on CPU and integer labels `(n,)`.
    """
    features, labels = [], []

    def hook(module, args):
        features.append(args[0].detach().float().cpu())

    was_training = model.training
    model.eval()
    handle = linear.register_forward_pre_hook(hook)
    try:
        count = 0
        for batch in batches:
            label = batch.get("labels", batch.get("label"))
            if label is None:
                raise ValueError(f"Linear probing needs labels; the batch has only {sorted(batch)}.")
            model(**{k: v for k, v in batch.items() if k not in ("labels", "label")})
            label = torch.as_tensor(label).view(-1)
            if gather is not None:
                batch_features, label = gather((features.pop().to(label.device), label))
                features.append(batch_features.cpu())
            labels.append(label.cpu())
            if features[-1].dim() != 2 or features[-1].shape[0] != labels[-1].numel():
                raise ValueError(
                    f"Linear probing needs one feature vector per label, got features {tuple(features[-1].shape)} "
                    f"for {labels[-1].numel()} labels in a batch; it supports sequence-level heads only (set "
                    "zo_head_init='none')."
                )
            count += labels[-1].numel()
            if max_samples is not None and count >= max_samples:
                break
    finally:
        handle.remove()
        model.train(was_training)
    x, y = torch.cat(features), torch.cat(labels).long()
    if max_samples is not None:
        x, y = x[:max_samples], y[:max_samples]
    return x, y


def fit_logistic_regression(
    features: torch.Tensor,
    labels: torch.Tensor,
    num_classes: int,
    l2: float = 1e-2,
    max_iter: int = 200,
    fit_intercept: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Multinomial logistic regression with an L2 penalty, fitted by L-BFGS on standardised features.

    Minimises ``mean CE(x W^T + b, y) + l2 / 2 * ||W_std||^2`` where ``W_std`` are the weights on standardised
    features, then folds the standardisation back into ``(W, b)``. Without an intercept (a head Linear without
    bias) the features are only scaled, not centred, and the bias returned is zero.

    A feature whose spread is below a thousandth of the median feature's is scaled as if it had that spread: a
    near-constant feature (one that a LayerNorm scale of about zero switches off) then gets no large weight, which
    would make the logits hypersensitive to the weights in front of it, and ZO perturbations of those weights with it.

    Returns:
        `tuple[torch.Tensor, torch.Tensor]`: weight `(num_classes, in_features)` and bias `(num_classes,)`, fp32.
    """
    if labels.min() < 0 or labels.max() >= num_classes:
        raise ValueError(f"Labels must be in [0, {num_classes}), got values in [{labels.min()}, {labels.max()}].")
    x = features.double()
    mean = x.mean(0) if fit_intercept else torch.zeros_like(x[0])
    spread = (x - mean).pow(2).mean(0).sqrt()
    std = spread.clamp_min(max(1e-3 * float(spread.median()), 1e-12))
    x = (x - mean) / std
    weight = torch.zeros(num_classes, x.shape[1], dtype=torch.float64, requires_grad=True)
    bias = torch.zeros(num_classes, dtype=torch.float64, requires_grad=fit_intercept)
    trained = [weight, bias] if fit_intercept else [weight]
    optimizer = torch.optim.LBFGS(trained, max_iter=max_iter, line_search_fn="strong_wolfe")

    def closure():
        optimizer.zero_grad()
        loss = nn.functional.cross_entropy(x @ weight.T + bias, labels) + 0.5 * l2 * weight.pow(2).sum()
        loss.backward()
        return loss

    with torch.enable_grad():
        optimizer.step(closure)
    weight, bias = weight.detach() / std, bias.detach() - (weight.detach() / std) @ mean
    return weight.float(), bias.float()


PROBE_L2_GRID = (1e-3, 1e-2, 3e-2, 1e-1, 3e-1, 1.0)
"""The L2 penalties (on standardised features) that :func:`cross_validated_l2` chooses from."""


def cross_validated_l2(
    features: torch.Tensor,
    labels: torch.Tensor,
    num_classes: int,
    grid: Iterable[float] = PROBE_L2_GRID,
    folds: int = 3,
    fit_intercept: bool = True,
) -> float:
    """The L2 penalty of `grid` whose logistic regression has the lowest mean cross-entropy on held-out folds.

    The best penalty depends on the number of examples: on 512 SST-2 phrases a penalty of 1e-2 fits the training set
    perfectly and nearly doubles the held-out loss (validation loss 0.95 against 0.50 at the chosen 0.3, and 2.4
    points of accuracy), while on 16,384 it is about right. The folds are a fixed permutation, so every process of a
    distributed run (all fitting on the same examples) picks the same penalty, and no random stream is consumed.

    Args:
        features (`torch.Tensor`): `(examples, in_features)`.
        labels (`torch.Tensor`): `(examples,)` class indices.
        num_classes (`int`): number of classes.
        grid (`Iterable[float]`, defaults to `PROBE_L2_GRID`): the candidate penalties.
        folds (`int`, defaults to 3): number of folds; with fewer than two examples per fold there is nothing to
            hold out, and 1e-2 is returned.
        fit_intercept (`bool`, defaults to `True`): as for :func:`fit_logistic_regression`.

    Returns:
        `float`: the chosen penalty.
    """
    grid = list(grid)
    if len(labels) < 2 * folds:
        return 1e-2
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(0))
    held_out = order.chunk(folds)
    losses = []
    for l2 in grid:
        loss = 0.0
        for k, test in enumerate(held_out):
            train = torch.cat([fold for j, fold in enumerate(held_out) if j != k])
            weight, bias = fit_logistic_regression(
                features[train], labels[train], num_classes, l2=l2, fit_intercept=fit_intercept
            )
            logits = features[test].float() @ weight.T + bias
            loss += float(nn.functional.cross_entropy(logits, labels[test], reduction="sum"))
        losses.append(loss)
    return grid[min(range(len(grid)), key=losses.__getitem__)]


def probe_examples(dataset, max_samples: int | None, seed: int):
    """The training examples the linear probe is fitted on: `max_samples` of them drawn at random, shortest first.

    A data set is often ordered (sorted by length for padding, grouped by label as IMDB's files are), so its first
    examples are not a sample of it: a probe fitted on them learns the wrong task or a single class. The draw is
    seeded by `seed`, so every process of a distributed run takes the same examples. A `datasets.Dataset` with an
    `input_ids` (or `length`) column is then ordered by length (ties in the set's order), so that the probe's
    batches carry little padding (docs/results/accuracy.md has what that saves). Other map-style sets keep their
    order among the drawn examples. A set no larger than `max_samples`, or `max_samples=None`, is used whole (ordered
    by length the same way), and a data set without a length (an `IterableDataset`) is used whole, in its own order.

    Args:
        dataset: the training set (`datasets.Dataset` or any map-style `torch.utils.data.Dataset`).
        max_samples (`int`, *optional*): how many examples to draw.
        seed (`int`): seed of the draw (the run's `args.seed`).

    Returns:
        the data set itself, or the drawn examples (`Dataset.select` or `torch.utils.data.Subset`).
    """
    if isinstance(dataset, IterableDataset) or not hasattr(dataset, "__len__"):
        return dataset
    indices = list(range(len(dataset)))
    if max_samples is not None and len(dataset) > max_samples:
        generator = torch.Generator().manual_seed(seed)
        indices = torch.randperm(len(dataset), generator=generator)[:max_samples].sort().values.tolist()
    lengths = example_lengths(dataset.select(indices)) if hasattr(dataset, "column_names") else None
    if lengths is not None:  # a tokenized datasets.Dataset: its lengths are one column read
        indices = [index for _, index in sorted(zip(lengths, indices), key=lambda pair: pair[0])]
    if indices == list(range(len(dataset))):
        return dataset
    if hasattr(dataset, "select"):  # datasets.Dataset: stays a Dataset, so the Trainer still drops unused columns
        return dataset.select(indices)
    return Subset(dataset, indices)


@torch.no_grad()
def fit_linear_probe(
    model: nn.Module,
    head: nn.Module,
    batches: Iterable[Mapping],
    max_samples: int | None = None,
    l2: float | None = None,
    gather=None,
) -> float:
    """Fit the last `nn.Linear` of `head` as a logistic regression on the frozen features it receives.

    Args:
        model (`nn.Module`): the model whose forward feeds `head`.
        head (`nn.Module`): the head module (e.g. `model.classifier`).
        batches (`Iterable[Mapping]`): model inputs with `labels` (or `label`), e.g. a training `DataLoader`.
        max_samples (`int`, *optional*): stop collecting features after this many examples.
        l2 (`float`, *optional*): L2 penalty on the weights (on standardised features); by default the one of
            `PROBE_L2_GRID` that :func:`cross_validated_l2` chooses on the collected examples.
        gather (*optional*): gathers each batch's features and labels from every process (see
            :func:`collect_head_inputs`): every process then fits the same head on the same examples.

    Returns:
        `float`: the probe's accuracy on the examples it was fitted on.
    """
    linear = last_trainable_linear(head)
    features, labels = collect_head_inputs(model, linear, batches, max_samples, gather)
    has_bias = linear.bias is not None
    if l2 is None:
        l2 = cross_validated_l2(features, labels, linear.out_features, fit_intercept=has_bias)
        logger.info("Linear probe: L2 penalty %g chosen by cross-validation on %d examples.", l2, len(labels))
    weight, bias = fit_logistic_regression(features, labels, linear.out_features, l2=l2, fit_intercept=has_bias)
    linear.weight.copy_(weight.to(linear.weight))
    if has_bias:
        linear.bias.copy_(bias.to(linear.bias))
    logits = features @ weight.T + bias
    return float((logits.argmax(-1) == labels).float().mean())
