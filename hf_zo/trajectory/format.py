"""`ZOTrajectory`: the steps of a ZO run as seeds and scalars, and their file format.

File format (``zo_trajectory.bin``, version 3, little-endian)::

    magic "HFZOTRAJ" | u32 format version | u32 header bytes H | u64 body bytes B | u64 tensor bytes T
    header: H bytes of UTF-8 JSON (see :meth:`ZOTrajectory.start`)
    body: B bytes, one record per optimizer step:
        u8 flags (bit 0: lrs follow, bit 1: weight decays follow, set when they change; bit 2: curvatures follow)
        | u32 estimates n
        [f64 lr per param group] [f64 weight decay per param group]
        n x (u64 seed, f64 projected gradient; NaN marks an estimate skipped for a non-finite loss
             [, f64 curvature when bit 2 is set: that of HiZOO's estimates, from which replay rebuilds its state])
    tensors: T bytes, zlib-compressed safetensors of the tensors a replay cannot get from the base model
        ("initial/NAME": start values the base checkpoint does not hold, "final/NAME": end values of the
        trainable tensors the ZO optimizer does not update); empty when there are none
    SHA-256 of everything above (32 bytes): detects corruption and truncation.

Version 3 adds flag bit 2; a file whose steps do not use it (every optimizer but HiZOO) is written as version 2,
so that older hf_zo releases still read it. Version 1 (read, never written) has no tensor section and no T in its
preamble, and does not record the noise algorithm (header ``optimizer.noise.algorithm``): it is read as made with
``"torch"``, the only one hf_zo had then.
"""

from __future__ import annotations

import enum
import hashlib
import json
import math
import os
import struct
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

import huggingface_hub
import torch
from huggingface_hub.errors import LocalEntryNotFoundError
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors
from torch.distributed.tensor import DTensor

from ..estimator import ZORecord
from ..models.quantized import quantization_config_from_record, quantization_record
from ..noise import LEGACY_NOISE_ALGORITHM
from ..optim import ZO_OPTIMIZERS, ZOOptimizer
from ..pages import MappedPages
from .base import frozen_fingerprint, initial_tensors_not_in_base, whole

TRAJECTORY_NAME = "zo_trajectory.bin"
"""File name of a trajectory inside a checkpoint or output folder."""

FORMAT_VERSION = 3
"""Newest version of the file format, written for HiZOO runs (others are written as version 2; version 1 files are
read too)."""

_VERSION_WITHOUT_CURVATURES = 2  # what a file without curvatures is written as, for older readers
_MAGIC = b"HFZOTRAJ"
_PREAMBLE = struct.Struct("<8sIIQQ")
_PREAMBLE_V1 = struct.Struct("<8sIIQ")
_STEP_HEAD = struct.Struct("<BI")
_ESTIMATE = struct.Struct("<Qd")
_ESTIMATE_WITH_CURVATURE = struct.Struct("<Qdd")
_DIGEST_BYTES = 32
_LRS_FOLLOW, _WDS_FOLLOW, _CURVATURES_FOLLOW = 1, 2, 4


class TrajectoryFormatError(ValueError):
    """A trajectory file is not one, is truncated or corrupted, or was written by a newer hf_zo."""


class TrajectoryMismatchError(ValueError):
    """A model's trainable parameters do not match those a trajectory was recorded on or ended with."""


@dataclass(frozen=True)
class ZOTrajectoryStep:
    """One optimizer step of a trajectory.

    Attributes:
        step (`int`): the optimizer step (`ZOOptimizer.zo_step`) it was.
        seeds (`tuple[int, ...]`): seeds of its estimates, in the order they ran.
        projected_grads (`tuple[float, ...]`): projected gradient of each estimate; NaN where it was skipped.
        lrs (`tuple[float, ...]`): learning rate of each parameter group.
        weight_decays (`tuple[float, ...]`): weight decay of each parameter group.
        curvatures (`tuple[float, ...]`, *optional*):
            Curvature of each estimate (NaN where it was skipped), for optimizers that use it (HiZOO); else `None`.
    """

    step: int
    seeds: tuple[int, ...]
    projected_grads: tuple[float, ...]
    lrs: tuple[float, ...]
    weight_decays: tuple[float, ...]
    curvatures: tuple[float, ...] | None = None

    @property
    def records(self) -> list[ZORecord]:
        """The records the update used (losses are not recorded and read NaN)."""
        curvatures = self.curvatures or (None,) * len(self.seeds)
        return [
            ZORecord(seed, grad, math.nan, math.nan, curvature)
            for seed, grad, curvature in zip(self.seeds, self.projected_grads, curvatures)
            if not math.isnan(grad)
        ]


