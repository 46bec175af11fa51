"""Counter-based perturbation noise and the fused, chunked, in-place sweeps that apply it.

The noise ``z`` of a parameter is a pure function of ``(seed, index, distribution, algorithm)``, and for the
``"torch"`` algorithm also of the device type. Two algorithms compute it (:data:`NOISE_ALGORITHMS`):

- ``"philox"``: element ``e`` comes from Philox-4x32-10 keyed by the seed, with a counter made of ``e``'s block and
  ``index``, through Box-Muller (see `hf_zo.philox`). On the CPU a compiled kernel generates it inside the sweep
  (``z`` is never written to memory); elsewhere, or when the kernel cannot be built, the same algorithm runs in
  torch operations. The bits are the same on every device and in both implementations.
- ``"torch"``: ``z`` is cut into blocks of :data:`NOISE_BLOCK_NUMEL` elements, each drawn by PyTorch's generator
  for the device (``normal_``/``bernoulli_``), seeded by a hash of ``(seed, index, block number)``. The only
  algorithm before ``"philox"``, so that of every run recorded before the algorithm was.

Either way ``z`` never depends on traversal order, on which other parameters exist, on the chunk size or thread
count used to sweep over it, or on the global RNG (which is never touched). Any chunk of any parameter can be
regenerated on its own, by any thread, which makes the sweeps parallel and exact. A sweep over a `DTensor` sharded
by rows (FSDP2's parameters) therefore changes only this process's shard, with the noise of the shard's element
range in the whole tensor (:func:`local_shard`): the bits one process would give those elements.

A sweep brings a tensor to ``decay * tensor + sum_j coeff_j * z(seed_j)`` in one pass over memory, a chunk at a
time, so the only temporary is one chunk of noise per worker (none with the compiled kernel).

With ``stochastic_rounding`` a bfloat16 tensor takes each of those operations in fp32 and is rounded to bfloat16
stochastically (:func:`round_stochastically_`), so that an update far below half a unit in the last place is kept
in expectation instead of rounded away. The random bits are counter-based noise too, keyed by the operation itself
(:func:`rounding_seed`), so the result is as reproducible as ``z``: it depends on no chunking, thread or RNG state.
"""

from __future__ import annotations

import logging
import struct
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard

from .philox import kernel_error, load_kernel, philox_noise

logger = logging.getLogger(__name__)

NOISE_BLOCK_NUMEL = 1 << 16
"""Elements drawn from one seeded generator. Fixed: changing it changes every ``z``."""

DEFAULT_CHUNK_NUMEL = 1 << 18
"""Default elements per sweep chunk (a multiple of :data:`NOISE_BLOCK_NUMEL`)."""

NOISE_DISTRIBUTIONS = ("gaussian", "rademacher", "table")

NOISE_ALGORITHMS = ("philox", "torch")
"""Algorithms that compute ``z`` for the gaussian and rademacher distributions (the table's values do not depend on
it). ``"auto"`` picks ``"philox"`` on the CPU when its compiled kernel loads, else ``"torch"``."""

LEGACY_NOISE_ALGORITHM = "torch"
"""The algorithm of checkpoints and trajectories that do not record one (written before ``"philox"`` existed)."""

DEFAULT_TABLE_NUMEL = 1 << 23
"""Default size of the shared Gaussian table for ``distribution="table"`` (32 MiB in fp32)."""

_MASK64 = (1 << 64) - 1

ROUNDING_TAG = 0x5354_4F43_524F_554E
"""Mixed into the seed of stochastic rounding's random bits, so they never coincide with a perturbation's ``z``."""


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def mix_seed(*values: int) -> int:
    """Hash integers into one 63-bit seed (order-sensitive, platform-independent)."""
    h = 0x243F6A8885A308D3
    for v in values:
        h = _splitmix64(h ^ (int(v) & _MASK64))
    return h >> 1


def rounding_seed(seed: int, factor: float) -> int:
    """The seed of the random bits that stochastically round the operation ``p <- p + factor * z(seed)`` (or, for
    a decay, ``p <- factor * p`` before the terms of `seed`): a pure function of the operation, so that a replay or a
    resumed run rounds it with the same bits, and two operations of a run draw independent bits."""
    (bits,) = struct.unpack("<q", struct.pack("<d", float(factor)))
    return mix_seed(ROUNDING_TAG, seed, bits)


