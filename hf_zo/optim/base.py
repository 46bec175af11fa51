"""`ZOOptimizer`: the base of every zeroth-order optimizer.

A ZO optimizer is a `torch.optim.Optimizer` (so LR schedulers, `param_groups` and checkpointing work unchanged)
whose gradient information is a list of :class:`~hf_zo.estimator.ZORecord` ``(seed, projected_grad)``. Each
subclass only turns those records into a parameter update (:meth:`ZOOptimizer._apply_records`).

Two ways to drive it:

- a plain loop: ``loss = opt.step(closure)`` where ``closure()`` returns the loss of one forward pass (it is called
  once per perturbation sign, under `torch.no_grad`);
- gradient accumulation (what `ZOTrainer` does): ``opt.estimate(closure)`` once per micro-batch, then
  ``opt.step()`` applies all the records at once.

Every estimate runs through the optimizer's estimator slot (`hf_zo.estimator.SPSAEstimator`, or the engine that
wraps it) and, on several processes, through its parallel layout: both are given in one
:class:`~hf_zo.optim.execution.ZOExecution`. The optimizer alone counts its estimates and steps.

Each subclass describes itself for the rest of hf_zo (class attributes read by `ZOConfig`'s checks, the trainer,
`hf_zo.parallel` and `hf_zo.trajectory`: see "Declarations" in :class:`ZOOptimizer`) and registers under a name
with ``class MyOptimizer(ZOOptimizer, name="my_optimizer")``, which adds it to :data:`ZO_OPTIMIZERS`.
"""

from __future__ import annotations

import inspect
import logging
from abc import ABCMeta, abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Iterable

import torch
from torch.utils.hooks import RemovableHandle

from ..estimator import EstimateLosses, LazyParameters, SPSAEstimator, ZORecord, make_record
from ..noise import LEGACY_NOISE_ALGORITHM, NOISE_ALGORITHMS, Noise, mix_seed
from .execution import Closure, Estimator, ZOExecution

logger = logging.getLogger(__name__)

ZO_OPTIMIZERS: dict[str, type[ZOOptimizer]] = {}
"""The optimizers selectable by name (`ZOConfig.zo_optimizer`), filled as each class registers with
``class ...(ZOOptimizer, name=...)``."""

BOTH_SIGNS = (+1, -1)

AUTO_CACHE_MAX_NUMEL = 1 << 22
"""Trainable elements up to which the noise of recent seeds is cached by default (16 MiB of fp32 per seed)."""

CACHED_STEPS = 4
"""Seeds' worth of noise the cache holds when enabled (a seed is used by up to three consecutive sweeps)."""


def check_eps(eps, name: str = "eps") -> None:
    """Raise unless `eps`, the scale of the perturbations (`name`: how the caller calls it), is a number > 0."""
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps > 0:
        raise ValueError(
            f"{name} must be > 0, got {eps!r}; MeZO uses 1e-3 (full fine-tuning) to 1e-1 (prefix tuning), and "
            "ZOConfig's zo_eps left unset follows the model's method."
        )


