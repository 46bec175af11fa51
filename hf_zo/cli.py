"""The `hf-zo` command: rebuild a fine-tuned model from its trajectory, or inspect a trajectory.

hf-zo replay BASE TRAJECTORY OUT     # BASE: the folder or Hub id of the model the run started from
hf-zo inspect TRAJECTORY             # TRAJECTORY: a zo_trajectory.bin, a folder holding one, or a Hub repo id
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
from collections.abc import Sequence

import huggingface_hub
import torch
from huggingface_hub.errors import (
    EntryNotFoundError,
    HfHubHTTPError,
    HFValidationError,
    LocalEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)
from huggingface_hub.utils import validate_repo_id
from transformers import AutoConfig, PreTrainedConfig
from transformers.utils import CONFIG_NAME, logging

from .models import PooledEncoderConfig, PooledEncoderForSequenceClassification, from_pretrained_quantized
from .peft_warnings import peft_warnings_ignored
from .training.checkpointing import saved_run_files
from .trajectory import TRAJECTORY_NAME, ZOTrajectory, replay
from .trajectory.replay import check_replayable, initial_model

logger = logging.get_logger(__name__)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the `hf-zo` command line; returns the exit status."""
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        with peft_warnings_ignored():  # loading an LN-tuning adapter warns once per norm: nothing a user can act on
            return args.run(args)
    except BrokenPipeError:  # the reader of the output stopped early (`hf-zo inspect ... | head`), as Unix tools allow
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # so that exiting flushes nothing into it
        return 0
    except (ValueError, OSError) as error:  # a bad file, a missing folder or Hub repo, a mismatching base
        print(f"hf-zo {args.command}: error: {error}", file=sys.stderr)
        return 2


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hf-zo", description="Zeroth-order fine-tuning trajectories, and the embedded LLM."
    )
    commands = parser.add_subparsers(dest="command", required=True)

    rebuild = commands.add_parser("replay", help="Apply a trajectory to its base model and save the result.")
    rebuild.add_argument(
        "base",
        help="Folder or Hub id of the model the run started from (the pretrained model, also for PEFT runs).",
    )
    rebuild.add_argument("trajectory", help=f"A {TRAJECTORY_NAME}, a folder holding one, or a Hub repo id.")
    rebuild.add_argument("out", help="Folder to save the fine-tuned model (or adapter) into.")
    rebuild.add_argument("--revision", help="Hub revision of BASE.")
    rebuild.add_argument("--trajectory-revision", help="Hub revision of TRAJECTORY.")
    rebuild.add_argument("--device", help="Device to replay on (default: the recorded device type if available).")
    rebuild.add_argument("--no-verify", action="store_true", help="Skip the base and result checksum checks.")
    rebuild.set_defaults(run=_replay)

    show = commands.add_parser("inspect", help="Print a trajectory's header and step statistics.")
    show.add_argument("trajectory", help=f"A {TRAJECTORY_NAME}, a folder holding one, or a Hub repo id.")
    show.add_argument("--revision", help="Hub revision of TRAJECTORY.")
    show.add_argument(
        "--steps", type=_non_negative_int, default=3, help="Number of first steps to list (default 3; 0 lists none)."
    )
    show.add_argument("--json", action="store_true", help="Print the JSON header only.")
    show.set_defaults(run=_inspect)

    embedded = commands.add_parser(
        "embedded-llm",
        help="Print the folder of the embedded LLM (SmolLM2-135M-Instruct), materialising it on first use.",
    )
    embedded.add_argument("--dtype", default="float32", help="Dtype of the saved weights (float32, bfloat16).")
    embedded.set_defaults(run=_embedded_llm)
    return parser


def _embedded_llm(args: argparse.Namespace) -> int:
    from .models import embedded_llm_path

    print(embedded_llm_path(dtype=args.dtype))
    return 0


def _non_negative_int(value: str) -> int:
    """An argparse type: an integer of at least 0."""
    try:
        number = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid int value: {value!r}") from None
    if number < 0:
        raise argparse.ArgumentTypeError(f"{number} is negative: give 0 (list no steps) or more.")
    return number


# ---------------------------------------------------------------------- replay


