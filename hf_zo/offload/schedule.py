"""The offload schedule over blocks, shared by every transport.

`BlockOffloader` keeps the parameters of each block in a storage tier and brings a block to the working device
only while it computes: ``acquire(i)`` waits for block ``i`` (and starts prefetching the next ones), ``release(i)``
writes back the tensors that changed and returns the block to storage. The dual engine drives ``acquire`` and
``release`` itself during a ZO estimate (each block is visited once by both perturbed passes); any other forward
(evaluation, prediction, generation) goes through forward hooks that do the same without write-back.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn
from transformers.utils import logging

from ..heap import return_freed_memory
from ..pages import MappedPages
from .storage import BlockStorage, build_storage
from .transport import CudaTransport, ThreadTransport

logger = logging.get_logger(__name__)


class BlockOffloader:
    """Blocks streamed between a storage tier and the working device, with prefetch and write-back.

    Construction moves every parameter of `blocks` into `storage` and points the parameters at their at-rest views
    (freeing the original memory); the blocks then ignore `.to(device)` for their parameters, whose placement the
    offloader owns, and refuse a conversion that would change their dtype (`.to(torch.bfloat16)`, `.half()`) with a
    `RuntimeError`. Everything else in the model stays where it is (the resident modules).

    Args:
        blocks (`Sequence[nn.Module]`): the blocks, in execution order (see `hf_zo.engine.find_blocks`).
        storage (`BlockStorage`): the storage tier.
        device (`torch.device` or `str`, *optional*): the working device; defaults to CUDA when available.
        prefetch (`int`, defaults to 1): blocks loaded ahead of the one computing (0: load on demand).
        offload_dtype (`torch.dtype`, *optional*):
            Storage and transfer dtype of the *frozen* floating-point tensors (e.g. PEFT base weights), upcast to the
            parameter's dtype on arrival. Trainable tensors always keep their own dtype (full-precision masters),
            so updates are exact.
        transport (*optional*):
            How blocks move (an object with the interface of `ThreadTransport`); defaults to `CudaTransport` for a
            GPU working device and `ThreadTransport` for the CPU. `hf_zo.parallel.SlicedTransport` shares each
            upload among the ranks of a perturbation-parallel group.

    Attributes:
        params (`list[list[nn.Parameter]]`): each block's parameters, in storage order.
        views (`list[list[torch.Tensor]]`): their at-rest views in storage.
        managed (`bool`): set by the dual engine while it drives `acquire`/`release`; the hooks then stand aside.
    """

    def __init__(
        self,
        blocks: Sequence[nn.Module],
        storage: BlockStorage,
        device: torch.device | str | None = None,
        prefetch: int = 1,
        offload_dtype: torch.dtype | None = None,
        transport=None,
    ):
        if not isinstance(prefetch, int) or prefetch < 0:
            raise ValueError(f"prefetch must be an integer >= 0, got {prefetch!r}.")
        self.blocks = list(blocks)
        self.storage = storage
        self.device = torch.device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
        self.prefetch = prefetch
        if transport is None:
            transport = CudaTransport(self.device) if self.device.type == "cuda" else ThreadTransport()
        self.transport = transport
        self.params: list[list[nn.Parameter]] = []
        self.views: list[list[torch.Tensor]] = []
        self._dtypes: list[list[torch.dtype]] = []
        self._in_flight: dict[int, object] = {}
        self._resident: dict[int, list[torch.Tensor]] = {}
        self.managed = False
        # A model `from_pretrained` mapped from its files: the pages each block is copied from are handed back as
        # the block goes to storage, so that the set-up never holds the model (see `pages`).
        source_pages = MappedPages(private=True)
        for b, block in enumerate(self.blocks):
            self._offload_block(b, block, offload_dtype, source_pages)
        return_freed_memory()
        self._hooks = [h for b, block in enumerate(self.blocks) for h in self._hook_block(b, block)]

    # ------------------------------------------------------------------ set-up

    def _offload_block(
        self, b: int, block: nn.Module, offload_dtype: torch.dtype | None, source_pages: MappedPages
    ) -> None:
        named = list(block.named_parameters())
        store_dtypes = [
            offload_dtype if offload_dtype is not None and not p.requires_grad and p.is_floating_point() else p.dtype
            for _, p in named
        ]
        with torch.no_grad():
            views = self.storage.store_block(b, [(n, p.detach().to(d)) for (n, p), d in zip(named, store_dtypes)])
        params = [p for _, p in named]
        self._dtypes.append([p.dtype for p in params])
        for param, view in zip(params, views):
            source_pages.release(param.data)
            param.data = view
        self.params.append(params)
        self.views.append(views)
        for buffer_owner in block.modules():
            for name, buffer in buffer_owner.named_buffers(recurse=False):
                if buffer is not None:
                    buffer_owner._buffers[name] = buffer.to(self.device)
        block._apply = _buffers_only_apply(block, self._dtypes[b])

    def _hook_block(self, b: int, block: nn.Module) -> list:
        def pre_hook(module, args):
            if not self.managed:
                self.acquire(b)

        def post_hook(module, args, output):
            if not self.managed:
                self.release(b, write_back=())

        return [block.register_forward_pre_hook(pre_hook), block.register_forward_hook(post_hook)]

    # ------------------------------------------------------------------ schedule

    def prefetch_from(self, b: int) -> None:
        """Start loading blocks ``b .. b + prefetch - 1`` that are neither resident nor in flight."""
        for nxt in range(b, min(b + self.prefetch, len(self.blocks))):
            if nxt not in self._in_flight and nxt not in self._resident:
                self._in_flight[nxt] = self.transport.load(self.views[nxt], self._dtypes[nxt])

    def acquire(self, b: int) -> None:
        """Make block `b` resident on the working device (waiting for its load) and prefetch the next blocks."""
        if b in self._resident:
            return
        handle = self._in_flight.pop(b, None)
        if handle is None:
            handle = self.transport.load(self.views[b], self._dtypes[b])
        self.prefetch_from(b + 1)
        working = self.transport.wait(handle)
        for param, tensor in zip(self.params[b], working):
            param.data = tensor
        self._resident[b] = working

    def release(self, b: int, write_back: Sequence[int]) -> None:
        """Write back the tensors at positions `write_back` of block `b` and return the block to storage."""
        working = self._resident.pop(b, None)
        if working is None:
            return
        views = self.views[b]
        self.transport.unload(
            working, [(views[k], working[k]) for k in write_back], then=lambda: self.storage.release_pages(views)
        )
        for param, view in zip(self.params[b], views):
            param.data = view

    def synchronize(self) -> None:
        """Wait for every queued copy, dropping prefetched blocks, so the at-rest views hold the true values."""
        for b in list(self._resident):
            self.release(b, write_back=())
        for b, handle in self._in_flight.items():
            self.transport.wait(handle)
            self.storage.release_pages(self.views[b])
        self._in_flight.clear()
        self.transport.synchronize()

    def saving_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """`model.state_dict()` with each offloaded tensor replaced by a view that its storage made for saving.

        Hand it to `save_pretrained` (which drops each tensor once its shard is written) and keep no reference: the
        storage's pages then leave memory shard by shard, and a save holds a shard of the model, not all of it.
        """
        self.synchronize()
        at_rest = {}
        for b, views in enumerate(self.views):
            for k, view in enumerate(views):
                at_rest[view.data_ptr()] = (b, k)
        fresh: dict[int, list[torch.Tensor]] = {}
        state_dict = model.state_dict()
        for name, tensor in state_dict.items():
            where = at_rest.get(tensor.data_ptr())
            if where is None or tensor.numel() == 0:
                continue
            b, k = where
            if b not in fresh:
                fresh[b] = self.storage.saving_views(b)
            state_dict[name] = fresh[b][k]
        return state_dict

    @property
    def largest_block_bytes(self) -> int:
        """Bytes of the largest block in its working dtypes."""
        return max(
            (
                sum(v.numel() * d.itemsize for v, d in zip(views, dtypes))
                for views, dtypes in zip(self.views, self._dtypes)
            ),
            default=0,
        )

    @property
    def busy_blocks(self) -> list[int]:
        """Blocks on the working device or being loaded (empty between forwards)."""
        return sorted(set(self._resident) | set(self._in_flight))

    def close(self) -> None:
        """Remove the hooks and release the storage; the model's offloaded parameters are unusable afterwards."""
        self.synchronize()
        for hook in self._hooks:
            hook.remove()
        self.transport.close()
        self.storage.close()