class ZOOptimizer(torch.optim.Optimizer, metaclass=ABCMeta):
    """Base class of the zeroth-order optimizers.

    Args:
        params (`Iterable`):
            Parameters or parameter groups, as for any `torch.optim.Optimizer`. A group may carry `"indices"`: the
            stable index of each of its parameters among the model's trainable parameters, which keys the noise
            (DESIGN invariant 1). Without it, the trainable parameters are numbered in the order given. Tensors with
            `requires_grad=False` are never perturbed or updated, as `torch.optim` never updates a tensor without a
            gradient, so `model.parameters()` and the list of its trainable tensors train the same.
        lr (`float`): learning rate.
        eps (`float`, defaults to 1e-3): perturbation scale of the two-point estimate.
        weight_decay (`float`, defaults to 0.0): decoupled weight decay, ``p <- (1 - lr * wd) * p``.
        noise (`str` or `Noise`, *optional*):
            The perturbation distribution, or a `Noise` (to choose its algorithm, chunk size or threads); default:
            the class's `default_noise` (`"gaussian"`).
        num_perturbations (`int`, defaults to 1): perturbations (records) per call of :meth:`estimate`.
        seed (`int`, defaults to 0): base seed; the seed of each perturbation derives from it and the step counter.
        max_consecutive_skips (`int`, *optional*):
            Stop with an error after this many consecutive estimates with a non-finite loss.
        exact_restore (`bool`, *optional*):
            Restore the parameters after the two forwards from a copy instead of by subtracting the noise, so that
            bf16/fp16 weights do not drift (memory: one copy of the trainable tensors). Default: on when some
            trainable tensor is fp16/bf16 and the trainable parameters total at most `AUTO_CACHE_MAX_NUMEL`
            elements.
        cache_noise (`bool`, *optional*):
            Keep each step's noise instead of regenerating it in the following sweeps (memory: a few times the
            trainable size). Default: on when the trainable parameters total at most `AUTO_CACHE_MAX_NUMEL`
            elements (typical of PEFT), off otherwise.
        execution (`ZOExecution`, *optional*):
            The engine and parallel layout the estimates run with (see :meth:`set_execution`); default: the
            sequential estimator in one process.
        **defaults: further per-group hyper-parameters of the subclass (named in `group_hyperparameters`).

    Declarations (class attributes a subclass sets to describe itself; the rest of hf_zo reads them):
        name: the registry name (given as ``class ...(ZOOptimizer, name="...")``; `None` on unregistered classes).
        group_hyperparameters, needs_center_loss, stateless, default_noise, min_num_perturbations, supported_noise,
        supports_offload, supports_dual_engine, supports_data_parallel, supports_perturbation_parallel,
        supports_fsdp, replayable, limitations: documented below; :meth:`config_kwargs` names the `ZOConfig`
        fields of its own arguments.
    """

    name: str | None = None
    """The name the class is registered under in :data:`ZO_OPTIMIZERS` (`ZOConfig.zo_optimizer`)."""

    group_hyperparameters: tuple[str, ...] = ()
    """The per-group hyper-parameters a subclass adds through ``**defaults``; any other keyword is refused."""

    needs_center_loss: bool = False
    """Whether each estimate also measures the loss at the unperturbed weights, first, and its record carries the
    curvature along its perturbation (HiZOO: a third forward per estimate; trajectories then record curvatures). An
    optimizer that measures that loss once per micro-batch (FZOO) does it in its own :meth:`run_forwards`."""

    stateless: bool = False
    """Whether the update depends only on the step's records, with no state carried between steps, so that a
    trajectory recorded from the middle of a run can be replayed (`hf_zo.trajectory`)."""

    replayable: bool = True
    """Whether a trajectory (seeds, projected gradients, lr, weight decay) determines the run's updates."""

    default_noise: str = "gaussian"
    """The perturbation distribution used when `noise` is not given."""

    min_num_perturbations: int = 1
    """The fewest perturbations per micro-batch (`num_perturbations`, `zo_num_perturbations`) the update needs."""

    supported_noise: tuple[str, ...] | None = None
    """The noise distributions it can perturb with; `None`: all of `hf_zo.noise.NOISE_DISTRIBUTIONS`."""

    supports_offload: bool = False
    """Whether its update can wait in the pending move until each offloaded block arrives (`zo_offload`)."""

    supports_dual_engine: bool = True
    """Whether the dual engine (`zo_engine="dual"`) can run its estimates."""

    supports_data_parallel: bool = True
    """Whether data-parallel replicas, each on its own micro-batches, stay identical (``dp > 1``)."""

    supports_perturbation_parallel: bool = True
    """Whether the forwards of one micro-batch can be shared among processes (`zo_perturbation_parallel_size > 1`)."""

    supports_fsdp: bool = False
    """Whether it trains FSDP2-sharded parameters: its whole update waits in the pending move, which each process
    applies to its own shards (an update that sweeps a per-element state or shapes its noise by the whole tensor
    does not)."""

    limitations: dict[str, str] = {}
    """Why a feature declared unsupported is refused, by feature (`"dual_engine"`, `"data_parallel"`,
    `"perturbation_parallel"`, `"noise"`, `"num_perturbations"`, `"replay"`): the error message's text."""

    def __init_subclass__(cls, name: str | None = None, **kwargs):
        super().__init_subclass__(**kwargs)
        cls.name = name
        if name is None:
            return
        registered = ZO_OPTIMIZERS.get(name)
        if registered is not None and registered.__qualname__ != cls.__qualname__:
            raise ValueError(f"zo_optimizer name {name!r} is taken by {registered.__qualname__}; choose another.")
        ZO_OPTIMIZERS[name] = cls

    @classmethod
    def config_kwargs(cls, args) -> dict:
        """This class's own constructor arguments, read from the `ZOConfig` fields that set them (the arguments of
        :class:`ZOOptimizer` itself are read by `hf_zo.training.optimizer.build_zo_optimizer`)."""
        return {}

    @classmethod
    def check_execution(
        cls,
        engine: str = "sequential",
        offload: bool = False,
        dp_size: int = 1,
        pertp_size: int = 1,
        noise: str | None = None,
        num_perturbations: int | None = None,
        fsdp: bool = False,
    ) -> None:
        """Raise a `ValueError` naming the `ZOConfig` field and the fix when this optimizer cannot run so.

        The one home of each optimizer-specific rule: `ZOConfig` asks it before any model exists, and
        :meth:`set_execution` and the parallel layout when an engine or a mesh is given.

        Args:
            engine (`str`): `"sequential"` or `"dual"` (`zo_engine`).
            offload (`bool`): whether the blocks are offloaded (`zo_offload`).
            dp_size, pertp_size (`int`): the mesh (``processes / zo_perturbation_parallel_size`` and that size).
            noise (`str`, *optional*): the noise distribution (`zo_noise`).
            num_perturbations (`int`, *optional*): `zo_num_perturbations`.
            fsdp (`bool`): whether the parameters are FSDP2-sharded (an FSDP2 launch).
        """
        label = f"zo_optimizer={cls.name!r}" if cls.name else cls.__name__
        reasons = cls.limitations
        if num_perturbations is not None and num_perturbations < cls.min_num_perturbations:
            raise ValueError(
                f"{label} {reasons.get('num_perturbations', 'needs more perturbations per micro-batch')}, so it needs "
                f"zo_num_perturbations >= {cls.min_num_perturbations} (num_perturbations of the optimizer), got "
                f"{num_perturbations!r}."
            )
        if noise is not None and cls.supported_noise is not None and noise not in cls.supported_noise:
            choices = " or ".join(repr(n) for n in cls.supported_noise)
            raise ValueError(
                f"{label} {reasons.get('noise', 'draws its own noise')} and cannot use zo_noise={noise!r}; set "
                f"zo_noise={choices}."
            )
        if offload and not cls.supports_offload:
            able = " or ".join(repr(n) for n, c in ZO_OPTIMIZERS.items() if c.supports_offload)
            raise ValueError(
                f"zo_offload needs zo_optimizer={able} (got {cls.name or cls.__name__!r}): its update waits in the "
                "pending move until each block arrives; the others sweep all weights at every step."
            )
        if engine != "sequential" and not cls.supports_dual_engine:
            raise ValueError(
                f"{label} {reasons.get('dual_engine', 'runs forwards')}, which the dual engine (and so offload) does "
                "not run; use zo_engine='sequential' without zo_offload."
            )
        if pertp_size > 1 and not cls.supports_perturbation_parallel:
            raise ValueError(
                f"{reasons.get('perturbation_parallel', label + ' cannot share its forwards among processes')}, "
                f"which perturbation parallelism does not split between ranks; set zo_perturbation_parallel_size=1 "
                f"(got {pertp_size}) and use data parallelism instead."
            )
        if fsdp and not cls.supports_fsdp:
            able = " or ".join(repr(n) for n, c in ZO_OPTIMIZERS.items() if c.supports_fsdp)
            raise ValueError(
                f"FSDP2 needs zo_optimizer={able} (got {cls.name or cls.__name__!r}): only an update that waits in "
                "the pending move is applied shard by shard. Launch without FSDP (ZO data parallelism, or "
                "zo_offload for a model larger than one device) to use this optimizer."
            )
        if dp_size > 1 and not cls.supports_data_parallel:
            raise ValueError(
                f"{reasons.get('data_parallel', label + ' cannot run on data-parallel replicas')}: its data-parallel "
                f"replicas (dp={dp_size}) would diverge; use another zo_optimizer or zo_perturbation_parallel_size "
                "equal to the number of processes."
            )

    def __init__(
        self,
        params: Iterable,
        lr: float,
        eps: float = 1e-3,
        weight_decay: float = 0.0,
        noise: str | Noise | None = None,
        num_perturbations: int = 1,
        seed: int = 0,
        max_consecutive_skips: int | None = None,
        cache_noise: bool | None = None,
        exact_restore: bool | None = None,
        execution: ZOExecution | None = None,
        **defaults,
    ):
        if not lr >= 0:
            raise ValueError(f"lr must be >= 0, got {lr}.")
        check_eps(eps)
        if not weight_decay >= 0:
            raise ValueError(f"weight_decay must be >= 0, got {weight_decay}.")
        if not isinstance(num_perturbations, int) or num_perturbations < 1:
            raise ValueError(f"num_perturbations must be an integer >= 1, got {num_perturbations!r}.")
        type(self).check_execution(num_perturbations=num_perturbations)
        if max_consecutive_skips is not None and max_consecutive_skips < 1:
            raise ValueError(f"max_consecutive_skips must be >= 1 or None, got {max_consecutive_skips}.")
        if unknown := sorted(set(defaults) - set(self.group_hyperparameters)):
            signature = inspect.signature(ZOOptimizer.__init__).parameters
            base_options = [name for name in signature if name not in ("self", "params", "defaults")]
            options = ", ".join([*base_options, *self.group_hyperparameters])
            hint = ""
            if any("noise" in name for name in unknown):
                hint = "; choose the noise algorithm with noise=Noise('gaussian', algorithm=...)"
            raise TypeError(
                f"{type(self).__name__} got unexpected keyword arguments {unknown}; its options are {options}{hint}."
            )
        super().__init__(params, dict(lr=lr, weight_decay=weight_decay, **defaults))
        if not isinstance(noise, Noise):
            noise = Noise(noise or self.default_noise, device_type=_device_type(self.param_groups))
        self.noise = noise
        self.eps = eps
        self.num_perturbations = num_perturbations
        self.seed = int(seed)
        self.max_consecutive_skips = max_consecutive_skips
        self.zo_step = 0
        self.num_skipped = 0
        self.consecutive_skips = 0
        self.records: list[ZORecord] = []
        self._num_estimates = 0
        self._num_swept = 0  # estimates whose sweeps ran since the last step, counted here or not (another rank's)
        self._last_closure: Closure | None = None
        self._warned_empty_step = False
        self._update_hooks: OrderedDict[int, Callable] = OrderedDict()
        self.execution = ZOExecution()
        self._exact_restore = exact_restore
        self._build_parameters()
        if execution is not None:
            self.set_execution(execution)
        trainable_numel = sum(p.numel() for _, p in self.params.tensors)
        if cache_noise or (cache_noise is None and trainable_numel <= AUTO_CACHE_MAX_NUMEL):
            self.noise.enable_cache(CACHED_STEPS * trainable_numel)

    # ------------------------------------------------------------------ parameters

    def _build_parameters(self) -> None:
        with_indices = ["indices" in g for g in self.param_groups]
        if any(with_indices) and not all(with_indices):
            raise ValueError("Either every parameter group carries 'indices' or none does.")
        tensors, self._group_of = [], []
        next_index = 0
        for group_id, group in enumerate(self.param_groups):
            params = group["params"]
            if "indices" in group:
                if len(group["indices"]) != len(params):
                    raise ValueError(
                        f"Parameter group {group_id} has {len(params)} params but {len(group['indices'])} indices."
                    )
                indexed = zip(group["indices"], params)
            else:  # numbered as if only the trainable tensors had been passed
                trainable = [p for p in params if p.requires_grad]
                indexed = zip(range(next_index, next_index + len(trainable)), trainable)
                next_index += len(trainable)
            for index, param in indexed:
                if param.requires_grad:  # a frozen tensor is left alone, as torch.optim leaves one without a grad
                    tensors.append((int(index), param))
                    self._group_of.append(group_id)
        if not tensors:
            raise ValueError("The optimizer got no parameters: check that some have requires_grad=True.")
        self.noise.check_tensors(tensors)
        self.params = LazyParameters(tensors, self.noise)
        exact_restore = self._exact_restore
        low_precision = any(p.dtype in (torch.float16, torch.bfloat16) for _, p in tensors)
        if exact_restore and self.params.sharded:
            raise ValueError(
                "exact_restore=True (zo_exact_restore) restores the weights from a copy after the forwards, which "
                "FSDP2-sharded parameters cannot take between the forwards of the processes; keep fp32 weights "
                "(with bf16=True for autocast) and leave zo_exact_restore unset under FSDP2."
            )
        if exact_restore is None:
            small = sum(p.numel() for _, p in tensors) <= AUTO_CACHE_MAX_NUMEL
            exact_restore = low_precision and small and not self.params.sharded
        if low_precision and not exact_restore and self._exact_restore is None:  # not an explicit choice
            logger.warning(
                "Trainable fp16/bf16 weights are restored by subtracting the noise, which drifts them by about 0.1 "
                "ulp per step (see benchmarks/precision_drift.py). Keep fp32 weights and train with bf16=True "
                "(autocast), or set zo_exact_restore=True in ZOConfig (exact_restore=True for an optimizer built by "
                "hand; memory: one copy of the trainable weights; with zo_engine='dual', one block)."
            )
        self.sequential_estimator = SPSAEstimator(self.params, self.eps, exact_restore=exact_restore)
        self.estimator = self._estimator_slot(self.execution)

    # ------------------------------------------------------------------ execution

    def set_execution(self, execution: ZOExecution) -> None:
        """Run the estimates with `execution`'s engine and parallel layout from now on (what `ZOTrainer` and
        `hf_zo.parallel.DistZOPlugin.prepare_optimizer` give an optimizer built elsewhere).

        The pending move is applied first, with the engine that made it. Raises if this optimizer cannot run with
        them (:meth:`check_execution`; the layout's own :meth:`~hf_zo.parallel.ParallelEstimation.check`).
        """
        engine, parallel = execution.engine, execution.parallel
        if engine is not None:
            offloaded = getattr(engine, "offloader", None) is not None
            type(self).check_execution(engine="dual", offload=offloaded)
        if parallel is not None:
            parallel.check(self)
        if engine is not self.execution.engine:
            self.flush()
        self.execution = execution
        self.estimator = self._estimator_slot(execution)

    def _estimator_slot(self, execution: ZOExecution) -> Estimator:
        """The sequential estimator, or the engine of `execution` wrapping it."""
        engine = execution.engine
        return self.sequential_estimator if engine is None else engine.wrap(self.sequential_estimator)

    def attach_engine(self, engine) -> None:
        """Run the estimates and flushes with `engine` (e.g. `hf_zo.engine.DualEngine`), keeping the parallel
        layout: ``set_execution(ZOExecution(engine=engine, parallel=optimizer.parallel))``."""
        self.set_execution(ZOExecution(engine=engine, parallel=self.execution.parallel))

    @property
    def engine(self):
        """The engine the estimates run with (`execution.engine`), or `None` for the sequential estimator."""
        return self.execution.engine

    @property
    def parallel(self):
        """The parallel layout the estimates are shared with (`execution.parallel`), or `None` in one process."""
        return self.execution.parallel

    def add_param_group(self, param_group: dict) -> None:
        """Add a parameter group (see `torch.optim.Optimizer.add_param_group`)."""
        if getattr(self, "params", None) is not None and self.params.has_pending():
            raise RuntimeError("Cannot add a parameter group while an update is pending; call flush() first.")
        if getattr(self, "_update_hooks", None):
            raise RuntimeError(
                "Cannot add a parameter group while an update hook (e.g. a ZOTrajectory's recorder) is attached: it "
                "records the groups it was attached with. Add the group before attaching, or remove the hook first."
            )
        super().add_param_group(param_group)
        if getattr(self, "params", None) is not None:
            self._build_parameters()

    def group_values(self, key: str) -> list[float]:
        """The value of hyper-parameter `key` for each parameter, from its group."""
        return [self.param_groups[g][key] for g in self._group_of]

    # ------------------------------------------------------------------ estimate and step

    def perturbation_seed(self, step: int, k: int) -> int:
        """Seed of the `k`-th perturbation of optimizer step `step`: shared by every replica, never broadcast."""
        return mix_seed(self.seed, step, k)

    def estimate(self, closure: Closure) -> list[ZORecord]:
        """Run `num_perturbations` estimates on `closure` and keep their records for :meth:`step`.

        Returns the records that were kept (estimates with a non-finite loss are dropped with a warning).
        """
        parallel = self.execution.parallel
        if parallel is not None:
            losses = parallel.run_forwards(self, closure, self._num_estimates // self.num_perturbations)
            self.params.commit()  # every rank has made the same sweeps: FSDP2's shards take them
        else:
            losses = self.run_forwards(closure, self._num_estimates)
        return self.keep_estimates(self.records_from(losses), closure)

    def run_forwards(
        self, closure: Closure | None, first: int, signs: Callable[[int], tuple[int, ...]] | None = None
    ) -> list[EstimateLosses]:
        """The sweeps and forwards of one micro-batch's `num_perturbations` estimates, those numbered `first`,
        `first + 1`, ... in this step, through the estimator slot.

        Args:
            closure (`Callable`, *optional*):
                The micro-batch's loss. `None` for a micro-batch another process runs (`hf_zo.parallel`): the
                parameters go through the same sweeps without a forward, and the estimates are not counted here.
            first (`int`): the step's number of the first estimate, which seeds its perturbation.
            signs (`Callable`, *optional*): ``signs(j)``, the forwards of the `j`-th estimate this process runs
                (a perturbation-parallel group shares them); default: all.

        Returns:
            `list[EstimateLosses]`: one per estimate; NaN for the forwards not run here.
        """
        losses = []
        for j in range(self.num_perturbations):
            seed = self._start_estimate(first + j, counted=closure is not None)
            center = self.estimator.center_forward(closure) if self.needs_center_loss else None
            run = () if closure is None else (signs(j) if signs is not None else BOTH_SIGNS)
            plus, minus = self.estimator.signed_forwards(closure, seed, run)
            losses.append(EstimateLosses(seed, plus, minus, center))
        return losses

    def _start_estimate(self, k: int, counted: bool) -> int:
        """The seed of estimate `k` of this step, counted among this process's estimates if `counted`."""
        self._num_swept += 1
        if counted:
            self._num_estimates += 1
        return self.perturbation_seed(self.zo_step, k)

    def records_from(self, losses: list[EstimateLosses]) -> list[ZORecord | None]:
        """The records of a micro-batch's estimates (`None` with a warning for one with a non-finite loss)."""
        return [make_record(e.seed, e.loss_plus, e.loss_minus, self.eps, e.loss_center) for e in losses]

    def keep_estimates(self, estimates: list[ZORecord | None], closure: Closure | None) -> list[ZORecord]:
        """Keep the records of `estimates` for :meth:`step`, counting the dropped ones (`None`) as skips.

        Returns the records kept.
        """
        kept = []
        for record in estimates:
            if record is None:
                self._count_skip()
            else:
                self.consecutive_skips = 0
                kept.append(record)
        self.records.extend(kept)
        self._last_closure = closure
        return kept

    def _count_skip(self) -> None:
        self.num_skipped += 1
        self.consecutive_skips += 1
        if self.max_consecutive_skips is not None and self.consecutive_skips >= self.max_consecutive_skips:
            self.flush()  # the weights the user may save after catching this are the restored ones
            raise FloatingPointError(
                f"{self.consecutive_skips} consecutive ZO estimates had a non-finite loss (at optimizer step "
                f"{self.zo_step}). Lower the learning rate or zo_eps, train in fp32/bf16 instead of fp16, or check "
                "the data for empty or corrupt examples."
            )

    @torch.no_grad()
    def step(self, closure: Closure | None = None) -> float | None:
        """Apply the accumulated records as one update (estimating first on `closure` if given).

        Returns the mean perturbed loss of this step's records, or `None` if there were none.
        """
        if closure is not None:
            self.estimate(closure)
        elif self._num_swept == 0 and not self.records and not self._warned_empty_step:
            # Not when the sweeps ran without forwards here and the records came from elsewhere (a peer's
            # micro-batches, a replayed trajectory): only a training loop that forgot its closure updates nothing.
            self._warned_empty_step = True
            logger.warning(
                "%s.step() was called without a closure and with no estimate since the last step, so it updates "
                "nothing (a ZO step takes no gradients from loss.backward()). Pass the loss closure, "
                "optimizer.step(closure), or call optimizer.estimate(closure) for each micro-batch first.",
                type(self).__name__,
            )
        records, self.records = self.records, []
        if self.execution.parallel is not None:
            records = self.execution.parallel.gather_records(self, records)
        loss = sum(r.loss for r in records) / len(records) if records else None
        if records:
            self._apply_records(records)
        if self._update_hooks:
            seeds = [self.perturbation_seed(self.zo_step, k) for k in range(self._num_estimates)]
            for hook in list(self._update_hooks.values()):
                hook(self, self.zo_step, seeds, records)
        self._num_estimates = self._num_swept = 0
        self.zo_step += 1
        return loss

    @property
    def num_pending_estimates(self) -> int:
        """The estimates this process has run since the last step (skipped ones included)."""
        return self._num_estimates

    @torch.no_grad()
    def discard_step(self) -> None:
        """End the current step without an update: for an accumulation that is cut short.

        `ZOTrainer` calls it when a callback stops training or the epoch between two optimizer steps (where
        `Trainer` leaves a first-order run's partial gradients unused). The records kept since the last
        :meth:`step` are dropped, and the step counter advances as :meth:`step` advances it: the update hooks get the
        seeds of the estimates that ran (their sweeps moved the parameters by rounding, as skipped estimates' do)
        with no records, so a trajectory records a step without an update and still replays the weights bitwise,
        and the next step draws new seeds.
        """
        self.records = []
        self.step()

    @abstractmethod
    def _apply_records(self, records: list[ZORecord]) -> None:
        """Turn this step's records into a parameter update. Subclasses implement the method."""

    def register_update_hook(
        self, hook: Callable[[ZOOptimizer, int, list[int], list[ZORecord]], None]
    ) -> RemovableHandle:
        """Register ``hook(optimizer, step, seeds, records)``, called by :meth:`step` right after each update.

        `step` is the optimizer step just applied, `seeds` the seeds of all its local estimates in order (those
        skipped for a non-finite loss included: they moved the parameters too) and `records` the records the update
        used; `param_groups` still hold the lr and weight decay it used. :class:`hf_zo.ZOTrajectory` records runs
        this way.

        Returns:
            `torch.utils.hooks.RemovableHandle`: call its `remove()` to unregister the hook.
        """
        handle = RemovableHandle(self._update_hooks)
        self._update_hooks[handle.id] = hook
        return handle

    def flush(self) -> None:
        """Apply any pending (fused, deferred) move so the parameters hold their true values."""
        self.estimator.flush()
        self.params.commit()

    # ------------------------------------------------------------------ state

    def state_dict(self) -> dict:
        """The `torch.optim` state plus the ZO counters (base seed, step, skips) needed for exact resume."""
        if self.records:
            raise RuntimeError(
                f"Cannot save the optimizer in the middle of an accumulation ({len(self.records)} records wait for "
                "step()): call step() first, or discard_step() to drop them."
            )
        if self.params.has_pending():
            raise RuntimeError(
                "Cannot save the optimizer while an update is pending: the weights do not hold it yet, so a run "
                "resumed from this state and those weights would differ. Call flush() first, then save the model and "
                "the optimizer."
            )
        state = super().state_dict()
        state["zo"] = {
            "optimizer": type(self).__name__,
            "seed": self.seed,
            "step": self.zo_step,
            "eps": self.eps,
            "noise": self.noise.distribution,
            "noise_algorithm": self.noise.algorithm,
            "stochastic_rounding": self.noise.stochastic_rounding,
            "num_perturbations": self.num_perturbations,
            "num_skipped": self.num_skipped,
            "consecutive_skips": self.consecutive_skips,
        }
        return state

    def load_state_dict(self, state_dict: dict) -> None:
        """Restore a state saved by :meth:`state_dict` of the same optimizer class."""
        zo = state_dict.get("zo")
        if zo is None:
            raise ValueError(
                "This optimizer state has no 'zo' entry: it was not saved by a ZO optimizer. Resume from a checkpoint "
                "written by ZOTrainer, or start without resume_from_checkpoint."
            )
        if zo["optimizer"] != type(self).__name__:
            raise ValueError(
                f"The checkpoint was written by {zo['optimizer']} but this run uses {type(self).__name__}; resume "
                "with the same zo_optimizer."
            )
        if zo["noise"] != self.noise.distribution:
            raise ValueError(
                f"The checkpoint used zo_noise={zo['noise']!r} but this run uses {self.noise.distribution!r}; resume "
                "with the same zo_noise."
            )
        self._use_recorded_noise_algorithm(zo.get("noise_algorithm", LEGACY_NOISE_ALGORITHM))
        if zo.get("stochastic_rounding", False) != self.noise.stochastic_rounding:
            raise ValueError(
                f"The checkpoint was trained with zo_stochastic_rounding={zo.get('stochastic_rounding', False)} but "
                f"this run uses {self.noise.stochastic_rounding}; resume with the same zo_stochastic_rounding (or "
                "start a new run from the checkpoint's weights)."
            )
        super().load_state_dict({k: v for k, v in state_dict.items() if k != "zo"})
        self.seed = int(zo["seed"])
        self.zo_step = int(zo["step"])
        self.num_skipped = int(zo["num_skipped"])
        self.consecutive_skips = int(zo["consecutive_skips"])
        self.records, self._num_estimates, self._num_swept = [], 0, 0

    def _use_recorded_noise_algorithm(self, recorded: str) -> None:
        """Continue a checkpoint with the noise algorithm it was trained with, or refuse with the reason."""
        if recorded == self.noise.algorithm:
            return
        if recorded not in NOISE_ALGORITHMS:
            raise ValueError(
                f"The checkpoint's noise was generated by the algorithm {recorded!r}, which this hf_zo does not know "
                f"(it knows {NOISE_ALGORITHMS}); resume with the hf_zo version that wrote it or a newer one."
            )
        if not self.noise.algorithm_is_automatic and self.noise.distribution != "table":  # the table ignores it
            raise ValueError(
                f"The checkpoint's noise was generated by the {recorded!r} algorithm but this run asks for "
                f"zo_noise_algorithm={self.noise.algorithm!r}; the noise would differ from the recorded run. Resume "
                f"with zo_noise_algorithm={recorded!r} (or 'auto', which follows the checkpoint)."
            )
        logger.info("Resuming with the checkpoint's noise algorithm %r.", recorded)
        self.noise.use_algorithm(recorded)


def _device_type(param_groups: list[dict]) -> str:
    """Where the first parameter lives ("cpu" if there is none: the error about it comes later)."""
    first = next((p for group in param_groups for p in group["params"]), None)
    return first.device.type if first is not None else "cpu"


def mean_projected_grads(records: list[ZORecord]) -> list[tuple[int, float]]:
    """``(seed, projected_grad / n)`` for each record: the weights of ``z(seed)`` in the averaged gradient."""
    n = len(records)
    return [(r.seed, r.projected_grad / n) for r in records]