def _replay(args: argparse.Namespace) -> int:
    # Every check of the arguments runs before the base is loaded and replayed, the slow part.
    _check_out(args.out, args.base, args.trajectory)
    _check_base_name(args.base)
    trajectory = ZOTrajectory.from_pretrained(args.trajectory, revision=args.trajectory_revision)
    check_replayable(trajectory)
    device = _device(args.device, trajectory)
    _check_base_on_hub(args.base, args.revision)
    # The adapter is added before the move, so that every tensor of it lands on the replay device.
    model = initial_model(_load_base(args.base, trajectory, args.revision), trajectory)
    model = replay(model.to(device), trajectory, verify=not args.no_verify, show_progress=True)
    model.save_pretrained(args.out)
    trajectory.save(args.out)
    _copy_tokenizer(args.base, args.out, args.revision)
    print(f"Replayed {len(trajectory)} steps onto {args.base}; saved the fine-tuned model to {args.out}.")
    return 0


def _check_out(out: str, base: str, trajectory: str) -> None:
    """Refuse an OUT the replay cannot save into, or whose files saving there would overwrite: the folder the
    trajectory is read from, BASE, a file, a folder holding a run or a model, one that cannot be created."""
    source = os.path.dirname(os.path.abspath(trajectory)) if os.path.isfile(trajectory) else trajectory
    if os.path.isdir(source) and os.path.realpath(source) == os.path.realpath(out):
        raise ValueError(
            f"OUT ({out}) is the folder the trajectory is read from: saving the replayed model there would "
            "overwrite the trained run's files (its model card, its trajectory). Give a new folder."
        )
    if os.path.isdir(base) and os.path.realpath(base) == os.path.realpath(out):
        raise ValueError(
            f"OUT ({out}) is BASE: saving the replayed model there would overwrite the base model. Give a new or "
            "empty folder."
        )
    if os.path.exists(out) and not os.path.isdir(out):
        raise ValueError(
            f"OUT ({out}) is a file, not a folder: saving the replayed model would overwrite it. Give a new or "
            "empty folder."
        )
    if os.path.isdir(out):
        held = saved_run_files(out)
        if held:
            listed = ", ".join(held[:3]) + (f" and {len(held) - 3} more" if len(held) > 3 else "")
            raise ValueError(
                f"OUT ({out}) already holds a run or a model ({listed}): saving the replayed model there would "
                "overwrite it. Give a new or empty folder."
            )
    nearest = os.path.abspath(out)
    while not os.path.exists(nearest):
        nearest = os.path.dirname(nearest)
    if not os.path.isdir(nearest):
        raise ValueError(f"OUT ({out}) cannot be created: {nearest} is a file, not a folder. Give another folder.")
    try:  # os.access is not enough: root may write anywhere by the mode bits, yet not into /proc or a read-only mount
        os.rmdir(tempfile.mkdtemp(prefix=".hf-zo-write-check-", dir=nearest))
    except OSError as error:
        raise ValueError(
            f"OUT ({out}) cannot be {'written' if nearest == os.path.abspath(out) else 'created'}: no folder can be "
            f"made in {nearest} ({error.strerror or error}). Give a folder you can write to."
        ) from None


def _check_base_name(base: str) -> None:
    """Refuse a BASE that is neither an existing folder nor shaped like a Hub id (as examples/train.py does with
    --model_name_or_path: a path that is not a folder is an error, not a Hub lookup)."""
    if os.path.isdir(base):
        return
    if os.path.exists(base) or os.path.isabs(base) or base.startswith(("./", "../")):
        raise ValueError(f"BASE {base} is not a folder: give the folder or Hub id the run started from.")
    try:
        validate_repo_id(base)
    except HFValidationError:
        raise ValueError(
            f"BASE {base} is neither an existing folder nor a valid Hub id: give the folder the run started from, "
            "or its Hub id (org/model)."
        ) from None


def _check_base_on_hub(base: str, revision: str | None) -> None:
    """Refuse a BASE that is not a local folder and whose Hub repository cannot be reached (offline and not cached,
    missing, private): the loader's own errors would not name BASE. Fetches its config into the cache, as loading
    would."""
    if os.path.isdir(base):
        return
    fix = "give the folder the run started from"
    try:
        huggingface_hub.hf_hub_download(base, CONFIG_NAME, revision=revision)
    except LocalEntryNotFoundError:  # offline, and not in the local cache (a subclass of EntryNotFoundError)
        raise ValueError(
            f"BASE {base} is neither an existing folder nor reachable on the Hub (offline, and not in the local "
            f"cache): {fix}, or connect to the Hub."
        ) from None
    except RevisionNotFoundError:
        raise ValueError(f"--revision {revision} is not a revision of BASE {base} on the Hub: {fix}.") from None
    except RepositoryNotFoundError:  # gated repositories included
        raise ValueError(
            f"BASE {base} is neither an existing folder nor a Hub repository you can access: {fix}, or log in "
            "(`hf auth login`, HF_TOKEN) for a private or gated one."
        ) from None
    except EntryNotFoundError:  # the repository exists but has no config: the loader says what it lacks
        return
    except HfHubHTTPError as error:
        reason = str(error).splitlines()[0]
        raise ValueError(
            f"BASE {base} is not an existing folder, and the Hub failed to serve it ({reason})."
        ) from None


