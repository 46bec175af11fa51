"""Two forward passes run in lockstep, one block at a time.

The dual engine needs both perturbed forwards to go through block ``i`` while that block is resident and perturbed
for them, and it must not re-implement any model's forward. Each pass therefore runs the unchanged loss closure in
its own thread; a forward pre-hook on every block stops the pass at the block's entrance (a *checkpoint*) and hands
control back to a coordinator, which prepares the block for the next pass and resumes it. Exactly one thread runs
at any time, so the passes see the same shapes and kernels as the sequential engine (bitwise-equal fp32 losses) and
no state is touched concurrently.

PyTorch keeps some of its state per thread. What the caller has set of it is carried into the pass threads, so that
each pass runs its forward as the sequential engine would in the caller's thread: grad mode, inference mode,
autocast (enabled device types, their dtypes, and whether the cast weights are cached), the default device
(`torch.set_default_device`, ``with torch.device(...)``), context variables, and the CUDA device and stream.
Other per-thread state (a `TorchFunctionMode` or `TorchDispatchMode` the caller entered, saved-tensor hooks) is
not carried.
"""

from __future__ import annotations

import contextlib
import contextvars
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

_current = threading.local()

# Device types whose autocast state is carried into the pass threads (those this build of PyTorch supports).
_AUTOCAST_DEVICE_TYPES = ("cpu", "cuda", "xpu", "mps", "hpu", "xla", "ipu", "mtia", "maia")


class PassAborted(RuntimeError):
    """Raised inside a pass thread to unwind it when the other pass failed."""


@dataclass(frozen=True)
class Arrival:
    """Where a pass stopped: at the entrance of block `block`, or at its end (`block is None`) with `result`."""

    block: int | None
    result: Any = None
    error: BaseException | None = None


class LockstepPass:
    """One forward pass (`sign` +1 or -1) of `closure`, run in a thread that stops at every checkpoint.

    Args:
        sign (`int`): +1 for the pass at ``theta + eps z``, -1 for ``theta - eps z``.
        closure (`Callable[[], Any]`): the loss closure; its result is returned in the final `Arrival`.
    """

    def __init__(self, sign: int, closure: Callable[[], Any]):
        self.sign = sign
        self._closure = closure
        self._arrivals: queue.SimpleQueue[Arrival] = queue.SimpleQueue()
        self._resume = threading.Semaphore(0)
        self._abort = False
        self._ended = False
        self._context = contextvars.copy_context()
        self._grad_enabled = torch.is_grad_enabled()
        self._inference = torch.is_inference_mode_enabled()
        self._autocast = _autocast_state()
        self._autocast_cache = torch.is_autocast_cache_enabled()
        self._default_device = torch.get_default_device()
        # Thread-local CUDA state: the passes compute on the caller's device and stream.
        cuda_ready = torch.cuda.is_available() and torch.cuda.is_initialized()
        self._stream = torch.cuda.current_stream() if cuda_ready else None
        self._thread = threading.Thread(target=self._run, name=f"hf_zo_pass{sign:+d}", daemon=True)

    @property
    def ended(self) -> bool:
        """Whether the pass has reported its end (its result or its error)."""
        return self._ended

    def start(self) -> Arrival:
        """Start the pass and return where it first stops."""
        self._thread.start()
        return self._next_arrival()

    def resume(self) -> Arrival:
        """Let the pass run to its next checkpoint (or its end) and return where it stopped."""
        self._resume.release()
        return self._next_arrival()

    def _next_arrival(self) -> Arrival:
        arrival = self._arrivals.get()
        self._ended = arrival.block is None
        return arrival

    def abort(self) -> None:
        """Unwind a pass that has not reported its end yet, and wait for its thread to finish."""
        if self._thread.ident is None:  # never started
            return
        if not self._ended:
            self._abort = True
            self._resume.release()
            self._next_arrival()
        self._thread.join()

    def checkpoint(self, block: int) -> None:
        """Called by the pass's own thread at the entrance of `block`: stop until resumed."""
        self._arrivals.put(Arrival(block))
        self._resume.acquire()
        if self._abort:
            raise PassAborted("The other forward pass of the dual engine failed.")

    def _run(self) -> None:
        _current.active = self
        try:
            if self._stream is not None:
                torch.cuda.set_device(self._stream.device)
            with contextlib.ExitStack() as stack:
                stack.enter_context(torch.inference_mode(self._inference))
                stack.enter_context(torch.set_grad_enabled(self._grad_enabled))
                if self._stream is not None:
                    stack.enter_context(torch.cuda.stream(self._stream))
                for device_type, dtype in self._autocast:
                    stack.enter_context(torch.autocast(device_type, dtype=dtype, cache_enabled=self._autocast_cache))
                if self._default_device != torch.get_default_device():
                    stack.enter_context(torch.device(self._default_device))
                result = self._context.run(self._closure)
            arrival = Arrival(None, result=result)
        except BaseException as error:  # handed to the coordinator, which re-raises it in the caller's thread
            arrival = Arrival(None, error=error)
        finally:
            _current.active = None
        self._arrivals.put(arrival)


def current_pass() -> LockstepPass | None:
    """The pass the calling thread runs, or `None` outside the dual engine's passes."""
    return getattr(_current, "active", None)


def _autocast_state() -> list[tuple[str, torch.dtype]]:
    """The device types for which the calling thread has autocast enabled, with their dtypes."""
    return [
        (device_type, torch.get_autocast_dtype(device_type))
        for device_type in _autocast_device_types()
        if torch.is_autocast_enabled(device_type)
    ]


def _autocast_device_types() -> tuple[str, ...]:
    # Looked up at each pass: a backend package may rename the private-use backend after import.
    candidates = (*_AUTOCAST_DEVICE_TYPES, torch._C._get_privateuse1_backend_name())
    return tuple(t for t in dict.fromkeys(candidates) if torch.amp.is_autocast_available(t))