def resolve_noise_algorithm(algorithm: str, device_type: str = "cpu") -> str:
    """The algorithm `algorithm` names for noise generated on `device_type`.

    ``"auto"`` names ``"philox"`` on the CPU if its compiled kernel loads (building it on first use), else
    ``"torch"`` (with one warning on the CPU). On GPUs torch's generator already runs at memory speed, while
    ``"philox"`` would run as a sequence of torch operations.
    """
    if algorithm == "auto":
        if device_type != "cpu":
            return "torch"
        if load_kernel() is not None:
            return "philox"
        _warn_once(
            f"hf_zo's compiled noise kernel is unavailable ({kernel_error()}), so zo_noise_algorithm='auto' falls "
            "back to 'torch' (PyTorch's generator, several times slower than the kernel). The run records the "
            "algorithm, so resume and replay stay exact. To use 'philox', install g++ and ninja and run "
            "`python -m hf_zo.philox --build`."
        )
        return "torch"
    if algorithm not in NOISE_ALGORITHMS:
        raise ValueError(f"Unknown noise algorithm {algorithm!r}; choose 'auto' or one of {NOISE_ALGORITHMS}.")
    return algorithm


_warned: set[str] = set()


def _warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        logger.warning(message)


@dataclass
class NoiseUpdate:
    """An in-place affine update ``p <- decay * p + sum(coeff * z(seed) for seed, coeff in terms)``.

    Terms are applied in insertion order; two updates with the same operations in the same order give bitwise the
    same result however they are grouped into sweeps.
    """

    decay: float = 1.0
    terms: dict[int, float] = field(default_factory=dict)

    def scale(self, factor: float) -> None:
        """Compose with a later ``p <- factor * p``."""
        if factor == 1.0:
            return
        self.decay *= factor
        for seed in self.terms:
            self.terms[seed] *= factor

    def add(self, seed: int, coeff: float) -> None:
        """Compose with a later ``p <- p + coeff * z(seed)``."""
        self.terms[seed] = self.terms.get(seed, 0.0) + coeff

    def is_identity(self) -> bool:
        """Whether applying this update leaves the tensor unchanged."""
        return self.decay == 1.0 and not any(self.terms.values())