def _load_base(base: str, trajectory: ZOTrajectory, revision: str | None) -> torch.nn.Module:
    described = trajectory.header["base_model"]
    model_class = _model_class(described["model_class"])
    dtype = getattr(torch, described.get("dtype") or "float32")
    config = described.get("config")
    if config is not None:
        # A quantized base is quantized again from BASE's weights (trajectory.quantization_config), not read as
        # weights quantized already.
        config = {k: v for k, v in config.items() if k != "quantization_config"}
        config = model_class.config_class.from_dict(config)
    quantization = trajectory.quantization_config
    if described["peft"] and os.path.isfile(os.path.join(base, "adapter_config.json")):
        # An adapter saved before training (how trajectories of format version 1 replay): load it onto its base.
        from peft import PeftConfig, PeftModel

        adapter_config = PeftConfig.from_pretrained(base, revision=revision)
        model = _load_pretrained(
            model_class, adapter_config.base_model_name_or_path, config, None, dtype, quantization
        )
        return PeftModel.from_pretrained(model, base, revision=revision, is_trainable=True)
    return _load_pretrained(model_class, base, config, revision, dtype, quantization)


def _model_class(name: str) -> type:
    """The recorded model class: a transformers class, or one of hf_zo's own models."""
    import transformers

    own = {PooledEncoderForSequenceClassification.__name__: PooledEncoderForSequenceClassification}
    model_class = getattr(transformers, name, None) or own.get(name)
    if model_class is None:
        raise ValueError(
            f"transformers has no class {name!r} (the recorded model class); load the base model yourself and call "
            "hf_zo.replay(model, trajectory)."
        )
    return model_class


def _load_pretrained(
    model_class: type,
    base: str,
    config: PreTrainedConfig | None,
    revision: str | None,
    dtype: torch.dtype,
    quantization_config=None,
) -> torch.nn.Module:
    """`base` loaded as the run loaded it: with `from_pretrained` (quantized by `quantization_config` if the run's
    base was), or, for a head put on the pooling of a sentence encoder's checkpoint (what
    `hf_zo.load_sequence_classifier` does), the encoder with a head of the recorded pooling and labels."""
    if isinstance(config, PooledEncoderConfig) and not isinstance(
        AutoConfig.from_pretrained(base, revision=revision), PooledEncoderConfig
    ):
        return model_class.from_encoder(
            base,
            pooling_mode=config.pooling_mode,
            normalize=config.normalize,
            classifier_dropout=config.classifier_dropout,
            num_labels=config.num_labels,
            id2label=config.id2label,
            label2id=config.label2id,
            problem_type=config.problem_type,
            revision=revision,
            dtype=dtype,
        )
    if quantization_config is not None:
        return from_pretrained_quantized(
            model_class, base, quantization_config, revision=revision, dtype=dtype, config=config
        )
    return model_class.from_pretrained(base, revision=revision, dtype=dtype, config=config)


def _device(requested: str | None, trajectory: ZOTrajectory) -> torch.device:
    recorded = trajectory.header["device_type"]
    if requested is None:
        if _available(recorded):
            return torch.device(recorded)
        logger.warning("The trajectory was recorded on %s, which is not available here: replaying on cpu.", recorded)
        return torch.device("cpu")
    try:
        device = torch.device(requested)
    except RuntimeError as error:
        raise ValueError(f"--device {requested!r} is not a torch device ({error}).") from None
    if not _available(device.type):
        raise ValueError(
            f"--device {requested}: no {device.type} device is available to this torch; leave --device out to "
            f"replay on the recorded device type ({recorded}) when it is available, else on cpu."
        )
    return device


def _available(device_type: str) -> bool:
    backend = getattr(torch, device_type, None)
    return device_type == "cpu" or bool(hasattr(backend, "is_available") and backend.is_available())


def _copy_tokenizer(base: str, out: str, revision: str | None) -> None:
    """Save BASE's tokenizer next to the model when it has one (a local folder without one is skipped)."""
    if os.path.isdir(base) and not os.path.isfile(os.path.join(base, "tokenizer_config.json")):
        return
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(base, revision=revision)
    except (OSError, ValueError) as error:
        logger.info("No tokenizer saved with the model: %s", error)
        return
    tokenizer.save_pretrained(out)


