"""ZO's memory on the user's path (weights loaded from safetensors files), measured in fresh processes.

Without offload, training and saving stay at inference's peak: the first ZO step writes every weight, which copies
the pages `from_pretrained` mapped, and nothing may keep a second copy (a second mapping of the checkpoint did,
1.49x inference on SmolLM2). With the disk tier, the load, the steps and the save hold the resident modules and a
few blocks, never the model.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

WORKER = Path(__file__).with_name("memory_worker.py")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A 200 MB Llama of 16 blocks with a small vocabulary, so that the blocks are nearly all of it."""
    config = LlamaConfig(
        hidden_size=512,
        intermediate_size=1408,
        num_hidden_layers=16,
        num_attention_heads=8,
        num_key_value_heads=8,
        vocab_size=1000,
        tie_word_embeddings=False,
    )
    folder = tmp_path_factory.mktemp("llama16")
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder)
    return folder


def _peaks(model_dir: Path, output_dir: Path, offload: str, forward: str) -> dict:
    result = subprocess.run(
        [sys.executable, str(WORKER), str(model_dir), str(output_dir), offload, forward],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    peaks = json.loads(result.stdout.strip().splitlines()[-1])
    start, model_bytes = peaks.pop("start"), peaks.pop("model_bytes")
    return {phase: (peak - start) / model_bytes for phase, peak in peaks.items()}


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_training_and_saving_stay_at_inference_memory(model_dir, tmp_path):
    peaks = _peaks(model_dir, tmp_path, "none", "forward")
    assert peaks["inference"] > 0.9, peaks  # the forward reads every weight: the model is resident
    assert peaks["train"] <= peaks["inference"] + 0.1, peaks
    assert peaks["save"] <= peaks["inference"] + 0.1, peaks


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_disk_offload_holds_a_few_blocks_from_load_to_save(model_dir, tmp_path):
    peaks = _peaks(model_dir, tmp_path, "disk", "no-forward")
    # 16 blocks: the resident modules, the block computing, the one prefetched and the save's shard of two.
    assert max(peaks.values()) <= 0.5, peaks
    saved = LlamaForCausalLM.from_pretrained(tmp_path)
    assert len(list(tmp_path.glob("model-*.safetensors"))) > 1  # written shard by shard
    assert torch.isfinite(next(saved.parameters())).all()
