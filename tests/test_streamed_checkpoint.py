"""`StreamedCheckpoint`: a local safetensors checkpoint read tensor by tensor, as a state dict for `from_pretrained`.

Every tensor reads back equal to what safetensors itself reads (shards, dtypes, empty tensors), the folder's files
are found from its index, and a file that is cut short or holds a dtype the reader does not know fails with a message
that names the tensor and the way out.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from hf_zo.models.streamed_checkpoint import StreamedCheckpoint, local_safetensors_files

from tiny_models import tiny_causal_lm


def _tensors():
    torch.manual_seed(0)
    return {
        "big": torch.randn(600, 600),  # past the size that gets a mapping of its own
        "half": torch.randn(7, 5).to(torch.bfloat16),
        "ids": torch.arange(12, dtype=torch.int64).view(3, 4),
        "mask": torch.tensor([True, False, True]),
        "empty": torch.empty(0, 4),
        "scalar": torch.tensor(3.5),
    }


def test_every_tensor_reads_back_equal_to_safetensors_own_reading(tmp_path):
    path = tmp_path / "model.safetensors"
    save_file(_tensors(), path, metadata={"format": "pt"})
    expected = load_file(path)
    with StreamedCheckpoint([str(path)]) as checkpoint:
        assert set(checkpoint) == set(expected) and len(checkpoint) == len(expected)
        assert copy.deepcopy(checkpoint) is checkpoint
        for name, tensor in expected.items():
            assert checkpoint[name].get_shape() == list(tensor.shape)
            read = checkpoint[name][...]
            assert read.dtype == tensor.dtype and torch.equal(read, tensor), name
        assert checkpoint["half"].get_dtype() == "BF16"


def test_a_sharded_folder_is_read_through_its_index(tmp_path):
    model = tiny_causal_lm("llama")
    model.save_pretrained(tmp_path, max_shard_size="30KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    files = local_safetensors_files(tmp_path)
    assert len(files) > 1 and sorted(set(index["weight_map"].values())) == [f.rsplit("/", 1)[1] for f in files]
    with StreamedCheckpoint(files) as checkpoint:
        assert set(checkpoint) == set(index["weight_map"])
        for name, tensor in model.state_dict().items():
            if name in checkpoint:
                assert torch.equal(checkpoint[name][...], tensor), name


def test_only_a_local_safetensors_folder_is_streamed(tmp_path):
    assert local_safetensors_files("HuggingFaceTB/SmolLM2-135M-Instruct") is None
    assert local_safetensors_files(tmp_path) is None  # no checkpoint in it
    (tmp_path / "bin").mkdir()
    torch.save(tiny_causal_lm("llama").state_dict(), tmp_path / "bin" / "pytorch_model.bin")
    assert local_safetensors_files(tmp_path / "bin") is None
    tiny_causal_lm("llama").save_pretrained(tmp_path / "single")
    assert local_safetensors_files(tmp_path / "single") == [str(tmp_path / "single" / "model.safetensors")]


def test_a_truncated_file_names_the_tensor(tmp_path):
    path = tmp_path / "model.safetensors"
    save_file({"big": torch.randn(600, 600)}, path)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 1000])
    with StreamedCheckpoint([str(path)]) as checkpoint, pytest.raises(OSError, match="inside tensor 'big'"):
        checkpoint["big"][...]


def test_an_unknown_dtype_names_the_plain_loading(tmp_path):
    path = tmp_path / "model.safetensors"
    save_file({"weight": torch.zeros(2, 2)}, path)
    data = bytearray(path.read_bytes())
    start = data.index(b'"F32"')
    data[start : start + 5] = b'"X32"'
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=r"dtype 'X32'.*from_pretrained\(path\)"):
        StreamedCheckpoint([str(path)])
