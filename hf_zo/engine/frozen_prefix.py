"""Run the frozen blocks before the first perturbed one once per micro-batch, not once per forward.

A ZO estimate runs the same batch two or more times (``theta + eps z`` and ``theta - eps z``; FZOO's centre and its
N one-sided points), and a step's pending update only moves the perturbed tensors. The repeated blocks of the model
(:func:`~hf_zo.engine.find_blocks`) that come before the first block holding a perturbed tensor therefore compute
the same outputs in every one of those forwards: with LoRA on the upper two thirds of an LLM's layers, a third of
each forward after the first is work already done. :class:`FrozenPrefix` keeps each such block's inputs and output
from the first forward of a micro-batch and, in the next forwards, hands the output back without running the block
when the block is called with the same inputs (the same tensor objects, or tensors equal to them).

The reuse is exact: a block's output is a function of its inputs and its frozen weights, and it is reused only for
inputs found equal, so losses and updates are bitwise those of running every block. It applies when every perturbed
tensor sits inside the blocks (a tensor outside them, such as a trainable embedding or prompt encoder, could act
before the first block) and only to the sequential engine (the dual engine runs both passes in one sweep already).
A block handed a KV cache writes into it, so it always runs; the model's `config.use_cache` is therefore off while
the forwards share the prefix (a training loss never reads the cache). Memory: one hidden state per frozen block and
micro-batch, released when the micro-batch's estimates end.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from .blocks import BlocksNotFoundError, find_blocks

__all__ = ["FrozenPrefix", "frozen_prefix_blocks"]

_PLAIN_LEAVES = (type(None), bool, int, float, str, torch.dtype, torch.device)


def frozen_prefix_blocks(model: nn.Module, perturbed: Iterable[torch.Tensor]) -> list[nn.Module]:
    """The blocks of `model` that every ZO forward of a micro-batch computes alike: those of the block list holding
    the first perturbed block, before it.

    Empty when the model has no repeated blocks, when a perturbed tensor lies outside them, or when the first block
    holds one.
    """
    perturbed_ids = {id(tensor) for tensor in perturbed}
    try:
        blocks = find_blocks(model)
    except BlocksNotFoundError:
        return []
    holds_perturbed = [any(id(p) in perturbed_ids for p in block.parameters()) for block in blocks]
    in_blocks = {id(p) for block in blocks for p in block.parameters()}
    if not any(holds_perturbed) or not perturbed_ids <= in_blocks:
        return []
    first = holds_perturbed.index(True)
    owner = next(m for m in model.modules() if isinstance(m, nn.ModuleList) and _contains(m, blocks[first]))
    members = {id(module) for module in owner}
    return [block for block in blocks[:first] if id(block) in members]


def _contains(module_list: nn.ModuleList, block: nn.Module) -> bool:
    return any(child is block for child in module_list)


class _Entry:
    """A block's inputs (flattened) and output in the first forward of a micro-batch."""

    def __init__(self, leaves: list, spec, output):
        self.leaves, self.spec, self.output = leaves, spec, output


class FrozenPrefix:
    """Reuses the outputs of the frozen blocks before the first perturbed block across the forwards of a
    micro-batch (see the module docstring).

    Args:
        model (`nn.Module`): the model ZO trains (a PEFT model is looked through).
        perturbed (`Iterable[torch.Tensor]`): the tensors the ZO optimizer perturbs.

    Example:

    ```python
    prefix = FrozenPrefix(model, [p for p in model.parameters() if p.requires_grad])
    with prefix.shared():  # the forwards of one micro-batch
        records = optimizer.estimate(closure)
    ```
    """

    def __init__(self, model: nn.Module, perturbed: Iterable[torch.Tensor]):
        self.blocks = frozen_prefix_blocks(model, perturbed)
        configs = {id(m.config): m.config for m in model.modules() if getattr(m, "config", None) is not None}
        self._configs = [config for config in configs.values() if getattr(config, "use_cache", False) is True]
        self._entries: dict[int, _Entry] = {}
        self.reused = 0  # block calls answered from a previous forward, over this object's life

    def __bool__(self) -> bool:
        return bool(self.blocks)

    @contextmanager
    def shared(self) -> Iterator[None]:
        """Within the context (the forwards of one micro-batch) a frozen prefix block called with the inputs of its
        first call returns that call's output, and the model builds no KV cache; on leaving, the kept outputs are
        released and `config.use_cache` restored."""
        if not self.blocks:
            yield
            return
        for config in self._configs:
            config.use_cache = False
        originals = []
        for index, block in enumerate(self.blocks):
            originals.append((block, block.__dict__.get("forward")))
            block.forward = self._reusing(index, block.forward)
        try:
            yield
        finally:
            for block, original in originals:
                if original is None:
                    del block.forward
                else:
                    block.forward = original
            for config in self._configs:
                config.use_cache = True
            self._entries.clear()

    def _reusing(self, index: int, forward):
        def reusing_forward(*args, **kwargs):
            leaves, spec = tree_flatten((args, kwargs))
            if not all(isinstance(leaf, (torch.Tensor, *_PLAIN_LEAVES)) for leaf in leaves):
                return forward(*args, **kwargs)  # a cache or another object the block may change: always run
            entry = self._entries.get(index)
            if entry is not None and entry.spec == spec and all(map(_same, entry.leaves, leaves)):
                self.reused += 1
                return entry.output
            output = forward(*args, **kwargs)
            self._entries[index] = _Entry(leaves, spec, output)
            return output

        return reusing_forward


def _same(kept, given) -> bool:
    """Whether an input of the first forward and one of a later forward are the same value."""
    if isinstance(kept, torch.Tensor):
        if kept is given:
            return True
        return (
            isinstance(given, torch.Tensor)
            and kept.shape == given.shape
            and kept.dtype == given.dtype
            and kept.device == given.device
            and torch.equal(kept, given)
        )
    return type(kept) is type(given) and kept == given