class Noise:
    """Generator of counter-based perturbation noise and executor of the sweeps that apply it.

    Args:
        distribution (`str`, defaults to `"gaussian"`):
            `"gaussian"` (standard normal), `"rademacher"` (+1/-1 with equal probability) or `"table"` (slices of one
            shared, pre-generated Gaussian table at seeded offsets: near-zero generation cost).
        chunk_numel (`int`, defaults to `DEFAULT_CHUNK_NUMEL`):
            Elements processed per chunk; rounded up to a multiple of `NOISE_BLOCK_NUMEL`. Bounds the temporary
            memory of a sweep to one chunk per worker. Does not change the noise.
        num_workers (`int`, *optional*):
            Threads that sweep CPU chunks in parallel. Defaults to `torch.get_num_threads()`.
        table_numel (`int`, defaults to `DEFAULT_TABLE_NUMEL`):
            Size of the shared table when `distribution="table"`.
        table_seed (`int`, defaults to 0):
            Seed of the shared table.
        cache_numel (`int`, defaults to 0):
            Keep generated noise chunks of the most recent seeds, up to this many elements, instead of regenerating
            them in the next sweeps (0 disables). Worth it when the perturbed tensors are small (PEFT): memory cost
            is a few times the trainable size. See :meth:`enable_cache`.
        algorithm (`str`, defaults to `"auto"`):
            How `"gaussian"` and `"rademacher"` noise is computed: `"philox"`, `"torch"` (see the module docstring)
            or `"auto"` (see :func:`resolve_noise_algorithm`). The resolved name is in `algorithm`; an automatic
            choice yields to the algorithm of a resumed run (:meth:`use_algorithm`).
        device_type (`str`, defaults to `"cpu"`):
            Where the perturbed tensors live, for `algorithm="auto"`.
        stochastic_rounding (`bool`, defaults to `False`):
            Round every operation of a sweep on a bfloat16 tensor stochastically (up with probability equal to the
            fraction dropped), with random bits drawn from counter-based noise, instead of to the nearest: updates
            smaller than half a unit in the last place are then kept in expectation. fp32 and fp64 tensors are
            unaffected; a float16 tensor is refused (:meth:`check_tensors`).
    """

    def __init__(
        self,
        distribution: str = "gaussian",
        chunk_numel: int = DEFAULT_CHUNK_NUMEL,
        num_workers: int | None = None,
        table_numel: int = DEFAULT_TABLE_NUMEL,
        table_seed: int = 0,
        cache_numel: int = 0,
        algorithm: str = "auto",
        device_type: str = "cpu",
        stochastic_rounding: bool = False,
    ):
        if distribution not in NOISE_DISTRIBUTIONS:
            raise ValueError(f"Unknown noise distribution {distribution!r}; choose one of {NOISE_DISTRIBUTIONS}.")
        if chunk_numel < 1:
            raise ValueError(f"chunk_numel must be >= 1, got {chunk_numel}.")
        if distribution == "table" and table_numel < 2 * NOISE_BLOCK_NUMEL:
            raise ValueError(f"table_numel must be >= {2 * NOISE_BLOCK_NUMEL}, got {table_numel}.")
        self.distribution = distribution
        self.chunk_numel = -(-chunk_numel // NOISE_BLOCK_NUMEL) * NOISE_BLOCK_NUMEL
        if distribution == "table":  # one block per chunk: a chunk's noise is then a view of the table, no copy
            self.chunk_numel = NOISE_BLOCK_NUMEL
        self.num_workers = num_workers or torch.get_num_threads()
        self.table_numel = table_numel
        self.table_seed = table_seed
        self._tables: dict[torch.device, torch.Tensor] = {}
        self._local = threading.local()
        self._pool: ThreadPoolExecutor | None = None
        self._pool_workers = 0
        self.cache_numel = cache_numel
        self._cache: OrderedDict[int, dict[tuple, torch.Tensor]] = OrderedDict()
        self.algorithm_is_automatic = algorithm == "auto"
        if distribution == "table" and algorithm == "auto":
            algorithm = "torch"  # the table is drawn by torch's generator whatever the algorithm: no kernel to build
        self.algorithm = resolve_noise_algorithm(algorithm, device_type)
        self._check_kernel()
        self.stochastic_rounding = bool(stochastic_rounding)
        self._rounding_bits: Noise | None = None
        self._set_rounding_bits()

    @classmethod
    def like(cls, noise: Noise, *args, **kwargs) -> Noise:
        """A `cls` (e.g. an optimizer's own kind of noise) with the settings of `noise`: distribution, chunking,
        workers, table and algorithm, which stays automatic (it follows a resumed checkpoint) if it was.

        `args` and `kwargs` are the further arguments of `cls`."""
        new = cls(
            *args,
            distribution=noise.distribution,
            chunk_numel=noise.chunk_numel,
            num_workers=noise.num_workers,
            table_numel=noise.table_numel,
            table_seed=noise.table_seed,
            algorithm=noise.algorithm,
            stochastic_rounding=noise.stochastic_rounding,
            **kwargs,
        )
        new.algorithm_is_automatic = noise.algorithm_is_automatic
        return new

    def use_algorithm(self, algorithm: str) -> None:
        """Generate with `algorithm` (`"philox"` or `"torch"`) from now on, e.g. that of the run being resumed."""
        if algorithm not in NOISE_ALGORITHMS:
            raise ValueError(f"Unknown noise algorithm {algorithm!r}; choose one of {NOISE_ALGORITHMS}.")
        self.algorithm = algorithm
        self._cache.clear()
        self._check_kernel()
        self._set_rounding_bits()

    def _set_rounding_bits(self) -> None:
        """The generator of stochastic rounding's random bits: plain Gaussian noise of this algorithm (whatever the
        distribution: Rademacher's or a subclass's values would give no usable low bits)."""
        self._rounding_bits = None
        if self.stochastic_rounding:
            self._rounding_bits = Noise(
                "gaussian", chunk_numel=self.chunk_numel, num_workers=1, algorithm=self.algorithm
            )

    def check_tensors(self, tensors: Sequence[tuple[int, torch.Tensor]]) -> None:
        """Raise if a sweep of these ``(index, tensor)`` pairs cannot honour `stochastic_rounding`, and warn if it
        would change nothing.

        Raises:
            `ValueError`: stochastic rounding is on and a tensor is float16 (only bfloat16 is rounded this way).
        """
        if not self.stochastic_rounding:
            return
        dtypes = {tensor.dtype for _, tensor in tensors}
        if torch.float16 in dtypes:
            raise ValueError(
                "stochastic_rounding (zo_stochastic_rounding) rounds bfloat16 weights only, but some trainable "
                "weights are float16. Load the model with dtype=torch.bfloat16 (or torch.float32), or turn "
                "stochastic rounding off and set zo_exact_restore=True."
            )
        if torch.bfloat16 not in dtypes:
            _warn_once(
                "zo_stochastic_rounding is on but no trainable weight is bfloat16, so it changes nothing: it rounds "
                "the updates of bfloat16 weights only (fp32 weights keep small updates anyway)."
            )

    def _check_kernel(self) -> None:
        if self.algorithm == "philox" and self.distribution != "table" and load_kernel() is None:
            _warn_once(
                f"hf_zo's compiled noise kernel is unavailable ({kernel_error()}), so 'philox' noise is computed "
                "with torch operations: the same bits, about 50x slower. Install g++ and ninja and run "
                "`python -m hf_zo.philox --build` to build the kernel."
            )

    @property
    def _is_philox(self) -> bool:
        return self.algorithm == "philox" and self.distribution != "table"

    @property
    def _fuses_generation(self) -> bool:
        """Whether sweeps may let the compiled kernel generate ``z`` itself: only for the plain Philox noise, since
        the kernel bypasses :meth:`fill_` (which subclasses override, e.g. LOZO's low-rank noise) and the cache."""
        return self._is_philox and not self.cache_numel and type(self).fill_ is Noise.fill_

    def __getstate__(self):
        state = self.__dict__.copy()
        state.update(_local=None, _pool=None, _tables={}, _cache=OrderedDict())
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._local = threading.local()

    # ------------------------------------------------------------------ generation

    def _generator(self, device: torch.device) -> torch.Generator:
        cache = getattr(self._local, "generators", None)
        if cache is None:
            cache = self._local.generators = {}
        if device not in cache:
            cache[device] = torch.Generator(device=device)
        return cache[device]

    def _table(self, device: torch.device) -> torch.Tensor:
        if device not in self._tables:
            generator = torch.Generator(device="cpu").manual_seed(self.table_seed)
            table = torch.randn(self.table_numel, generator=generator)
            self._tables[device] = table.to(device)
        return self._tables[device]

    def fill_(self, out: torch.Tensor, seed: int, index: int, start: int, total: int | None = None) -> torch.Tensor:
        """Write ``z[start : start + out.numel()]`` of parameter `index` for `seed` into the fp32 vector `out`.

        The noise does not depend on how a parameter is cut. With the `"torch"` algorithm and the table, whose
        blocks of `NOISE_BLOCK_NUMEL` elements are drawn whole (the last one of a parameter shorter), a range that
        begins or ends inside a block (a shard's) needs `total`, the parameter's number of elements: the blocks that
        cover the range are drawn at their size and the wanted elements kept. Without `total`, `start` must be a
        multiple of `NOISE_BLOCK_NUMEL` and the range is taken to end the parameter or a block.
        """
        if self._is_philox:
            kernel = load_kernel()
            if kernel is not None and out.device.type == "cpu" and out.is_contiguous():
                kernel.fill(out, seed, index, start, self.distribution == "gaussian")
            else:
                out.copy_(philox_noise(seed, index, start, out.numel(), self.distribution == "gaussian", out.device))
            return out
        end = start + out.numel()
        if total is None:
            if start % NOISE_BLOCK_NUMEL:
                raise ValueError(
                    f"start must be a multiple of {NOISE_BLOCK_NUMEL} unless total (the parameter's size) is given, "
                    f"got {start}."
                )
            total = end
        if start < 0 or end > total:
            raise ValueError(f"The range [{start}, {end}) must lie within the parameter's {total} elements.")
        for block_number in range(start // NOISE_BLOCK_NUMEL, -(-end // NOISE_BLOCK_NUMEL)):
            block_start = block_number * NOISE_BLOCK_NUMEL
            size = min(NOISE_BLOCK_NUMEL, total - block_start)
            low, high = max(start, block_start), min(end, block_start + size)
            if (low, high) == (block_start, block_start + size):
                self._draw_block_(out[low - start : high - start], seed, index, block_number)
            else:  # a block the range cuts: drawn whole, the wanted elements kept
                block = torch.empty(size, dtype=out.dtype, device=out.device)
                self._draw_block_(block, seed, index, block_number)
                out[low - start : high - start].copy_(block[low - block_start : high - block_start])
        return out

    def _draw_block_(self, block: torch.Tensor, seed: int, index: int, block_number: int) -> None:
        """Draw block `block_number` of parameter `index` for `seed` (the `"torch"` algorithm or the table) into
        `block`, which has the block's whole size."""
        block_seed = mix_seed(seed, index, block_number)
        if self.distribution == "table":
            table = self._table(block.device)
            position = block_seed % (self.table_numel - block.numel() + 1)
            block.copy_(table[position : position + block.numel()])
            return
        generator = self._generator(block.device)
        generator.manual_seed(block_seed)
        if self.distribution == "gaussian":
            block.normal_(generator=generator)
        else:
            block.bernoulli_(0.5, generator=generator).mul_(2.0).sub_(1.0)

    def chunk(
        self, scratch: torch.Tensor, seed: int, index: int, start: int, total: int | None = None
    ) -> torch.Tensor:
        """``z[start : start + scratch.numel()]`` of parameter `index` for `seed`, to be read (not written); `total`
        as for :meth:`fill_`.

        Returns a cached chunk or a view of the table when there is one (no copy), else fills `scratch`.
        """
        key = (index, start, scratch.numel(), scratch.device)
        if self.cache_numel:
            cached = self._cache.get(seed, {}).get(key)
            if cached is not None:
                return cached
        whole_block = not start % NOISE_BLOCK_NUMEL and (
            total is None or start + scratch.numel() in (total, start + NOISE_BLOCK_NUMEL)
        )
        if self.distribution == "table" and scratch.numel() <= NOISE_BLOCK_NUMEL and whole_block:
            block_seed = mix_seed(seed, index, start // NOISE_BLOCK_NUMEL)
            position = block_seed % (self.table_numel - scratch.numel() + 1)
            return self._table(scratch.device)[position : position + scratch.numel()]
        if total is None or type(self).fill_ is not Noise.fill_:
            # Subclasses' own noise (HiZOO's, LOZO's) sweeps whole parameters only and takes no `total`.
            z = self.fill_(scratch, seed, index, start)
        else:
            z = self.fill_(scratch, seed, index, start, total)
        if self.cache_numel:
            self._cache.setdefault(seed, {})[key] = z.clone()
        return z

    def enable_cache(self, cache_numel: int) -> None:
        """Cache up to `cache_numel` elements of generated noise (oldest seeds evicted first); 0 disables."""
        self.cache_numel = cache_numel
        self._cache.clear()

    def _evict(self) -> None:
        # Runs between sweeps, on the calling thread: workers only add entries.
        total = sum(z.numel() for entries in self._cache.values() for z in entries.values())
        while self._cache and total > self.cache_numel:
            _, entries = self._cache.popitem(last=False)
            total -= sum(z.numel() for z in entries.values())

    def sample(self, seed: int, index: int, shape: torch.Size | Sequence[int], device="cpu") -> torch.Tensor:
        """Return the whole noise tensor of parameter `index` (for tests and small tensors)."""
        out = torch.empty(torch.Size(shape), dtype=torch.float32, device=device)
        self.fill_(out.view(-1), seed, index, 0)
        return out

    # ------------------------------------------------------------------ sweeps

    def map_chunks(
        self,
        tensors: Sequence[tuple[int, torch.Tensor]],
        visit: Callable[[int, int, torch.Tensor, list[torch.Tensor]], None],
        num_scratch: int = 1,
    ) -> None:
        """Call ``visit(position, start, chunk, scratch)`` on every chunk of every tensor, in parallel on CPU.

        `position` is the tensor's position in `tensors`, `chunk` a flat in-place view of the tensor's elements
        ``[start, start + chunk.numel())``, and `scratch` a list of `num_scratch` per-worker fp32 buffers of the
        chunk's size (for noise and accumulators). Chunks are disjoint, so the result does not depend on scheduling.
        A `DTensor` contributes the chunks of its local shard, `start` counted in the whole tensor
        (:func:`local_shard`).
        """
        shards = [local_shard(t) for _, t in tensors]
        work = []
        for position, (local, _) in enumerate(shards):
            for start in range(0, local.numel(), self.chunk_numel):
                work.append((position, start))
        if not work:
            return
        if self.cache_numel:
            self._evict()
        flats = [_flat_view(local) for local, _ in shards]

        def run(items):
            scratch = {}
            for position, start in items:
                flat = flats[position]
                chunk = flat[start : start + self.chunk_numel]
                key = (chunk.device, chunk.numel())
                if key not in scratch:
                    scratch[key] = [
                        torch.empty(chunk.numel(), dtype=torch.float32, device=chunk.device)
                        for _ in range(num_scratch)
                    ]
                visit(position, shards[position][1] + start, chunk, scratch[key])

        on_cpu = all(local.device.type == "cpu" for local, _ in shards)
        workers = min(self.num_workers, len(work)) if on_cpu else 1
        if workers <= 1:
            run(work)
        else:
            if self._pool is None or self._pool_workers != workers:
                self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="hf_zo_noise")
                self._pool_workers = workers
            futures = [self._pool.submit(run, work[w::workers]) for w in range(workers)]
            for future in futures:
                future.result()
        for (local, _), flat in zip(shards, flats):
            if not local.is_contiguous():
                local.data.copy_(flat.view_as(local))

    def update_chunk_(
        self,
        chunk: torch.Tensor,
        scratch: torch.Tensor,
        index: int,
        start: int,
        decay: float,
        terms: Sequence[tuple[int, float]],
        total: int | None = None,
        stochastic_rounding: bool | None = None,
    ) -> None:
        """In place, ``chunk <- decay * chunk + sum(coeff * z(seed)[start:] for seed, coeff in terms)``.

        `chunk` is elements ``[start, start + chunk.numel())`` of parameter `index` (flat, `total` elements: needed
        for a chunk of a shard, see :meth:`fill_`), `scratch` an fp32 buffer of its size for the noise. Every sweep
        updates chunks this way, so all of them round alike: each operation (the decay, then each term) rounds once
        to `chunk`'s dtype, so that the result does not depend on how the operations are grouped into sweeps;
        stochastically for a bfloat16 chunk with `stochastic_rounding` (`None`: the noise's own setting).
        """
        if stochastic_rounding is None:
            stochastic_rounding = self.stochastic_rounding
        if stochastic_rounding and chunk.dtype in (torch.bfloat16, torch.float16):
            self._update_chunk_stochastically_(chunk, scratch, index, start, decay, terms, total)
            return
        if decay != 1.0:
            chunk.mul_(decay)
        for seed, coeff in terms:
            if not coeff:
                continue
            z = self.chunk(scratch, seed, index, start, total)
            if self._is_philox:
                # The compiled kernel's rounding: the product (in fp32, or float64 for float64 chunks), then the sum.
                chunk.add_(z.to(torch.promote_types(chunk.dtype, torch.float32)) * coeff)
            else:
                chunk.add_(z, alpha=coeff)

    def _update_chunk_stochastically_(
        self,
        chunk: torch.Tensor,
        scratch: torch.Tensor,
        index: int,
        start: int,
        decay: float,
        terms: Sequence[tuple[int, float]],
        total: int | None = None,
    ) -> None:
        """:meth:`update_chunk_` of a bfloat16 `chunk`, each operation computed in fp32 and rounded stochastically
        with the bits of :func:`rounding_seed` for that operation, at the chunk's elements of parameter `index`."""
        if chunk.dtype != torch.bfloat16:
            self.check_tensors([(index, chunk)])
        value = self._value_buffer(scratch)
        if decay != 1.0:
            value.copy_(chunk).mul_(decay)
            # The decay's bits are keyed by the first term that follows it too: the same decay recurs every step.
            first = next((seed for seed, coeff in terms if coeff), 0)
            self._round_into_(chunk, value, scratch, rounding_seed(first, decay), index, start, total)
        for seed, coeff in terms:
            if not coeff:
                continue
            z = self.chunk(scratch, seed, index, start, total)
            # The product, then the sum, each rounded once in fp32: no fused multiply-add, which only some lanes of
            # a vectorized loop would use, so every chunking gives the same value.
            torch.mul(z, coeff, out=value)
            value.add_(chunk)
            self._round_into_(chunk, value, scratch, rounding_seed(seed, coeff), index, start, total)

    def _value_buffer(self, scratch: torch.Tensor) -> torch.Tensor:
        """A per-thread fp32 buffer of `scratch`'s size and device, for the value before rounding: a view of one
        buffer per device, so the last chunks of tensors of many sizes add nothing."""
        buffers = getattr(self._local, "rounding_values", None)
        if buffers is None:
            buffers = self._local.rounding_values = {}
        buffer = buffers.get(scratch.device)
        if buffer is None or buffer.numel() < scratch.numel():
            buffer = buffers[scratch.device] = torch.empty(
                max(scratch.numel(), self.chunk_numel), dtype=torch.float32, device=scratch.device
            )
        return buffer[: scratch.numel()]

    def _round_into_(
        self,
        chunk: torch.Tensor,
        value: torch.Tensor,
        scratch: torch.Tensor,
        seed: int,
        index: int,
        start: int,
        total: int | None = None,
    ) -> None:
        """Write the fp32 `value` into the bfloat16 `chunk`, rounded stochastically with the random bits of `seed` at
        elements ``[start, ...)`` of parameter `index` of `total` elements (`scratch` holds them; it is
        overwritten)."""
        self._rounding_bits.fill_(scratch, seed, index, start, total)
        bits = scratch.view(torch.int32)
        # The low 16 bits of a Gaussian sample are nearly uniform, but measurably biased low (their mean is 0.2%
        # under one half, as the rounding of the Box-Muller arithmetic leaves it); folded onto the sign, exponent and
        # high mantissa bits they are uniform to within what 6.7e7 samples resolve (the mean and the upper tail).
        bits.bitwise_xor_(bits >> 16).bitwise_and_(0xFFFF)
        round_stochastically_(chunk, value, bits)

    def apply_(
        self,
        tensors: Sequence[tuple[int, torch.Tensor]],
        updates: Sequence[NoiseUpdate],
        stochastic_rounding: bool | None = None,
    ) -> None:
        """Apply ``updates[k]`` to ``tensors[k] = (index, tensor)`` in place, in one sweep over memory.

        `stochastic_rounding=False` rounds this sweep to nearest even where the noise rounds stochastically: for a
        perturbation that is undone from a saved copy, whose rounding no update keeps (half the cost of a bfloat16
        sweep). `None` follows the noise's own setting."""
        if stochastic_rounding is None:
            stochastic_rounding = self.stochastic_rounding
        live = [(k, u) for k, u in enumerate(updates) if not u.is_identity()]
        if not live:
            return
        selected = [tensors[k] for k, _ in live]
        plans = [(u.decay, [(s, c) for s, c in u.terms.items() if c != 0.0]) for _, u in live]
        kernel = load_kernel() if self._fuses_generation else None
        if kernel is not None:
            fused = [k for k, (_, t) in enumerate(selected) if _fused_kernel_can_update(t)]
            kernel.apply(
                [selected[k][1].data for k in fused],
                [selected[k][0] for k in fused],
                [plans[k][0] for k in fused],
                [[seed for seed, _ in plans[k][1]] for k in fused],
                [[coeff for _, coeff in plans[k][1]] for k in fused],
                self.distribution == "gaussian",
            )
            rest = sorted(set(range(len(selected))) - set(fused))
            selected, plans = [selected[k] for k in rest], [plans[k] for k in rest]

        def visit(position, start, chunk, scratch):
            decay, terms = plans[position]
            index, tensor = selected[position]
            self.update_chunk_(chunk, scratch[0], index, start, decay, terms, tensor.numel(), stochastic_rounding)

        self.map_chunks(selected, visit)


def round_stochastically_(out: torch.Tensor, value: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    """Write the fp32 `value` into the bfloat16 `out`, rounded stochastically by the 16-bit random integers `bits`.

    bfloat16 is the upper half of fp32, so adding ``bits`` (uniform in ``[0, 2^16)``, an int32 tensor) to the fp32
    bit pattern and clearing the low 16 bits rounds the magnitude up with probability equal to the fraction of a
    bfloat16 unit that truncation drops, and down otherwise: the expected result is `value`, for either sign, across
    binade boundaries and for subnormals. A value that bfloat16 holds exactly is kept; infinities and NaN stay.
    `value` is overwritten.

    Returns:
        `torch.Tensor`: `out`.
    """
    pattern = value.view(torch.int32)
    pattern.add_(bits).bitwise_and_(-(1 << 16))
    return out.copy_(value)  # exact: the value is now a bfloat16 value


def update_of(noise: Noise, index: int, before: torch.Tensor, update: NoiseUpdate) -> torch.Tensor:
    """The change ``(decay - 1) * before + sum(coeff * z(seed))`` that `update` intends for parameter `index`, in
    fp32, computed exactly as far as fp32 allows (no rounding to `before`'s dtype): what
    :func:`kept_update` compares the applied change with.

    Args:
        noise (`Noise`): the noise of the run (the optimizer's `noise`).
        index (`int`): the parameter's stable noise index.
        before (`torch.Tensor`): the parameter before the update.
        update (`NoiseUpdate`): the update, e.g. MeZO's ``NoiseUpdate(1 - lr * wd, {seed: -lr * g})``.

    Returns:
        `torch.Tensor`: fp32, of `before`'s shape.
    """
    intended = before.detach().float() * (update.decay - 1.0)
    for seed, coeff in update.terms.items():
        intended.add_(noise.sample(seed, index, before.shape, before.device), alpha=coeff)
    return intended


def kept_update(
    before: Sequence[torch.Tensor], after: Sequence[torch.Tensor], intended: Sequence[torch.Tensor]
) -> float:
    """The fraction of an intended update that the weights kept: ``<applied, intended> / <intended, intended>``
    with ``applied = after - before``, summed over the tensors in float64.

    About 1 when updates survive in expectation (fp32 weights, or bfloat16 with stochastic rounding), about 0 when
    rounding drops them (bfloat16 rounded to nearest, for updates below half a unit in the last place).

    Args:
        before (`Sequence[torch.Tensor]`): the tensors before the update.
        after (`Sequence[torch.Tensor]`): the same tensors after it.
        intended (`Sequence[torch.Tensor]`): the change meant for each (see :func:`update_of`).

    Returns:
        `float`: the projection; NaN if the intended update is zero.
    """
    dot = norm = 0.0
    for b, a, i in zip(before, after, intended, strict=True):
        b, a, i = (t.detach().reshape(-1) for t in (b, a, i))
        for start in range(0, i.numel(), DEFAULT_CHUNK_NUMEL):  # bounded float64 temporaries on big tensors
            stop = start + DEFAULT_CHUNK_NUMEL
            part = i[start:stop].double()
            dot += float((a[start:stop].double() - b[start:stop].double()) @ part)
            norm += float(part @ part)
    return dot / norm if norm else float("nan")


def _fused_kernel_can_update(tensor: torch.Tensor) -> bool:
    """Whether the compiled kernel can sweep `tensor` in place (else chunks of noise are generated and added): it
    numbers the elements from 0, so a shard of a `DTensor` goes through the chunked sweep, which gives the same
    bits."""
    return (
        not isinstance(tensor, DTensor)
        and tensor.device.type == "cpu"
        and tensor.dtype == torch.float32
        and tensor.is_contiguous()
    )


def local_shard(tensor: torch.Tensor) -> tuple[torch.Tensor, int]:
    """The elements of `tensor` this process holds, and the position of the first of them in the flat tensor.

    A plain tensor is held whole: ``(tensor, 0)``. A `DTensor` sharded by rows (`Shard(0)`, FSDP2's layout, possibly
    replicated over other mesh dimensions) holds rows ``[r * ceil(n / k), (r + 1) * ceil(n / k))`` of its ``n`` on
    shard ``r`` of ``k``: a contiguous range of the flat tensor, so its noise is that range of the whole tensor's.

    Raises:
        `ValueError`: for a `DTensor` placed otherwise (sharded on another dimension, or on several mesh
            dimensions), whose local elements are not one range of the flat tensor.
    """
    if not isinstance(tensor, DTensor):
        return tensor, 0
    local = tensor.to_local()
    sharded = [dim for dim, placement in enumerate(tensor.placements) if not isinstance(placement, Replicate)]
    if not sharded:
        return local, 0
    if len(sharded) > 1 or tensor.placements[sharded[0]] != Shard(0):
        raise ValueError(
            f"Cannot perturb a DTensor placed as {tensor.placements}: only row sharding (Shard(0) on one mesh "
            "dimension, FSDP2's layout) keeps a shard's elements one range of the flat tensor. Shard the model with "
            "torch.distributed.fsdp.fully_shard (or Accelerate's fsdp_version: 2)."
        )
    mesh_dim = sharded[0]
    shards, shard = tensor.device_mesh.size(mesh_dim), tensor.device_mesh.get_local_rank(mesh_dim)
    rows = tensor.shape[0]
    first_row = min(shard * -(-rows // shards), rows)
    row_numel = tensor.numel() // rows if rows else 0
    return local, first_row * row_numel


def _flat_view(tensor: torch.Tensor) -> torch.Tensor:
    """A flat view sharing memory when possible, else a contiguous copy written back after the sweep."""
    if tensor.is_contiguous():
        return tensor.data.view(-1)
    return tensor.data.contiguous().view(-1)


def perturb_(tensors: Sequence[tuple[int, torch.Tensor]], seed: int, scale: float, noise: Noise | None = None) -> None:
    """In place, ``p <- p + scale * z(seed, index)`` for every ``(index, p)`` in `tensors`."""
    noise = noise or Noise()
    noise.apply_(tensors, [NoiseUpdate(terms={seed: scale}) for _ in tensors])


def restore_and_update_(
    tensors: Sequence[tuple[int, torch.Tensor]],
    seed: int,
    eps: float,
    lr: float,
    projected_grad: float,
    weight_decay: float | Sequence[float] = 0.0,
    noise: Noise | None = None,
) -> None:
    """One sweep of ``p <- (1 - lr * wd) * (p + eps * z) - lr * projected_grad * z`` (the MeZO restore and update)."""
    noise = noise or Noise()
    decays = [weight_decay] * len(tensors) if isinstance(weight_decay, (int, float)) else list(weight_decay)
    updates = []
    for wd in decays:
        update = NoiseUpdate(terms={seed: eps})
        update.scale(1.0 - lr * wd)
        update.add(seed, -lr * projected_grad)
        updates.append(update)
    noise.apply_(tensors, updates)