# ---------------------------------------------------------------------- inspect


def _inspect(args: argparse.Namespace) -> int:
    trajectory = ZOTrajectory.from_pretrained(args.trajectory, revision=args.revision)
    if args.json:
        print(json.dumps(trajectory.header, indent=2, sort_keys=True))
        return 0
    for label, value in _describe(trajectory, args.trajectory):
        print(f"{label:<12} {value}")
    steps = list(trajectory.steps())
    if args.steps > 0 and steps:
        print(f"first {min(args.steps, len(steps))} steps (step: lr per group | seed:projected_grad per estimate):")
        for step in steps[: args.steps]:
            lrs = ", ".join(f"{lr:.3g}" for lr in step.lrs)
            estimates = " ".join(f"{seed:016x}:{grad:+.4g}" for seed, grad in zip(step.seeds, step.projected_grads))
            print(f"  {step.step:>6}: {lrs} | {estimates}")
    return 0


def _describe(trajectory: ZOTrajectory, source: str) -> list[tuple[str, str]]:
    header = trajectory.header
    base, optimizer = header["base_model"], header["optimizer"]
    size = len(trajectory.to_bytes())
    body = trajectory.body_bytes
    steps = list(trajectory.steps())
    grads = [g for step in steps for g in step.projected_grads]
    finite = [g for g in grads if not math.isnan(g)]
    parameters = header["parameters"]
    numel = sum(math.prod(p["shape"]) for p in parameters)
    dtypes = ", ".join(sorted({p["dtype"] for p in parameters}))
    adapter = f" + {base['peft']['peft_type']} adapter" if base["peft"] else ""
    end = header["checksums"]["end"]
    reason = trajectory.replayable()
    rows = [
        ("trajectory", f"{source} (format version {header['format_version']}, {size:,} bytes)"),
        (
            "base model",
            f"{base['name_or_path'] or '(unnamed)'} (revision {base['revision']}, {base['model_class']}{adapter})",
        ),
        (
            "optimizer",
            f"{optimizer['class']} ({optimizer['name']}): eps={optimizer['eps']}, "
            f"noise={optimizer['noise']['distribution']} ({optimizer['noise']['algorithm']}), "
            f"perturbations={optimizer['num_perturbations']}, "
            f"seed={optimizer['seed']}",
        ),
        (
            "parameters",
            f"{len(parameters)} tensors, {numel:,} elements, {dtypes}, {len(header['param_groups'])} groups, "
            f"recorded on {header['device_type']}",
        ),
        (
            "steps",
            f"{trajectory.first_step} to {trajectory.next_step - 1} ({len(steps)} steps, {len(grads)} estimates, "
            f"{len(grads) - len(finite)} skipped)",
        ),
    ]
    if steps:
        for position, name in enumerate(("lr", "weight decay")):
            values = [s.lrs if position == 0 else s.weight_decays for s in steps]
            per_group = [
                f"{min(v[g] for v in values):.3g}..{max(v[g] for v in values):.3g}" for g in range(len(values[0]))
            ]
            rows.append((name, " | ".join(per_group) + " (per group, min..max)"))
    if finite:
        mean_abs = sum(abs(g) for g in finite) / len(finite)
        rows.append(("proj. grad", f"mean |g| {mean_abs:.4g}, min {min(finite):.4g}, max {max(finite):.4g}"))
    per_step = f"{body / len(steps):.1f} bytes/step" if steps else "no steps"
    tensors = len(trajectory.tensor_section())
    rows.append(
        (
            "size",
            f"header {size - body - tensors:,} bytes + body {body:,} bytes ({per_step}) + tensors {tensors:,} bytes",
        )
    )
    stored = [("initial", trajectory.initial_tensors), ("final", trajectory.final_tensors)]
    listed = [f"{stage} {len(named)} ({sum(t.numel() for t in named.values()):,} elements)" for stage, named in stored]
    rows.append(("stored", ", ".join(listed) + " (compressed in the tensors section)"))
    rows.append(("checksums", f"start {header['checksums']['start']['sha256'][:16]}"))
    if end is not None:
        rows[-1] = ("checksums", f"{rows[-1][1]}, end {end['sha256'][:16]} (after step {end['step'] - 1})")
    rows.append(("replayable", f"yes, from {trajectory.replay_needs()}" if reason is None else f"no: {reason}"))
    return rows


if __name__ == "__main__":
    sys.exit(main())