class ZOTrajectory:
    """The (seed, projected gradient, lr, weight decay) log of a ZO run: save, load, inspect, replay.

    Build one with :meth:`start` (which `ZOTrainer` does for you), :meth:`load` or :meth:`from_pretrained`.

    Args:
        header (`dict`): the JSON header (base model, optimizer, parameters, checksums).
        body (`bytes`, *optional*): the encoded steps.
        initial_tensors (`dict[str, torch.Tensor]`, *optional*):
            Start values of the trainable tensors that the base model's checkpoint does not hold (a PEFT adapter, a
            new or linear-probed head), by parameter name.
        final_tensors (`dict[str, torch.Tensor]`, *optional*):
            End values of the trainable tensors that the ZO optimizer does not update (a first-order head).
    """

    def __init__(
        self,
        header: dict,
        body: bytes = b"",
        initial_tensors: dict[str, torch.Tensor] | None = None,
        final_tensors: dict[str, torch.Tensor] | None = None,
    ):
        self.header = header
        self.initial_tensors = dict(initial_tensors or {})
        self.final_tensors = dict(final_tensors or {})
        self._body = bytearray(body)
        self._num_steps = 0
        self._last = (None, None)
        self._has_curvatures = False
        for step in self.steps():
            self._num_steps += 1
            self._last = (step.lrs, step.weight_decays)
            self._has_curvatures |= step.curvatures is not None

    # ------------------------------------------------------------------ building

    @classmethod
    def start(cls, model: torch.nn.Module, optimizer: ZOOptimizer) -> ZOTrajectory:
        """Begin the trajectory of `optimizer` training `model`, from the model's current weights.

        Args:
            model (`torch.nn.Module`): the model (or PEFT model) whose parameters `optimizer` updates.
            optimizer (`ZOOptimizer`): the optimizer, before its next step.

        Returns:
            `ZOTrajectory`: an empty trajectory whose header records the base model, the optimizer and a checksum
            of the trainable parameters, holding the start values of those the base checkpoint does not restore
            (see `initial_tensors_not_in_base`); attach it with :meth:`attach`.
        """
        names = {id(p): name for name, p in model.named_parameters()}
        group_of = {id(p): g for g, group in enumerate(optimizer.param_groups) for p in group["params"]}
        parameters, named = [], {}
        for index, tensor in optimizer.params.tensors:
            if id(tensor) not in names:
                raise ValueError(
                    f"The optimizer updates a tensor of shape {tuple(tensor.shape)} (noise index {index}) that is not "
                    f"a parameter of {type(model).__name__}; build the optimizer over model.parameters()."
                )
            name = names[id(tensor)]
            named[name] = tensor
            parameters.append(
                {
                    "name": name,
                    "index": index,
                    "group": group_of[id(tensor)],
                    "shape": list(tensor.shape),
                    "dtype": _dtype_name(tensor.dtype),
                }
            )
        trained_outside = [n for n, p in model.named_parameters() if p.requires_grad and n not in named]
        initial = {n: whole(named[n].detach()).cpu().clone() for n in initial_tensors_not_in_base(model, list(named))}
        noise = optimizer.noise
        header = {
            "format": "hf-zo-trajectory",
            "format_version": FORMAT_VERSION if optimizer.needs_center_loss else _VERSION_WITHOUT_CURVATURES,
            "versions": {"hf_zo": _version("hf-zo"), "torch": torch.__version__},
            "base_model": _describe_model(model),
            "optimizer": {
                "name": next((k for k, c in ZO_OPTIMIZERS.items() if c is type(optimizer)), None),
                "class": type(optimizer).__name__,
                "eps": optimizer.eps,
                "num_perturbations": optimizer.num_perturbations,
                "seed": optimizer.seed,
                "exact_restore": optimizer.sequential_estimator.exact_restore,
                "noise": {
                    "distribution": noise.distribution,
                    "algorithm": noise.algorithm,
                    "table_numel": noise.table_numel,
                    "table_seed": noise.table_seed,
                    "stochastic_rounding": noise.stochastic_rounding,
                },
                "defaults": _to_json(optimizer.defaults),
            },
            "param_groups": [
                _to_json({k: v for k, v in group.items() if k not in ("params", "indices")})
                for group in optimizer.param_groups
            ],
            "parameters": parameters,
            "initial_tensors": list(initial),
            "trained_outside": trained_outside,
            "device_type": optimizer.params.tensors[0][1].device.type,
            "first_step": optimizer.zo_step,
            "checksums": {"start": checksum(named), "end": None, "frozen": frozen_fingerprint(model)},
        }
        return cls(header, initial_tensors=initial)

    def attach(self, optimizer: ZOOptimizer):
        """Append every future step of `optimizer` to this trajectory.

        Returns:
            `torch.utils.hooks.RemovableHandle`: call `remove()` to stop recording.
        """
        return optimizer.register_update_hook(self.record_update)

    def record_update(self, optimizer: ZOOptimizer, step: int, seeds: list[int], records: list[ZORecord]) -> None:
        """The update hook (see `ZOOptimizer.register_update_hook`): append the step just applied."""
        dp_size = getattr(getattr(getattr(optimizer, "parallel", None), "mesh", None), "dp_size", 1)
        if dp_size > 1:
            # On a data-parallel mesh every rank also sweeps the other ranks' perturbations, in global order.
            seeds = [optimizer.perturbation_seed(step, k) for k in range(len(seeds) * dp_size)]
        grads = {r.seed: r.projected_grad for r in records}
        curvatures = {r.seed: r.curvature for r in records}
        known = set(seeds)
        seeds = list(seeds) + [r.seed for r in records if r.seed not in known]
        self.append(
            ZOTrajectoryStep(
                step=step,
                seeds=tuple(seeds),
                projected_grads=tuple(float(grads.get(seed, math.nan)) for seed in seeds),
                lrs=tuple(float(group["lr"]) for group in optimizer.param_groups),
                weight_decays=tuple(float(group["weight_decay"]) for group in optimizer.param_groups),
                curvatures=tuple(float(curvatures.get(seed, math.nan)) for seed in seeds)
                if optimizer.needs_center_loss
                else None,
            )
        )

    def append(self, step: ZOTrajectoryStep) -> None:
        """Append one step; it must be the step that follows the last one."""
        if step.step != self.next_step:
            raise ValueError(
                f"Cannot append optimizer step {step.step} to a trajectory that ends before step {self.next_step}: "
                "a trajectory holds consecutive steps of one optimizer."
            )
        if not len(step.lrs) == len(step.weight_decays) == self.num_groups:
            raise ValueError(
                f"The trajectory has {self.num_groups} parameter groups, but step {step.step} has "
                f"{len(step.lrs)} lrs and {len(step.weight_decays)} weight decays."
            )
        if step.curvatures is not None and len(step.curvatures) != len(step.seeds):
            raise ValueError(
                f"Step {step.step} has {len(step.seeds)} seeds but {len(step.curvatures)} curvatures; give one per "
                "seed (NaN where the estimate was skipped)."
            )
        last_lrs, last_wds = self._last
        flags = (_LRS_FOLLOW if step.lrs != last_lrs else 0) | (_WDS_FOLLOW if step.weight_decays != last_wds else 0)
        flags |= _CURVATURES_FOLLOW if step.curvatures is not None else 0
        encoded = bytearray(_STEP_HEAD.pack(flags, len(step.seeds)))
        groups = struct.Struct(f"<{self.num_groups}d")
        if flags & _LRS_FOLLOW:
            encoded += groups.pack(*step.lrs)
        if flags & _WDS_FOLLOW:
            encoded += groups.pack(*step.weight_decays)
        if step.curvatures is None:
            for seed, grad in zip(step.seeds, step.projected_grads):
                encoded += _ESTIMATE.pack(seed, grad)
        else:
            for seed, grad, curvature in zip(step.seeds, step.projected_grads, step.curvatures):
                encoded += _ESTIMATE_WITH_CURVATURE.pack(seed, grad, curvature)
        self._body += encoded
        self._num_steps += 1
        self._last = (step.lrs, step.weight_decays)
        self._has_curvatures |= step.curvatures is not None

    # ------------------------------------------------------------------ reading

    @property
    def num_groups(self) -> int:
        """Number of parameter groups of the recorded optimizer."""
        return len(self.header["param_groups"])

    @property
    def first_step(self) -> int:
        """Optimizer step at which the trajectory starts (0 unless recording began on a resumed run)."""
        return int(self.header["first_step"])

    @property
    def next_step(self) -> int:
        """The optimizer step that would come next: `first_step` plus the number of steps."""
        return self.first_step + self._num_steps

    @property
    def format_version(self) -> int:
        """The format version :meth:`to_bytes` writes: 3 if some step records curvatures (HiZOO), else 2."""
        return FORMAT_VERSION if self._has_curvatures else _VERSION_WITHOUT_CURVATURES

    @property
    def quantization_config(self):
        """The quantization config the base model was loaded with (a transformers `BitsAndBytesConfig`,
        `TorchAoConfig`, ...), or `None` for a base in full precision: load the base for a replay with
        `from_pretrained(base, quantization_config=trajectory.quantization_config)`."""
        record = self.header["base_model"].get("quantization")
        return None if record is None else quantization_config_from_record(record)

    @property
    def body_bytes(self) -> int:
        """Size of the encoded steps in bytes (the file adds the header, the tensors, a 32-byte preamble and a
        32-byte digest)."""
        return len(self._body)

    def __len__(self) -> int:
        return self._num_steps

    def steps(self) -> Iterator[ZOTrajectoryStep]:
        """Decode the steps, in order."""
        body, offset, step = self._body, 0, self.first_step
        groups = struct.Struct(f"<{self.num_groups}d")
        lrs = wds = None
        try:
            while offset < len(body):
                flags, count = _STEP_HEAD.unpack_from(body, offset)
                offset += _STEP_HEAD.size
                if flags & _LRS_FOLLOW:
                    lrs = groups.unpack_from(body, offset)
                    offset += groups.size
                if flags & _WDS_FOLLOW:
                    wds = groups.unpack_from(body, offset)
                    offset += groups.size
                if lrs is None or wds is None or flags & ~(_LRS_FOLLOW | _WDS_FOLLOW | _CURVATURES_FOLLOW):
                    raise TrajectoryFormatError(f"Malformed trajectory body: bad flags {flags} at step {step}.")
                layout = _ESTIMATE_WITH_CURVATURE if flags & _CURVATURES_FOLLOW else _ESTIMATE
                estimates = [layout.unpack_from(body, offset + k * layout.size) for k in range(count)]
                offset += count * layout.size
                yield ZOTrajectoryStep(
                    step,
                    tuple(e[0] for e in estimates),
                    tuple(e[1] for e in estimates),
                    tuple(lrs),
                    tuple(wds),
                    tuple(e[2] for e in estimates) if flags & _CURVATURES_FOLLOW else None,
                )
                step += 1
        except struct.error as error:
            raise TrajectoryFormatError(f"Malformed trajectory body at step {step}: {error}.") from error

    # ------------------------------------------------------------------ files

    def to_bytes(self) -> bytes:
        """The trajectory as the bytes of a ``zo_trajectory.bin`` file (in the current format version)."""
        version = self.format_version
        header = dict(self.header, num_steps=self._num_steps, format_version=version)
        header_bytes = json.dumps(header, sort_keys=True).encode("utf-8")
        tensors = self.tensor_section()
        data = _PREAMBLE.pack(_MAGIC, version, len(header_bytes), len(self._body), len(tensors))
        data += header_bytes + bytes(self._body) + tensors
        return data + hashlib.sha256(data).digest()

    def tensor_section(self) -> bytes:
        """The stored tensors as the file holds them: zlib-compressed safetensors, or nothing when there are none."""
        named = {f"initial/{n}": t for n, t in self.initial_tensors.items()}
        named.update({f"final/{n}": t for n, t in self.final_tensors.items()})
        if not named:
            return b""
        return zlib.compress(save_safetensors({k: t.contiguous() for k, t in named.items()}), 9)

    def save(self, path: str | os.PathLike, model: torch.nn.Module | None = None) -> Path:
        """Write the trajectory (atomically: a reader never sees half a file).

        Args:
            path (`str` or `os.PathLike`): a file, or a folder to write ``zo_trajectory.bin`` into: an existing
                one, or a path that ends with a separator (``"run/"``). Missing folders are created.
            model (`torch.nn.Module`, *optional*):
                The trained model, holding its true (flushed) weights: their checksum becomes the ``end`` checksum
                that :func:`replay` checks its result against.

        Returns:
            `Path`: the file written.
        """
        names_a_folder = str(path).endswith(("/", os.sep))  # Path() drops the trailing separator
        path = Path(path)
        if path.is_dir() or names_a_folder:
            path = path / TRAJECTORY_NAME
        path.parent.mkdir(parents=True, exist_ok=True)
        if model is not None:
            self.record_end(model)
        partial = path.with_name(path.name + ".partial")
        partial.write_bytes(self.to_bytes())
        os.replace(partial, path)
        return path

    def record_end(self, model: torch.nn.Module) -> None:
        """Record the ``end`` checksum of `model`, the trained model holding its true (flushed) weights, and the end
        values of the tensors trained outside the ZO optimizer (what :meth:`save` does when given the model).

        An FSDP2-sharded model's tensors are gathered (:func:`~hf_zo.trajectory.base.whole`): every process calls
        this, though only one writes the file.
        """
        end = checksum(trajectory_tensors(model, self.header))
        self.header["checksums"]["end"] = dict(end, step=self.next_step)
        named = dict(model.named_parameters())
        self.final_tensors = {
            n: whole(named[n].detach()).cpu().clone() for n in self.header.get("trained_outside", [])
        }

    @classmethod
    def load(cls, path: str | os.PathLike) -> ZOTrajectory:
        """Read a trajectory file (or the ``zo_trajectory.bin`` of a folder), checking it is whole and intact.

        Raises:
            `TrajectoryFormatError`: the file is not a trajectory, is truncated or corrupted, or is too new.
        """
        path = Path(path)
        if path.is_dir():
            path = path / TRAJECTORY_NAME
        if not path.is_file():
            raise FileNotFoundError(f"No trajectory at {path}: ZOTrainer writes {TRAJECTORY_NAME} with each save.")
        return cls.from_bytes(path.read_bytes(), source=str(path))

    @classmethod
    def from_bytes(cls, data: bytes, source: str = "the trajectory") -> ZOTrajectory:
        """Decode the bytes of a trajectory file; `source` names it in errors."""
        retry = "Copy or download it again, or use the trajectory of an earlier checkpoint."
        if not _MAGIC.startswith(data[: len(_MAGIC)]):
            raise TrajectoryFormatError(
                f"{source} is not an hf-zo trajectory (it starts with {data[:8]!r}, not {_MAGIC!r})."
            )
        if len(data) < _PREAMBLE_V1.size:
            raise TrajectoryFormatError(f"{source} is truncated: it has only {len(data)} bytes. {retry}")
        _, version, header_size, body_size = _PREAMBLE_V1.unpack_from(data)
        if version > FORMAT_VERSION:
            raise TrajectoryFormatError(
                f"{source} has format version {version}, newer than this hf_zo reads ({FORMAT_VERSION}); upgrade "
                "with `pip install -U hf-zo`."
            )
        preamble, tensor_size = _PREAMBLE_V1.size, 0
        if version >= 2:
            if len(data) < _PREAMBLE.size:
                raise TrajectoryFormatError(f"{source} is truncated: it has only {len(data)} bytes. {retry}")
            preamble, tensor_size = _PREAMBLE.size, _PREAMBLE.unpack_from(data)[4]
        expected = preamble + header_size + body_size + tensor_size + _DIGEST_BYTES
        if len(data) != expected:
            state = "truncated" if len(data) < expected else "corrupted (it has trailing bytes)"
            raise TrajectoryFormatError(
                f"{source} is {state}: its preamble declares {expected} bytes but it has {len(data)}. {retry}"
            )
        if hashlib.sha256(data[:-_DIGEST_BYTES]).digest() != data[-_DIGEST_BYTES:]:
            raise TrajectoryFormatError(
                f"{source} is corrupted: its SHA-256 checksum does not match its content (a changed byte or a bad "
                f"copy). {retry}"
            )
        body_start = preamble + header_size
        header = json.loads(data[preamble:body_start].decode("utf-8"))
        header["optimizer"]["noise"].setdefault("algorithm", LEGACY_NOISE_ALGORITHM)  # version 1
        header["optimizer"]["noise"].setdefault("stochastic_rounding", False)  # recorded since it exists
        tensors = data[body_start + body_size : body_start + body_size + tensor_size]
        stored = load_safetensors(zlib.decompress(tensors)) if tensors else {}
        trajectory = cls(
            header,
            data[body_start : body_start + body_size],
            initial_tensors={k.removeprefix("initial/"): t for k, t in stored.items() if k.startswith("initial/")},
            final_tensors={k.removeprefix("final/"): t for k, t in stored.items() if k.startswith("final/")},
        )
        if len(trajectory) != header["num_steps"]:
            raise TrajectoryFormatError(
                f"{source} is corrupted: its header declares {header['num_steps']} steps but its body holds "
                f"{len(trajectory)}. {retry}"
            )
        return trajectory

    @classmethod
    def from_pretrained(
        cls, path_or_repo_id: str | os.PathLike, revision: str | None = None, token: str | bool | None = None
    ) -> ZOTrajectory:
        """Load a trajectory from a local file or folder, or from a Hub repository (see `push_trajectory_to_hub`).

        Args:
            path_or_repo_id (`str` or `os.PathLike`): a file, a folder holding ``zo_trajectory.bin``, or a repo id.
            revision (`str`, *optional*): the Hub revision (branch, tag or commit).
            token (`str` or `bool`, *optional*): the Hub token, for private repositories.
        """
        if os.path.exists(path_or_repo_id):
            return cls.load(path_or_repo_id)
        name = str(path_or_repo_id)
        if os.path.isabs(name) or name.startswith(".") or name.count("/") > 1:
            raise FileNotFoundError(f"No trajectory at {name}: the path does not exist (and is not a Hub repo id).")
        try:
            downloaded = huggingface_hub.hf_hub_download(name, TRAJECTORY_NAME, revision=revision, token=token)
        except LocalEntryNotFoundError as error:  # offline, and not in the local cache
            raise OSError(
                f"No trajectory at {name}: it is not a local path, and the Hub repository could not be reached "
                f"({error}). Give the local file or folder, or connect to the Hub."
            ) from None
        return cls.load(downloaded)

    # ------------------------------------------------------------------ checks

    def verify(self, model: torch.nn.Module, stage: str = "start") -> None:
        """Check that `model`'s trainable parameters are bitwise those the run started from (or ended with).

        Args:
            model (`torch.nn.Module`): the model, with the parameter names of the recorded run.
            stage (`str`, defaults to `"start"`): `"start"` (the base weights) or `"end"` (the trained weights).

        Raises:
            `TrajectoryMismatchError`: naming the parameters that differ and what to load instead.
        """
        if stage not in ("start", "end"):
            raise ValueError(f"stage must be 'start' or 'end', got {stage!r}.")
        expected = self.header["checksums"][stage]
        if expected is None:
            raise ValueError(
                "This trajectory has no 'end' checksum: it was saved without the trained model (ZOTrainer.save_model "
                "adds one)."
            )
        if stage == "start":
            self._verify_quantization(model)
        actual = checksum(trajectory_tensors(model, self.header))
        if actual["sha256"] == expected["sha256"]:
            if stage == "start":
                self._verify_frozen(model)
            return
        names = [parameter["name"] for parameter in self.header["parameters"]]
        differ = [name for name in names if actual["parameters"][name] != expected["parameters"].get(name)]
        listed = _listed(differ)
        if stage == "end":
            raise TrajectoryMismatchError(
                f"The replayed weights differ from the trained ones in {len(differ)} of {len(expected['parameters'])} "
                f"parameters ({listed}). Bitwise replay needs the device type of the run "
                f"({self.header['device_type']!r}) and the same torch and hf_zo versions "
                f"({self.header['versions']})."
            )
        base = self.header["base_model"]
        load = f"{base['name_or_path']!r} (revision {base['revision']!r})" if base["name_or_path"] else "the weights"
        load += " the run started from"
        if base["peft"] and "initial_tensors" not in self.header:
            load += " with the initial adapter of the run"
        raise TrajectoryMismatchError(
            f"This model is not the base the trajectory was recorded on: {len(differ)} of "
            f"{len(expected['parameters'])} trainable parameters differ ({listed}). Load {load}, or pass "
            "verify=False (hf-zo replay --no-verify) to replay anyway (the result will not match the trained weights)."
        )

    def _verify_quantization(self, model: torch.nn.Module) -> None:
        """Fail when `model`'s base is not quantized as the recorded one was (the adapter replays the same either
        way, but it was trained to work with that base)."""
        expected = self.header["base_model"].get("quantization")
        actual = quantization_record(model)
        if actual == expected:
            return
        name = self.header["base_model"]["name_or_path"] or "the base"
        if expected is None:
            fix = f"Load {name!r} without a quantization_config"
        else:
            fix = f"Load {name!r} with from_pretrained(..., quantization_config=trajectory.quantization_config)"
        raise TrajectoryMismatchError(
            f"The base model is quantized as {_quantization_summary(actual)}, but the run trained on a base "
            f"quantized as {_quantization_summary(expected)}. {fix} (hf-zo replay does), or pass verify=False "
            "(hf-zo replay --no-verify) to replay anyway."
        )

    def _verify_frozen(self, model: torch.nn.Module) -> None:
        expected = self.header["checksums"].get("frozen")
        if expected is None or frozen_fingerprint(model) == expected:
            return
        base = self.header["base_model"]
        raise TrajectoryMismatchError(
            f"The frozen weights of this model are not those of the base the trajectory was recorded on (their "
            f"fingerprint over {expected['tensors']} tensors differs), so the trained tensors would be replayed onto "
            f"another model. Load {base['name_or_path']!r} (revision {base['revision']!r}) with "
            f"dtype={base['dtype']}, or pass verify=False (hf-zo replay --no-verify) to replay anyway."
        )

    def replayable(self) -> str | None:
        """`None` if :func:`replay` can rebuild the run, else the reason it cannot."""
        spec = self.header["optimizer"]
        cls = optimizer_class(spec["class"])
        if cls is None:
            return f"its optimizer {spec['class']} is not one of hf_zo.ZO_OPTIMIZERS"
        if not cls.replayable:
            return f"its optimizer {spec['name']} ({spec['class']}) {cls.limitations['replay']}"
        if self.first_step > 0 and not cls.stateless:
            return (
                f"it starts at step {self.first_step} and {spec['class']}'s state (moments, momentum) at that step is "
                "not recorded"
            )
        missing = [n for n in self.header.get("trained_outside", []) if n not in self.final_tensors]
        if missing:
            return (
                f"it lacks the end values of {len(missing)} tensors trained outside the ZO optimizer "
                f"({_listed(missing)}): it was saved without the model (ZOTrajectory.save(path, model) stores them)"
            )
        return None

    def replay_needs(self) -> str:
        """What :func:`replay` needs besides the trajectory: the base model, or (for a trajectory recorded by hf_zo
        before format version 2) the exact weights the run started from."""
        base = self.header["base_model"]
        name = base["name_or_path"] or "the model the run started from"
        if "initial_tensors" not in self.header:
            adapter = " and the adapter saved before training" if base["peft"] else ""
            return (
                f"{name}, holding exactly the weights the run started from{adapter} (recorded before format version "
                "2, which stores the initial tensors)"
            )
        stored = self.header["initial_tensors"]
        return (
            f"{name} only ({len(stored)} initial tensors and {len(self.final_tensors)} final tensors not in it are "
            "stored)"
        )


