"""A Llama-architecture checkpoint with random weights, written once to a cache folder without holding the model.

`big_model.py` trains a model with Llama-2-7B's shape (6.74B parameters) on a machine whose memory does not hold it
in fp32. No such weights are available offline, and step time and memory do not depend on the weights' values, so
:func:`random_llama_folder` writes an ordinary transformers folder (`config.json`, sharded safetensors of about 2 GB
and `model.safetensors.index.json`) with random weights: normal with std 0.02 (Llama's `initializer_range`), norms
ones. The model is built on the meta device for its names and shapes only; each tensor is drawn by its own seeded
generator (so the bf16 and fp32 folders hold the same weights up to rounding), and each shard is written and synced
before the next is drawn: the memory used is one shard. A small byte-level BPE tokenizer (a few hundred tokens, trained
offline on this module's docstring, ids within the model's vocabulary) goes in the folder too, so that
`AutoTokenizer.from_pretrained` and `examples/train.py` take the folder like any checkpoint.

The folder is `$HF_ZO_HOME/big_model/<shape>-<dtype>` (`HF_ZO_HOME` defaults to `~/.cache/hf_zo`). A marker file
written last tells a finished build from one a kill cut short, which is removed and rebuilt; a file lock keeps two
processes from building one folder at once. The tokenizer is not part of the marker: a finished folder without it
(built by an earlier version) gets it added, its weights untouched.

On a GPU (`device="cuda"`, as `big_model.py --device cuda` builds) CUDA's generator draws the weights, which the
CPU's takes minutes to do for the 13B shape's 13 billion values, and `CUDA_WRITERS` shards are written and synced at
once: other values than the CPU's for the same seed (the same distribution; the marker names the generator), and a
few shards in host memory.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path

logger = logging.getLogger("big_model")

SHAPES = {
    "7b": dict(
        num_hidden_layers=32, hidden_size=4096, intermediate_size=11008, num_attention_heads=32, vocab_size=32000
    ),
    "1b": dict(
        num_hidden_layers=22,
        hidden_size=2048,
        intermediate_size=5632,
        num_attention_heads=32,
        num_key_value_heads=4,
        vocab_size=32000,
    ),
    "13b": dict(
        num_hidden_layers=40, hidden_size=5120, intermediate_size=13824, num_attention_heads=40, vocab_size=32000
    ),
    "small": dict(
        num_hidden_layers=8, hidden_size=2048, intermediate_size=5632, num_attention_heads=32, vocab_size=32000
    ),
    "tiny": dict(num_hidden_layers=2, hidden_size=128, intermediate_size=344, num_attention_heads=4, vocab_size=1024),
}
"""Model shapes: Llama-2-7B's and Llama-2-13B's (`meta-llama/Llama-2-7b-hf`'s and `-13b-hf`'s configs),
TinyLlama-1.1B's (`TinyLlama/TinyLlama-1.1B-intermediate-step-1431k-3T`'s: 1.10B parameters, grouped-query attention
with 4 key/value heads), TinyLlama's widths with 8 of its 22 layers and full multi-head attention (0.54B parameters,
1.1 GB in bf16: `gpu_check.py`'s 4-bit check) and a tiny one for tests."""

DTYPES = ("bfloat16", "float32")
SHARD_BYTES = 2 * 10**9
INIT_STD = 0.02
CUDA_WRITERS = 4
"""Shards written and synced at once when the weights are drawn on a GPU (the disk, not the generator, is then the
bound); a build on the CPU writes one at a time, so that it holds one shard."""
MARKER = "hf_zo_big_model.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
"""What `save_pretrained` of the tokenizer writes; `tokenizer_config.json` is moved into the folder last."""
SPECIAL_TOKENS = ("<unk>", "<s>", "</s>", "<pad>")
"""Ids 0 to 3: `<s>` and `</s>` at Llama's `bos_token_id` 1 and `eos_token_id` 2."""
TOKENIZER_VOCAB = 1024
"""Most tokens of the tokenizer (the tiny shape's vocabulary): a docstring's text gives a few hundred."""
FORMAT = 1
"""Version of the folder's layout and of the weights' generation; a marker of another version is rebuilt."""


def default_cache_dir() -> Path:
    """`$HF_ZO_HOME/big_model` (`HF_ZO_HOME` defaults to `~/.cache/hf_zo`, as for the embedded models)."""
    from hf_zo.models.smollm2 import default_cache_dir as hf_zo_home

    return hf_zo_home() / "big_model"