def offload_blocks(
    blocks: Sequence[nn.Module],
    tier: str,
    directory: str | None = None,
    device: torch.device | str | None = None,
    prefetch: int = 1,
    offload_dtype: torch.dtype | str | None = None,
    transport=None,
) -> BlockOffloader:
    """Offload `blocks` to storage tier `tier` (`"cpu"` or `"disk"`); see `BlockOffloader` for the arguments."""
    if isinstance(offload_dtype, str):
        offload_dtype = getattr(torch, offload_dtype)
    return BlockOffloader(blocks, build_storage(tier, directory), device, prefetch, offload_dtype, transport)


def _buffers_only_apply(block: nn.Module, dtypes: Sequence[torch.dtype]):
    """An `_apply` for `block` that converts its buffers but leaves its (offloaded) parameters alone.

    A conversion that would change the dtype of those parameters (``model.to(torch.bfloat16)``, ``.half()``) is
    refused with a `RuntimeError`: the parameters would keep their dtype in storage while everything else changed,
    and the forward would then fail on mixed dtypes. `dtypes` are the dtypes the parameters compute in.
    """

    def _apply(fn, recurse=True):
        # The probes are empty tensors, so this costs nothing even for a conversion that moves them to a GPU.
        for dtype in dict.fromkeys(dtypes):
            converted = fn(torch.empty(0, dtype=dtype)).dtype
            if converted != dtype:
                raise RuntimeError(_dtype_change_message(type(block).__name__, dtype, converted))
        for module in block.modules():
            for name, buffer in module.named_buffers(recurse=False):
                if buffer is not None:
                    module._buffers[name] = fn(buffer)
        return block

    return _apply


def _dtype_change_message(block: str, dtype: torch.dtype, converted: torch.dtype) -> str:
    return (
        f"Cannot convert a model with offloaded blocks from {dtype} to {converted}: the parameters of its {block} "
        f"blocks live in zo_offload storage as {dtype} and are not converted there, so converting only the other "
        "modules would make the forward fail on mixed dtypes. Trainer.evaluate/predict make this conversion with "
        "bf16_full_eval=True or fp16_full_eval=True: drop the flag (bf16=True evaluates under bf16 autocast "
        "instead), load the model in the dtype you want (torch_dtype=...) before it is offloaded, or set "
        "zo_offload=None. Modules visited before the first block may already have been converted: reload the model "
        "before using it further."
    )