# ---------------------------------------------------------------------- helpers


def optimizer_class(name: str) -> type[ZOOptimizer] | None:
    """The class of `hf_zo.ZO_OPTIMIZERS` named `name`, or `None`."""
    return next((cls for cls in ZO_OPTIMIZERS.values() if cls.__name__ == name), None)


def trajectory_tensors(model: torch.nn.Module, header: dict) -> dict[str, torch.Tensor]:
    """The recorded parameters of `model` by name, checked for presence, shape and dtype."""
    named = dict(model.named_parameters())
    tensors = {}
    for parameter in header["parameters"]:
        name, tensor = parameter["name"], named.get(parameter["name"])
        if tensor is None:
            hint = (
                " The run trained a PEFT adapter: pass the base model without it (replay adds the adapter)."
                if header["base_model"]["peft"]
                else f" Load the recorded base model, {header['base_model']['name_or_path']!r}."
            )
            raise TrajectoryMismatchError(f"The model has no parameter {name!r}, which the trajectory updates.{hint}")
        if list(tensor.shape) != parameter["shape"] or _dtype_name(tensor.dtype) != parameter["dtype"]:
            raise TrajectoryMismatchError(
                f"Parameter {name!r} is {_dtype_name(tensor.dtype)} {list(tensor.shape)} in this model but was "
                f"{parameter['dtype']} {parameter['shape']} in the recorded run; load the base model with "
                f"dtype={parameter['dtype']}."
            )
        tensors[name] = tensor
    return tensors


