"""`ZOConfig`: the training arguments of `ZOTrainer`."""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields

import torch
from transformers import TrainingArguments
from transformers.utils import logging

from ..engine import ZO_ENGINES
from ..noise import NOISE_ALGORITHMS, NOISE_DISTRIBUTIONS
from ..offload import OFFLOAD_DTYPES, OFFLOAD_TIERS
from ..optim import ZO_OPTIMIZERS
from ..optim.base import check_eps
from ..parallel.estimation import check_perturbation_parallel_size
from ..parallel.plugin import check_sliced_upload

logger = logging.get_logger(__name__)

HEAD_INIT_CHOICES = ("auto", "none", "linear_probe")
"""The values of `ZOConfig.zo_head_init` (what they do: `hf_zo.heads`)."""

HEAD_TRAINING_CHOICES = ("auto", "zeroth_order", "first_order")
"""The values of `ZOConfig.zo_head_training` (what they do: `hf_zo.heads`)."""

_TRAINER_DEFAULT_OPTIM = next(f.default for f in fields(TrainingArguments) if f.name == "optim")


@dataclass
class ZOConfig(TrainingArguments):
    r"""
    Configuration class for [`ZOTrainer`]: every argument of `transformers.TrainingArguments`, plus the `zo_*`
    arguments below. Use `HfArgumentParser(ZOConfig)` to turn it into command-line arguments.

    Parameters that control the zeroth-order estimate:

        zo_eps (`float`, *optional*):
            Perturbation scale `eps` of the two-point estimate `(L(θ + eps z) - L(θ - eps z)) / (2 eps)`. Default:
            by what the model trains (`hf_zo.training.defaults`), MeZO's 1e-3 for all weights, 1e-2 for LoRA and 1e-1
            for prefix and prompt tuning, and 1e-3 for the norm layers (PEFT's LN tuning).
        zo_num_perturbations (`int`, *optional*, defaults to `1`):
            Perturbations `q` per micro-batch; each costs two forward passes. Gradient accumulation adds more.
        zo_noise (`str`, *optional*, defaults to `"gaussian"`):
            Perturbation distribution: `"gaussian"`, `"rademacher"`, or `"table"` (slices of one pre-generated
            Gaussian table: near-zero generation cost).
        zo_noise_algorithm (`str`, *optional*, defaults to `"auto"`):
            How gaussian and rademacher noise is computed: `"philox"` (Philox-4x32-10 + Box-Muller; a compiled CPU
            kernel fused into the sweeps, the same bits on every device), `"torch"` (PyTorch's generator per block,
            hf_zo's only algorithm before `"philox"`; bits depend on the device type) or `"auto"` (`"philox"` on the
            CPU when its kernel builds, else `"torch"`; on resume, the checkpoint's algorithm). Checkpoints
            and trajectories record the algorithm, so resume and replay regenerate the same noise. See
            docs/noise.md.
        zo_noise_cache (`bool`, *optional*):
            Keep each step's noise in memory instead of regenerating it in the next sweeps (memory: a few times the
            trainable size). Default: on when the trainable parameters are small (at most 4M elements, typical of
            PEFT), off otherwise.
        zo_seed (`int`, *optional*):
            Base seed of the perturbations (default: `seed`). Every perturbation's seed derives from it and the
            step counter, so replicas, resumes and replays regenerate the same noise without communication.

    Parameters that control the update:

        zo_optimizer (`str`, *optional*, defaults to `"zo_sgd"`):
            One of `"zo_sgd"` (MeZO), `"zo_sgd_momentum"`, `"zo_sgd_sign"`, `"zo_sgd_cons"` (conservative),
            `"zo_adam"`, `"lozo"` (MeZO's update with low-rank perturbations), `"fzoo"` (one-sided Rademacher
            estimates around the centre loss, step normalised by their spread; needs `zo_num_perturbations >= 2`;
            the paper perturbs with `zo_noise="rademacher"`) or `"hizoo"` (MeZO's update along
            perturbations preconditioned by a diagonal curvature estimate; three forwards per estimate, needs
            `zo_engine="sequential"` and `zo_perturbation_parallel_size=1`). Learning rate, weight decay (not applied
            to biases and norm weights), `adam_beta1`, `adam_beta2` and `adam_epsilon` come from the usual
            `TrainingArguments` fields.
        zo_momentum (`float`, *optional*, defaults to `0.9`):
            Momentum of `"zo_sgd_momentum"`.
        zo_lozo_rank (`int`, *optional*, defaults to `2`):
            Rank of each weight matrix's perturbation with `"lozo"` (low-rank ZO, arXiv 2410.07698).
        zo_lozo_subspace_steps (`int`, *optional*, defaults to `50`):
            Optimizer steps that share the right factor of `"lozo"`'s perturbations (LOZO's lazy sampling period).
        zo_hizoo_smooth (`float`, *optional*, defaults to `1e-6`):
            Smoothing `alpha` in `[0, 1)` of `"hizoo"`'s curvature estimate `H` (HiZOO, arXiv 2402.15173): each step
            `H <- H * (1 - alpha + alpha * mean_i(c_i z_i^2))`. 0 keeps `H = 1`.
        zo_max_consecutive_skips (`int`, *optional*, defaults to `10`):
            Estimates with a non-finite loss are skipped (parameters restored, warning logged); after this many in a
            row training stops with an error naming the step.

    Parameters that control the classification head (a new head is where ZO struggles most):

        zo_head_init (`str`, *optional*, defaults to `"auto"`):
            `"linear_probe"` fits the head on frozen features before ZO starts (a logistic regression written into
            the head's last `nn.Linear`, MeZO's LP-then-MeZO); `"none"` keeps it as loaded; `"auto"` is
            `"linear_probe"` for a `*ForSequenceClassification` model and `"none"` otherwise.
        zo_head_training (`str`, *optional*, defaults to `"auto"`):
            `"first_order"` trains the head with exact gradients (AdamW on the head only, inside the ZO forwards)
            while the body stays zeroth-order; `"zeroth_order"` leaves the head in the ZO parameter set; `"auto"` is
            `"first_order"` for a `*ForSequenceClassification` model and `"zeroth_order"` otherwise.
        zo_head_modules (`list[str]`, *optional*):
            Names of the head modules (matched against the end of module names, e.g. `classifier`). Default: the
            last trainable `nn.Linear` with `out_features == num_labels`. With PEFT, put the head in
            `modules_to_save`.
        zo_head_learning_rate (`float`, *optional*, defaults to `1e-3`):
            AdamW learning rate of the first-order head. It follows `lr_scheduler_type` (warm-up, decay) with the
            ZO learning rate: the head steps at this value times the schedule's factor.
        zo_head_init_max_samples (`int`, *optional*, defaults to `16384`):
            Training examples the linear probe is fitted on (one forward pass each), drawn at random: seeded by
            `seed`, the same on every process, so that a data set sorted by length or grouped by label still gives
            a sample of the task (all of it when it is smaller or has no length), then ordered by length when the
            set is tokenized (an `input_ids` column), so that the probe's batches carry little padding. More
            examples fit a better probe and cost one forward each (docs/results/accuracy.md). The probe runs before
            the first step, with a progress bar; on long inputs it takes minutes, and a smaller value starts
            training sooner.
        zo_head_init_l2 (`float`, *optional*):
            L2 penalty of the linear probe on standardised features. By default it is chosen among
            `hf_zo.heads.PROBE_L2_GRID` by 3-fold cross-validation on the probe's examples (a few seconds): the
            best penalty shrinks as examples grow, and a fixed small one over-fits a few hundred examples
            (docs/results/accuracy.md).

    Parameters that control the distributed layout (DistZO2, see `hf_zo.parallel.DistZOPlugin`):

        zo_perturbation_parallel_size (`int`, *optional*, defaults to `1`):
            Processes per perturbation-parallel group: they see the same batch and split its `2 * zo_num_perturbations`
            signed forwards (so it must divide that number); the launched processes form `processes / p` data-parallel
            groups that see different batches. Replicas exchange only scalars and are never wrapped in DDP. Left at 1,
            the `HF_ZO_PERTURBATION_PARALLEL_SIZE` environment variable applies. `ddp_timeout` bounds every collective.
        zo_verify_replicas_steps (`int`, *optional*, defaults to `500`):
            After the first optimizer step, every this many steps and at the end of training, the processes compare a
            checksum of their trainable parameters (8 bytes each) and stop with an error naming the step if the
            replicas are no longer bit-identical (one read of the trainable parameters per check). 0 never checks.
            Whatever its value, a multi-process run starts from rank 0's parameters and buffers: every tensor that
            differs between the processes when `ZOTrainer` is built or training starts is broadcast from rank 0.

    Parameters that control the execution engine and offload (ZO2):

        zo_engine (`str`, *optional*, defaults to `"sequential"`):
            `"sequential"` runs the whole model at `θ + eps z`, then at `θ - eps z` (any model). `"dual"` runs both
            forwards together, one repeated block at a time (found from `_no_split_modules`), so each block is
            perturbed, used by both and restored while it is resident: same losses and weights as `"sequential"`
            (bitwise in fp32), and the schedule that offload needs. Activation memory is that of a doubled batch.
        zo_reuse_frozen_prefix (`bool`, *optional*, defaults to `True`):
            With `"sequential"`: the repeated blocks before the first one ZO perturbs (LoRA on the upper layers
            only, for instance) run in the first forward of each micro-batch, and the later forwards of its
            estimates reuse their outputs (`hf_zo.engine.FrozenPrefix`): exact, the losses and weights bitwise those
            of running every block. Off when a perturbed tensor lies outside the blocks (embeddings, prompt
            encoders). Memory: one hidden state of the micro-batch per reused block.
        zo_exact_restore (`bool`, *optional*):
            Restore the weights after the two forwards from a saved copy instead of subtracting the perturbation:
            exact in bf16/fp16 (no drift), no longer bitwise equal to subtracting in fp32. `"sequential"` copies the
            trainable tensors (memory: their size), `"dual"` one block at a time. Default (`None`): on, with either
            engine, when a trainable tensor is fp16/bf16 and the trainable tensors total at most 4M elements (PEFT);
            else off (with a warning about the drift when some trainable tensor is fp16/bf16). The optimizer makes
            this choice and the `"dual"` engine follows it.
        zo_stochastic_rounding (`bool`, *optional*, defaults to `False`):
            Round the sweeps of bfloat16 trainable weights stochastically instead of to the nearest, so that updates
            smaller than half a unit in the last place (MeZO's rates on bf16 weights: lr * g * z about 1e-6 against a
            weight near 0.02) are kept in expectation instead of lost. Its random bits are counter-based noise, so
            resume and replay stay bitwise. For full fine-tuning of bf16 weights, with `zo_exact_restore=True`
            (`"dual"`: one block copied). fp32 weights are unaffected; fp16 weights are refused.
        zo_offload (`str`, *optional*):
            Keep the blocks in `"cpu"` memory (pinned when CUDA is available) or on `"disk"` (memory-mapped
            safetensors files) and stream them to the working device; needs `zo_engine="dual"` and
            `zo_optimizer="zo_sgd"` (whose updates wait until each block arrives). The other modules stay resident.
            `bf16_full_eval`/`fp16_full_eval` are refused with it (use `bf16=True`).
        zo_offload_dir (`str`, *optional*):
            Directory of the `"disk"` tier (default: the system's temporary directory), created if missing. The
            block files go in a new, uniquely named folder of their own inside it (`hf_zo-offload-XXXXXXXX`, one per
            process), removed when the offloaded model is released or at exit; files already there are never
            touched.
        zo_offload_prefetch (`int`, *optional*, defaults to `1`):
            Blocks loaded ahead of the one computing; peak block memory on the working device is `prefetch + 1`
            blocks.
        zo_offload_dtype (`str`, *optional*):
            Storage and transfer dtype (`"float32"`, `"bfloat16"`, `"float16"`) of *frozen* block tensors (e.g. PEFT
            base weights), upcast on arrival. Trainable tensors always keep full-precision masters.
        zo_offload_sliced_upload (`bool`, *optional*, defaults to `False`):
            DistZO2's sliced upload: the `p` ranks of a perturbation-parallel group each move `1/p` of every block
            from their storage tier and all-gather the block over the device interconnect (NCCL on GPUs, gloo on
            CPU). Needs `zo_offload` and `zo_perturbation_parallel_size` (or `HF_ZO_PERTURBATION_PARALLEL_SIZE`)
            above 1. Same weights as without it, bit for bit.

    Mixed precision:

        bf16 (`bool`, defaults to `False`):
            Runs the forwards under bf16 autocast, as in `Trainer`; the weights (and the perturbations) stay in their
            own dtype. ZO needs no loss scaling, and bf16 gets none.
        fp16 (`bool`, defaults to `False`):
            Refused, as is `ACCELERATE_MIXED_PRECISION="fp16"` (`accelerate launch --mixed_precision fp16`): fp16
            mixed precision makes Accelerate wrap the optimizer in a `GradScaler`, which fails at the first step
            unless `scaler.scale(loss).backward()` ran, and ZO runs no backward. Use `bf16=True`, fp32, or fp16
            weights (load the model with `dtype=torch.float16` and leave `fp16` off; see `zo_exact_restore`).

    Defaults changed from `TrainingArguments`:

        learning_rate (`float`, *optional*):
            Default: by what the model trains, the loss and the optimizer, from the one table of defaults
            (`hf_zo.training.defaults`, docs/hyperparameters.md), since ZO learning rates differ by orders of
            magnitude between methods: MeZO's 1e-6 without PEFT (all weights), 1e-4 for LoRA, 1e-3 for prefix and
            prompt tuning, 3e-4 for the norm layers (PEFT's LN tuning); other values on a prompt's label words.
            `ZOTrainer` fills it in (and `zo_eps`) when it gets the model; another PEFT method needs both set.
        max_grad_norm (`float`, defaults to `0.0`):
            ZO has no gradients to clip; any value is a no-op.
        lr_scheduler_type (`str`, defaults to `"constant"`):
            MeZO trains with a constant learning rate.
        train_sampling_strategy (`str`, defaults to `"group_by_length"`):
            Training batches of similar length (`hf_zo.training.sampling.ZOLengthGroupedSampler`): a ZO step is two
            forward passes over a padded batch, and ZO takes many steps (the time saved: docs/results/accuracy.md).
            The order depends only on
            the seed, the epoch and the global batch, so data parallelism equals gradient accumulation and resume is
            exact. Without a length per example (a `length_column_name` column or the tokenizer's first input in
            every example) batches are drawn at random, with a warning. On one process evaluation batches run
            longest first (`hf_zo.training.sampling.LengthSortedSampler`) and `predict` returns its rows in the
            data set's order. `"random"` is `Trainer`'s default.
        average_tokens_across_devices (`bool`, defaults to `False`):
            A ZO loss is the mean over its micro-batch, so the per-step all-gather of token counts is not needed.
        dataloader_pin_memory (`bool`, defaults to `True`):
            Turned off when torch sees no accelerator: pinned memory only speeds up copies to one, and without one
            torch warns about it on every dataloader (training, the linear probe, each evaluation).
    """

    zo_eps: float | None = field(
        default=None, metadata={"help": "Perturbation scale eps of the two-point estimate (default: by method)."}
    )
    zo_num_perturbations: int = field(default=1, metadata={"help": "Perturbations q per micro-batch."})
    zo_noise: str = field(
        default="gaussian", metadata={"help": "Noise distribution.", "choices": list(NOISE_DISTRIBUTIONS)}
    )
    zo_noise_algorithm: str = field(
        default="auto",
        metadata={
            "help": "Noise algorithm (auto: philox if its kernel builds, else torch).",
            "choices": ["auto", *NOISE_ALGORITHMS],
        },
    )
    zo_noise_cache: bool | None = field(
        default=None, metadata={"help": "Cache each step's noise (default: on for small trainable sets)."}
    )
    zo_seed: int | None = field(default=None, metadata={"help": "Base seed of the perturbations (default: seed)."})
    zo_optimizer: str = field(default="zo_sgd", metadata={"help": "ZO optimizer.", "choices": list(ZO_OPTIMIZERS)})
    zo_momentum: float = field(default=0.9, metadata={"help": "Momentum of zo_sgd_momentum."})
    zo_lozo_rank: int = field(default=2, metadata={"help": "Rank of lozo's matrix perturbations."})
    zo_lozo_subspace_steps: int = field(
        default=50, metadata={"help": "Steps sharing lozo's right factor (lazy subspace)."}
    )
    zo_hizoo_smooth: float = field(default=1e-6, metadata={"help": "Smoothing alpha of hizoo's curvature estimate."})
    zo_max_consecutive_skips: int = field(
        default=10, metadata={"help": "Stop after this many consecutive non-finite losses."}
    )
    zo_head_init: str = field(
        default="auto", metadata={"help": "Head initialisation before ZO.", "choices": list(HEAD_INIT_CHOICES)}
    )
    zo_head_training: str = field(
        default="auto", metadata={"help": "How the head is trained.", "choices": list(HEAD_TRAINING_CHOICES)}
    )
    zo_head_modules: list[str] | None = field(default=None, metadata={"help": "Names of the head modules."})
    zo_head_learning_rate: float = field(default=1e-3, metadata={"help": "AdamW lr of the first-order head."})
    zo_head_init_max_samples: int | None = field(
        default=16384, metadata={"help": "Training examples the linear probe is fitted on."}
    )
    zo_head_init_l2: float | None = field(
        default=None,
        metadata={"help": "L2 penalty of the linear probe (default: chosen by 3-fold cross-validation)."},
    )
    zo_perturbation_parallel_size: int = field(
        default=1, metadata={"help": "Processes per perturbation-parallel group (they share a batch)."}
    )
    zo_verify_replicas_steps: int = field(
        default=500,
        metadata={"help": "Compare the replicas' checksums after step 1, every N steps and at the end (0: never)."},
    )
    zo_engine: str = field(
        default="sequential", metadata={"help": "How the two forwards run.", "choices": list(ZO_ENGINES)}
    )
    zo_reuse_frozen_prefix: bool = field(
        default=True,
        metadata={"help": "Run the frozen blocks before the first perturbed one once per micro-batch (sequential)."},
    )
    zo_exact_restore: bool | None = field(
        default=None, metadata={"help": "Restore weights from a copy (no bf16/fp16 drift); default: auto."}
    )
    zo_stochastic_rounding: bool = field(
        default=False, metadata={"help": "Round bf16 weights' updates stochastically, so small updates are kept."}
    )
    zo_offload: str | None = field(
        default=None, metadata={"help": "Offload blocks to this tier.", "choices": list(OFFLOAD_TIERS)}
    )
    zo_offload_dir: str | None = field(default=None, metadata={"help": "Directory of the disk tier."})
    zo_offload_prefetch: int = field(default=1, metadata={"help": "Blocks loaded ahead of the one computing."})
    zo_offload_dtype: str | None = field(
        default=None, metadata={"help": "Dtype of frozen offloaded tensors.", "choices": list(OFFLOAD_DTYPES)}
    )
    zo_offload_sliced_upload: bool = field(
        default=False, metadata={"help": "PertP ranks each upload 1/p of a block and all-gather it (DistZO2)."}
    )
    learning_rate: float | None = field(
        default=None,
        metadata={
            "help": "ZO learning rate (default: by method: 1e-6 full, 1e-4 LoRA (2e-3 on label words, 4e-3 on q_proj "
            "alone), 3e-4 LN)."
        },
    )
    max_grad_norm: float = field(default=0.0, metadata={"help": "ZO has no gradients to clip."})
    lr_scheduler_type: str = field(default="constant", metadata={"help": "The scheduler type to use."})
    train_sampling_strategy: str = field(
        default="group_by_length",
        metadata={
            "help": "Sampler for training: 'group_by_length' (default: batches of similar length, little padding; "
            "evaluation batches longest first), "
            "'random', 'sequential' or 'batch_rebalance'.",
            "choices": ["group_by_length", "random", "sequential", "batch_rebalance"],
        },
    )
    average_tokens_across_devices: bool = field(
        default=False, metadata={"help": "ZO losses are micro-batch means: no token counts are gathered."}
    )

    def __post_init__(self):
        self._validate_zo_arguments()
        if self.zo_seed is None:
            self.zo_seed = self.seed
        if not self.use_cpu and int(os.environ.get("WORLD_SIZE", "1")) > 1 and not _has_accelerator():
            # Launched as several processes on a machine without an accelerator (e.g. `accelerate launch` with a
            # multi-GPU config on CPUs): without this, Accelerate would set up a single-process state in each
            # process, so evaluation, logging and saving would not be coordinated between them.
            self.use_cpu = True
        if self.dataloader_pin_memory and not torch.accelerator.is_available():
            # Pinned memory only speeds up copies to an accelerator; without one torch warns on every dataloader.
            self.dataloader_pin_memory = False
        if self.optim != _TRAINER_DEFAULT_OPTIM:
            logger.warning(
                "optim=%r chooses Trainer's first-order optimizer, which ZOTrainer does not use: the weights are "
                "trained by zo_optimizer=%r (and a new head's first-order part by AdamW).",
                str(getattr(self.optim, "value", self.optim)),
                self.zo_optimizer,
            )
        if self.neftune_noise_alpha is not None:
            logger.warning(
                "neftune_noise_alpha=%r is ignored: NEFTune adds its noise only in train mode, and ZO's forwards run "
                "in eval mode (docs/how_zo_works.md).",
                self.neftune_noise_alpha,
            )
        super().__post_init__()

    def _validate_zo_engine_arguments(self) -> None:
        if self.zo_engine not in ZO_ENGINES:
            raise ValueError(f"Unknown zo_engine {self.zo_engine!r}; choose one of {list(ZO_ENGINES)}.")
        if self.zo_offload is None:
            check_sliced_upload(self.zo_offload_sliced_upload, offload=None)
            if self.zo_offload_dir is not None:
                raise ValueError(
                    f"zo_offload_dir={self.zo_offload_dir!r} is set but zo_offload is None; set "
                    "zo_offload='disk' or drop zo_offload_dir."
                )
            return
        if self.zo_offload not in OFFLOAD_TIERS:
            raise ValueError(f"Unknown zo_offload {self.zo_offload!r}; choose one of {list(OFFLOAD_TIERS)} or None.")
        if self.zo_engine != "dual":
            raise ValueError(
                f"zo_offload={self.zo_offload!r} needs zo_engine='dual' (got {self.zo_engine!r}): only "
                "the dual engine visits each block once per estimate."
            )
        if self.zo_offload_dir is not None and self.zo_offload != "disk":
            raise ValueError(f"zo_offload_dir is only used by zo_offload='disk', got zo_offload={self.zo_offload!r}.")
        if self.bf16_full_eval or self.fp16_full_eval:
            flag = "bf16_full_eval" if self.bf16_full_eval else "fp16_full_eval"
            raise ValueError(
                f"{flag}=True casts the model for evaluation, but zo_offload={self.zo_offload!r} keeps the blocks' "
                "fp32 training copies in its storage tier, which a cast cannot reach. Drop it (bf16=True evaluates "
                "under bf16 autocast, which works with offload), or load the model in the dtype to evaluate in."
            )
        if not isinstance(self.zo_offload_prefetch, int) or self.zo_offload_prefetch < 0:
            raise ValueError(f"zo_offload_prefetch must be an integer >= 0, got {self.zo_offload_prefetch!r}.")
        if self.zo_offload_dtype is not None and self.zo_offload_dtype not in OFFLOAD_DTYPES:
            raise ValueError(
                f"Unknown zo_offload_dtype {self.zo_offload_dtype!r}; choose one of {list(OFFLOAD_DTYPES)} or None."
            )

    def _validate_mixed_precision(self) -> None:
        # TrainingArguments takes the mixed precision from fp16/bf16, else from the launcher's environment variable.
        from_env = os.environ.get("ACCELERATE_MIXED_PRECISION", "no")
        if self.fp16:
            source = "fp16=True"
        elif not self.bf16 and from_env == "fp16":
            source = (
                "ACCELERATE_MIXED_PRECISION='fp16' (from `accelerate launch --mixed_precision fp16` or the config)"
            )
        else:
            return
        raise ValueError(
            f"{source} asks for fp16 mixed precision, for which Accelerate wraps the optimizer in a GradScaler that "
            "only works after scaler.scale(loss).backward(); ZO training runs forward passes only, so the first "
            "optimizer step would fail. ZO needs no loss scaling: use bf16=True (autocast without a scaler), or fp32 "
            "(leave fp16 off"
            + (", and launch with --mixed_precision no or bf16" if source != "fp16=True" else "")
            + "), or train fp16 weights by loading the model with dtype=torch.float16 and leaving fp16 off."
        )

    def _validate_zo_arguments(self) -> None:
        self._validate_mixed_precision()
        self._validate_zo_engine_arguments()
        if self.output_dir is not None and os.path.isfile(self.output_dir):
            raise ValueError(
                f"output_dir {self.output_dir!r} is a file; checkpoints and the model are saved into a folder: give a "
                "new or existing folder."
            )
        if self.zo_eps is not None:
            check_eps(self.zo_eps, "zo_eps")
        if self.learning_rate is not None and not (
            isinstance(self.learning_rate, (int, float)) and self.learning_rate >= 0
        ):
            raise ValueError(
                f"learning_rate must be >= 0, got {self.learning_rate!r}; MeZO uses 1e-6 (full) to 1e-3 (prefix), "
                "and left unset it follows the model's method."
            )
        if self.zo_optimizer not in ZO_OPTIMIZERS:
            raise ValueError(f"Unknown zo_optimizer {self.zo_optimizer!r}; choose one of {sorted(ZO_OPTIMIZERS)}.")
        if self.zo_noise not in NOISE_DISTRIBUTIONS:
            raise ValueError(f"Unknown zo_noise {self.zo_noise!r}; choose one of {list(NOISE_DISTRIBUTIONS)}.")
        if self.zo_noise_algorithm not in ("auto", *NOISE_ALGORITHMS):
            raise ValueError(
                f"Unknown zo_noise_algorithm {self.zo_noise_algorithm!r}; choose 'auto' or one of "
                f"{list(NOISE_ALGORITHMS)}."
            )
        if not isinstance(self.zo_stochastic_rounding, bool):
            raise ValueError(f"zo_stochastic_rounding must be True or False, got {self.zo_stochastic_rounding!r}.")
        for name in ("per_device_train_batch_size", "per_device_eval_batch_size", "gradient_accumulation_steps"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:  # TrainingArguments leaves these to fail in the data loader
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}.")
        if not isinstance(self.zo_num_perturbations, int) or self.zo_num_perturbations < 1:
            raise ValueError(f"zo_num_perturbations must be an integer >= 1, got {self.zo_num_perturbations!r}.")
        if not 0.0 <= self.zo_momentum < 1.0:
            raise ValueError(f"zo_momentum must be in [0, 1), got {self.zo_momentum!r}.")
        if not isinstance(self.zo_lozo_rank, int) or self.zo_lozo_rank < 1:
            raise ValueError(f"zo_lozo_rank must be an integer >= 1, got {self.zo_lozo_rank!r}.")
        if not isinstance(self.zo_lozo_subspace_steps, int) or self.zo_lozo_subspace_steps < 1:
            raise ValueError(f"zo_lozo_subspace_steps must be an integer >= 1, got {self.zo_lozo_subspace_steps!r}.")
        if self.zo_head_init not in HEAD_INIT_CHOICES:
            raise ValueError(f"Unknown zo_head_init {self.zo_head_init!r}; choose one of {list(HEAD_INIT_CHOICES)}.")
        if self.zo_head_training not in HEAD_TRAINING_CHOICES:
            raise ValueError(
                f"Unknown zo_head_training {self.zo_head_training!r}; choose one of {list(HEAD_TRAINING_CHOICES)}."
            )
        if not (isinstance(self.zo_head_learning_rate, (int, float)) and self.zo_head_learning_rate > 0):
            raise ValueError(f"zo_head_learning_rate must be > 0, got {self.zo_head_learning_rate!r}.")
        if self.zo_head_init_l2 is not None and not (
            isinstance(self.zo_head_init_l2, (int, float)) and self.zo_head_init_l2 > 0
        ):
            raise ValueError(
                f"zo_head_init_l2 must be > 0, or None to choose it by cross-validation, got {self.zo_head_init_l2!r}."
            )
        if self.zo_head_init_max_samples is not None and self.zo_head_init_max_samples < 1:
            raise ValueError(f"zo_head_init_max_samples must be >= 1 or None, got {self.zo_head_init_max_samples!r}.")
        if not isinstance(self.zo_verify_replicas_steps, int) or self.zo_verify_replicas_steps < 0:
            raise ValueError(
                f"zo_verify_replicas_steps must be an integer >= 0 (0: off), got {self.zo_verify_replicas_steps!r}."
            )
        if not isinstance(self.zo_perturbation_parallel_size, int) or self.zo_perturbation_parallel_size < 1:
            raise ValueError(
                f"zo_perturbation_parallel_size must be an integer >= 1, got {self.zo_perturbation_parallel_size!r}."
            )
        check_perturbation_parallel_size(self.zo_perturbation_parallel_size, self.zo_num_perturbations)
        if not isinstance(self.zo_max_consecutive_skips, int) or self.zo_max_consecutive_skips < 1:
            raise ValueError(
                f"zo_max_consecutive_skips must be an integer >= 1, got {self.zo_max_consecutive_skips!r}."
            )
        self._validate_hizoo_arguments()
        # Every optimizer-specific rule (offload, engine, layout, noise, perturbations) is the optimizer's declaration.
        ZO_OPTIMIZERS[self.zo_optimizer].check_execution(
            engine=self.zo_engine,
            offload=self.zo_offload is not None,
            pertp_size=self.zo_perturbation_parallel_size,
            noise=self.zo_noise,
            num_perturbations=self.zo_num_perturbations,
        )

    def _validate_hizoo_arguments(self) -> None:
        if not (isinstance(self.zo_hizoo_smooth, (int, float)) and 0.0 <= self.zo_hizoo_smooth < 1.0):
            raise ValueError(
                f"zo_hizoo_smooth must be in [0, 1), got {self.zo_hizoo_smooth!r}; HiZOO uses 1e-9 to 1e-6."
            )


def _has_accelerator() -> bool:
    """Whether this process can use a GPU or another accelerator that Accelerate drives."""
    return torch.cuda.is_available() or (hasattr(torch, "xpu") and torch.xpu.is_available())
