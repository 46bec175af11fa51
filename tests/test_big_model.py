"""benchmarks/big_model.py on the tiny shape: the cached random checkpoint (written once, rebuilt after a kill, refused
without disk space) and each mode's JSON line (finite losses, the updates kept, the offload folder removed)."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from collections import namedtuple
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "big_model.py"
FIELDS = {"mode", "params", "peak_rss_mib", "s_per_step", "limit_s_per_step", "loss_first", "loss_last", "kept_update"}
HAS_BITSANDBYTES = importlib.util.find_spec("bitsandbytes") is not None


def _load_random_llama():
    spec = importlib.util.spec_from_file_location("random_llama", ROOT / "benchmarks" / "random_llama.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


random_llama = _load_random_llama()


def _snapshot(folder: Path) -> dict[str, tuple[int, int]]:
    return {p.name: (p.stat().st_size, p.stat().st_mtime_ns) for p in folder.iterdir()}


def test_checkpoint_is_written_once_and_rebuilt_when_a_build_was_cut_short(tmp_path):
    folder = random_llama.random_llama_folder("tiny", "bfloat16", tmp_path)
    assert folder == tmp_path / "tiny-bfloat16"
    files = _snapshot(folder)
    assert {"config.json", "model.safetensors.index.json", random_llama.MARKER} < set(files)
    shard = folder / "model-00001-of-00001.safetensors"
    weights = shard.read_bytes()

    assert random_llama.random_llama_folder("tiny", "bfloat16", tmp_path) == folder
    assert _snapshot(folder) == files  # found, not rewritten

    # A kill before the marker: the folder is removed (with what a killed run left in it) and written again.
    (folder / random_llama.MARKER).unlink()
    (folder / "left-by-a-killed-run").write_text("x")
    random_llama.random_llama_folder("tiny", "bfloat16", tmp_path)
    assert set(_snapshot(folder)) == set(files)
    assert shard.read_bytes() == weights  # the same seed draws the same weights

    # A shard cut short under a marker is caught by its size.
    with open(shard, "r+b") as handle:
        handle.truncate(100)
    random_llama.random_llama_folder("tiny", "bfloat16", tmp_path)
    assert shard.read_bytes() == weights


def test_folder_has_a_tokenizer_and_an_older_folder_gets_one_with_its_weights_untouched(tmp_path):
    from transformers import AutoTokenizer

    folder = random_llama.random_llama_folder("tiny", "float32", tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    config = random_llama.llama_config("tiny", "float32")
    assert len(tokenizer) <= config.vocab_size
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id) == (config.bos_token_id, config.eos_token_id)
    assert tokenizer.pad_token is not None and tokenizer.pad_token_id < config.vocab_size
    ids = tokenizer("Fine-tuning on a small machine: naïve text too.").input_ids
    assert max(ids) < config.vocab_size
    assert tokenizer.decode(ids) == "Fine-tuning on a small machine: naïve text too."

    # A finished folder from before the tokenizer was written gets one; nothing else in it is rewritten.
    for name in random_llama.TOKENIZER_FILES:
        (folder / name).unlink()
    weights = _snapshot(folder)
    random_llama.random_llama_folder("tiny", "float32", tmp_path)
    after = _snapshot(folder)
    assert {name: after[name] for name in weights} == weights
    assert set(random_llama.TOKENIZER_FILES) <= set(after)
    assert AutoTokenizer.from_pretrained(folder)(["same text"]).input_ids == tokenizer(["same text"]).input_ids


def test_checkpoint_weights_have_the_shape_and_the_same_values_in_both_dtypes(tmp_path):
    from transformers import AutoModelForCausalLM

    models = {
        dtype: AutoModelForCausalLM.from_pretrained(random_llama.random_llama_folder("tiny", dtype, tmp_path))
        for dtype in random_llama.DTYPES
    }
    model = models["float32"]
    shape = random_llama.SHAPES["tiny"]
    assert model.config.num_hidden_layers == shape["num_hidden_layers"]
    assert model.config.hidden_size == shape["hidden_size"]
    assert model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr()
    assert models["bfloat16"].dtype == torch.bfloat16
    bf16 = dict(models["bfloat16"].named_parameters())
    for name, param in model.named_parameters():
        assert torch.equal(param.to(torch.bfloat16), bf16[name]), name
        if name.endswith("norm.weight"):
            assert torch.equal(param, torch.ones_like(param)), name
        else:
            assert abs(param.std().item() - random_llama.INIT_STD) < 0.002, name


def test_build_refuses_a_disk_without_room(tmp_path, monkeypatch):
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(random_llama.shutil, "disk_usage", lambda path: usage(10**6, 10**6 - 1000, 1000))
    with pytest.raises(OSError, match=r"needs 0\.0 GB .* has 0\.0 GB free.*HF_ZO_HOME"):
        random_llama.random_llama_folder("tiny", "float32", tmp_path)
    assert not (tmp_path / "tiny-float32").exists()


def test_4bit_lora_without_bitsandbytes_prints_a_skipped_line(monkeypatch, capsys):
    # gpu_check.py's `quantized` part relies on it: a GPU machine without bitsandbytes skips the part, exit code 0.
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))  # as `python benchmarks/big_model.py` does
    spec = importlib.util.spec_from_file_location("big_model", SCRIPT)
    big_model = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(big_model)
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *args: None if name == "bitsandbytes" else find_spec(name, *args)
    )
    assert big_model.main(["--shape", "tiny", "--mode", "4bit-lora", "--device", "cpu"]) == []
    (line,) = capsys.readouterr().out.splitlines()
    record = json.loads(line)
    assert (record["mode"], record["shape"]) == ("4bit-lora", "tiny") and "bitsandbytes" in record["skipped"]


@pytest.fixture(scope="module")
def records(tmp_path_factory):
    """The JSON lines of every mode that runs here, from one run of the script (2 steps on the tiny shape)."""
    home = tmp_path_factory.mktemp("hf_zo_home")
    modes = ["bf16", "bf16-cpu-offload", "fp32-disk"] + (["4bit-lora"] if HAS_BITSANDBYTES else [])
    command = [sys.executable, str(SCRIPT), "--shape", "tiny", "--steps", "2", "--mode", *modes]
    done = subprocess.run(
        command, env={**os.environ, "HF_ZO_HOME": str(home)}, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert len(lines) == len(modes), done.stdout  # stdout carries the JSON lines only
    found = {record["mode"]: record for record in map(json.loads, lines)}
    assert list(found) == modes
    assert not list((home / "big_model" / "tiny-float32").glob("offload/hf_zo-offload-*"))  # removed at exit
    return found


@pytest.mark.parametrize("mode", ["bf16", "bf16-cpu-offload", "fp32-disk", "4bit-lora"])
def test_each_mode_prints_its_json_line(records, mode):
    if mode == "4bit-lora" and not HAS_BITSANDBYTES:
        pytest.skip("4bit-lora needs bitsandbytes: pip install bitsandbytes")
    record = records[mode]
    assert FIELDS <= set(record)
    assert math.isfinite(record["loss_first"]) and math.isfinite(record["loss_last"])
    base = sum(
        math.prod(shape) for _, shape in random_llama.tensor_shapes(random_llama.llama_config("tiny", "float32"))
    )
    assert record["params"] == base + (record["trainable_params"] if mode == "4bit-lora" else 0)
    assert record["peak_rss_mib"] > 0 and record["s_per_step"] > 0 and record["limit_s_per_step"] > 0
    assert record["limit_s_per_step"] == max(record["limit_parts"].values())
    assert len(record["step_s"]) == 2
    assert record["device"] == "cpu" and "peak_gpu_mib" not in record  # no CUDA here: the CPU, as before
    if mode == "fp32-disk":
        assert "disk_s" in record["limit_parts"]
        assert record["kept_update"] == pytest.approx(1.0, abs=0.02)  # fp32 keeps an update of 1e-6
    elif mode in ("bf16", "bf16-cpu-offload"):
        assert record["exact_restore"] and record["sweeps_per_step"] == {"block": 5, "outside_blocks": 6}
        if record["stochastic_rounding"]:  # kept in expectation; about 0 when rounded to nearest
            assert 0.7 < record["kept_update"] < 1.3
    else:
        assert record["trainable_params"] < record["params"] / 50  # the adapter only
        assert record["kept_update"] == pytest.approx(1.0, abs=0.02)


def test_blocks_offloaded_to_host_memory_train_as_resident_ones(records):
    # On the CPU the "cpu" tier's blocks are used in place: the same steps, bit for bit.
    resident, offloaded = records["bf16"], records["bf16-cpu-offload"]
    assert (offloaded["loss_first"], offloaded["loss_last"]) == (resident["loss_first"], resident["loss_last"])
    assert offloaded["kept_update"] == resident["kept_update"]
    assert offloaded["pcie_bytes_per_step"] == {}  # PCIe parts only with a GPU as the working device