def _listed(names: list[str]) -> str:
    return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")


def checksum(tensors: dict[str, torch.Tensor]) -> dict:
    """SHA-256 of each tensor's bytes (first 16 hex digits) and of all of them, in the given order.

    The pages of offloaded tensors (the disk tier) are handed back once read, so the checksum holds one tensor. An
    FSDP2 parameter is gathered first (:func:`~hf_zo.trajectory.base.whole`), so every process must take part."""
    digests, total, pages = {}, hashlib.sha256(), MappedPages()
    for name, tensor in tensors.items():
        flat = whole(tensor.detach()).contiguous().view(-1).cpu()
        digest = hashlib.sha256(flat.view(torch.uint8).numpy()).hexdigest()[:16]
        if not isinstance(tensor, DTensor):
            pages.release(tensor)
        digests[name] = digest
        total.update(f"{name}:{digest}\n".encode())
    return {"sha256": total.hexdigest(), "parameters": digests}


def _describe_model(model: torch.nn.Module) -> dict:
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    config = getattr(base, "config", None)
    peft = None
    if hasattr(model, "peft_config") and hasattr(model, "active_adapter"):
        adapter = model.peft_config[model.active_adapter]
        peft = _to_json(adapter.to_dict())
    return {
        "name_or_path": getattr(config, "_name_or_path", None) or None,
        "revision": getattr(config, "_commit_hash", None),
        "model_class": type(base).__name__,
        "dtype": _dtype_name(base.dtype) if isinstance(getattr(base, "dtype", None), torch.dtype) else None,
        "peft": peft,
        # The quantization config the base was loaded with (None: full precision), for the replay to load it alike.
        "quantization": quantization_record(model),
        # What from_pretrained(base) alone would not set (num_labels, pad_token_id, ...), for the replay to load with.
        "config": _to_json(config.to_diff_dict()) if hasattr(config, "to_diff_dict") else None,
    }


def _quantization_summary(record: dict | None) -> str:
    """A short name of a quantization record: `"bitsandbytes 4-bit nf4"`, `"torchao"`, `"none (full precision)"`."""
    if record is None:
        return "none (full precision)"
    method = record.get("quant_method", "unknown")
    if record.get("load_in_4bit"):
        return f"{method} 4-bit {record.get('bnb_4bit_quant_type')}"
    if record.get("load_in_8bit"):
        return f"{method} 8-bit"
    return str(method)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _to_json(value):
    """`value` with tuples and sets as lists, tensors and enums as numbers and strings: JSON-serializable."""
    if isinstance(value, dict):
        return {str(k): _to_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_to_json(v) for v in value]
    if isinstance(value, (set, frozenset)):
        return sorted(_to_json(v) for v in value)
    if isinstance(value, torch.Tensor):
        return value.item()
    if isinstance(value, enum.Enum):
        return _to_json(value.value)
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)


def from_json(value: dict) -> dict:
    """Hyper-parameters read back from JSON: lists (e.g. Adam's betas) as tuples."""
    return {k: tuple(v) if isinstance(v, list) else v for k, v in value.items()}


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None