def llama_config(shape: str, dtype: str):
    """The `LlamaConfig` of `shape` (untied embeddings; full multi-head attention unless the shape sets
    `num_key_value_heads`), saved with `dtype`."""
    from transformers import LlamaConfig

    sizes = {"num_key_value_heads": SHAPES[shape]["num_attention_heads"], **SHAPES[shape]}
    return LlamaConfig(
        **sizes,
        max_position_embeddings=4096,
        rms_norm_eps=1e-5,
        initializer_range=INIT_STD,
        tie_word_embeddings=False,
        dtype=dtype,
    )


def tensor_shapes(config) -> list[tuple[str, tuple[int, ...]]]:
    """The checkpoint's tensor names and shapes, in `state_dict` order, from a model built on the meta device."""
    import torch
    from transformers import LlamaForCausalLM

    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    return [(name, tuple(tensor.shape)) for name, tensor in model.state_dict().items()]


def folder_for(shape: str, dtype: str, cache_dir: str | os.PathLike | None = None) -> Path:
    """Where the checkpoint of `shape` in `dtype` lives."""
    if shape not in SHAPES:
        raise ValueError(f"Unknown shape {shape!r}; choose one of {sorted(SHAPES)}.")
    if dtype not in DTYPES:
        raise ValueError(f"Unknown dtype {dtype!r}; choose one of {DTYPES}.")
    return Path(cache_dir or default_cache_dir()) / f"{shape}-{dtype}"


def checkpoint_bytes(shape: str, dtype: str) -> int:
    """The bytes of the checkpoint's tensors."""
    import torch

    itemsize = torch.empty((), dtype=getattr(torch, dtype)).element_size()
    return sum(_numel(s) for _, s in tensor_shapes(llama_config(shape, dtype))) * itemsize


def random_llama_folder(
    shape: str = "7b",
    dtype: str = "bfloat16",
    cache_dir: str | os.PathLike | None = None,
    seed: int = 0,
    device: str = "cpu",
) -> Path:
    """The folder of a random Llama checkpoint of `shape` in `dtype`, built on the first call.

    Args:
        shape (`str`): a key of `SHAPES`.
        dtype (`str`): `"bfloat16"` or `"float32"`.
        cache_dir (`str`, *optional*): the cache root (default: `default_cache_dir()`).
        seed (`int`): seed of the weights; a folder built with another seed is rebuilt.
        device (`str`, defaults to `"cpu"`): where a build draws the weights: `"cuda"` draws them with CUDA's
            generator (other values for the same seed; a folder built either way is used by both).

    Returns:
        `Path`: the folder, for `from_pretrained`.

    Raises:
        OSError: the file system has too little free space for the checkpoint (the message says how much).
    """
    from filelock import FileLock

    folder = folder_for(shape, dtype, cache_dir)
    stamp = {"format": FORMAT, "shape": shape, "dtype": dtype, "seed": seed, "init_std": INIT_STD}
    if not _is_complete(folder, stamp) or not _has_tokenizer(folder):
        folder.parent.mkdir(parents=True, exist_ok=True)
        with FileLock(str(folder.parent / f".{folder.name}.lock")):
            if not _is_complete(folder, stamp):  # another process may have built it while this one waited
                _build(folder, shape, dtype, seed, stamp, device)
            if not _has_tokenizer(folder):
                _write_tokenizer(folder, llama_config(shape, dtype).vocab_size)
    size = sum(f.stat().st_size for f in folder.iterdir() if f.is_file())
    logger.info(
        f"Random {shape} Llama checkpoint ({dtype}, {size / 1e9:.2f} GB) in {folder}; remove it with: rm -rf {folder}"
    )
    return folder


def _is_complete(folder: Path, stamp: dict) -> bool:
    """Whether `folder` holds a finished build of `stamp`: its marker, and every file it lists at its size."""
    try:
        marker = json.loads((folder / MARKER).read_text())
    except (OSError, ValueError):
        return False
    if {key: marker.get(key) for key in stamp} != stamp:
        return False
    try:
        return all((folder / name).stat().st_size == size for name, size in marker["files"].items())
    except (OSError, KeyError, AttributeError):
        return False


def _has_tokenizer(folder: Path) -> bool:
    return all((folder / name).is_file() for name in TOKENIZER_FILES)


def _write_tokenizer(folder: Path, vocab_size: int) -> None:
    """A byte-level BPE tokenizer (any text encodes; at most `TOKENIZER_VOCAB` and `vocab_size` tokens) trained on
    this module's docstring, saved into `folder` through a scratch folder so that a kill leaves no half of it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE(unk_token=SPECIAL_TOKENS[0]))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=min(TOKENIZER_VOCAB, vocab_size),
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(__doc__.split("\n\n"), trainer)
    unk, bos, eos, pad = SPECIAL_TOKENS
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe, unk_token=unk, bos_token=bos, eos_token=eos, pad_token=pad, model_max_length=4096
    )
    scratch = Path(tempfile.mkdtemp(prefix=".tokenizer-", dir=folder))
    try:
        tokenizer.save_pretrained(scratch)
        for name in sorted(p.name for p in scratch.iterdir() if p.name not in TOKENIZER_FILES) + list(TOKENIZER_FILES):
            os.replace(scratch / name, folder / name)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _build(folder: Path, shape: str, dtype: str, seed: int, stamp: dict, device: str = "cpu") -> None:
    from concurrent.futures import ThreadPoolExecutor

    import torch
    from safetensors.torch import save_file

    from hf_zo.noise import mix_seed

    if folder.exists():
        logger.warning(f"{folder} is incomplete (a build was cut short) or from another version; rebuilding it.")
        shutil.rmtree(folder)
    config = llama_config(shape, dtype)
    names = tensor_shapes(config)
    torch_dtype = getattr(torch, dtype)
    itemsize = torch.empty((), dtype=torch_dtype).element_size()
    total = sum(_numel(s) for _, s in names) * itemsize
    folder.parent.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(folder.parent).free
    if free < total + 2**30:
        raise OSError(
            f"The random {shape} checkpoint in {dtype} needs {total / 1e9:.1f} GB (plus 1 GiB to spare) in "
            f"{folder.parent}, which has {free / 1e9:.1f} GB free. Free some space or set HF_ZO_HOME to a folder on "
            "a larger disk."
        )
    shards = _plan_shards(names, itemsize)
    logger.warning(
        f"Writing a random {shape} Llama checkpoint ({sum(_numel(s) for _, s in names):,} parameters, {dtype}, "
        f"{total / 1e9:.2f} GB in {len(shards)} shards) to {folder} (once)."
    )
    start = time.perf_counter()
    folder.mkdir()
    config.save_pretrained(folder)
    weight_map, files = {}, {}
    position = {name: k for k, (name, _) in enumerate(names)}

    def write(path: Path, tensors: dict) -> None:
        save_file(tensors, str(path), metadata={"format": "pt"})
        with open(path, "rb+") as handle:  # on disk before the marker says the build is finished
            os.fsync(handle.fileno())
        files[path.name] = path.stat().st_size
        logger.info(f"  {path.name} ({files[path.name] / 1e9:.2f} GB) after {time.perf_counter() - start:.0f} s")

    writers = 1 if device == "cpu" else CUDA_WRITERS
    writing = []
    with ThreadPoolExecutor(max_workers=writers) as pool:
        for number, shard in enumerate(shards, start=1):
            filename = f"model-{number:05d}-of-{len(shards):05d}.safetensors"
            tensors = {}
            for name, shape_ in shard:
                generator = torch.Generator(device=device).manual_seed(mix_seed(seed, position[name]))
                if name.endswith("norm.weight"):
                    tensor = torch.ones(shape_, dtype=torch_dtype)
                else:
                    drawn = torch.empty(shape_, device=device).normal_(0.0, INIT_STD, generator=generator)
                    tensor = drawn.to(torch_dtype).cpu()
                tensors[name] = tensor
                weight_map[name] = filename
            writing.append(pool.submit(write, folder / filename, tensors))
            del tensors
            if len(writing) >= writers:  # at most `writers` shards in memory
                writing.pop(0).result()
        for future in writing:
            future.result()
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    for name in ("config.json", "model.safetensors.index.json"):
        files[name] = (folder / name).stat().st_size
    marker = {**stamp, "params": total // itemsize, "bytes": total, "files": files, "generator": device}
    (folder / MARKER).write_text(json.dumps(marker, indent=2) + "\n")
    logger.warning(f"Wrote {folder} ({total / 1e9:.2f} GB) in {time.perf_counter() - start:.0f} s.")


def _plan_shards(names: list[tuple[str, tuple[int, ...]]], itemsize: int) -> list[list[tuple[str, tuple]]]:
    """Consecutive tensors grouped into shards of at most `SHARD_BYTES` (a larger tensor gets a shard of its own)."""
    shards, current, size = [], [], 0
    for name, shape in names:
        nbytes = _numel(shape) * itemsize
        if current and size + nbytes > SHARD_BYTES:
            shards.append(current)
            current, size = [], 0
        current.append((name, shape))
        size += nbytes
    if current:
        shards.append(current)
    return shards


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for size in shape:
        n *= size
    return n
