"""ZO on quantized bases (bitsandbytes 4-bit and 8-bit) through transformers' own quantization config.

Only the adapter trains and no quantized weight changes, resume and trajectory replay onto a freshly quantized base
are bitwise, the dual engine agrees with the sequential one, and what cannot work is refused at construction:
full-parameter ZO, offloaded blocks and another library's quantization, and a replay onto a base quantized otherwise.
"""

from __future__ import annotations

import shutil

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, BitsAndBytesConfig

pytest.importorskip("bitsandbytes")

from hf_zo import TrajectoryMismatchError, ZOSFTTrainer, ZOTrainer, ZOTrajectory, replay  # noqa: E402
from hf_zo.cli import main as cli_main  # noqa: E402
from hf_zo.models import (  # noqa: E402
    base_quantization_config,
    from_pretrained_quantized,
    is_quantized,
    quantization_config_from_record,
    quantization_record,
)

from tiny_models import lm_dataset, tiny_causal_lm, zo_args  # noqa: E402

FOUR_BIT = dict(load_in_4bit=True, bnb_4bit_quant_type="nf4")


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    """A tiny random Llama saved in full precision: the checkpoint the quantized bases are loaded from."""
    path = tmp_path_factory.mktemp("quantized") / "llama"
    tiny_causal_lm("llama").save_pretrained(path)
    return path


def _load(base_dir, quantization_config=None, **flags):
    config = quantization_config or base_quantization_config(**flags)
    return AutoModelForCausalLM.from_pretrained(base_dir, quantization_config=config)


def _lora(model):
    torch.manual_seed(0)
    return get_peft_model(model, LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"]))


def _trainable(model):
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def _assert_bitwise(actual, expected):
    assert actual.keys() == expected.keys()
    for name in expected:
        assert torch.equal(actual[name], expected[name]), name


def _train(model, tmp_path, output_dir="out", resume_from_checkpoint=None, **overrides):
    values = dict(output_dir=str(tmp_path / output_dir), learning_rate=0.05, max_steps=6, logging_steps=3)
    values.update(overrides)
    trainer = ZOTrainer(model=model, args=zo_args(tmp_path, **values), train_dataset=lm_dataset(16, length=8))
    trainer.train(resume_from_checkpoint=resume_from_checkpoint)
    return trainer


def _resident_kib_of(folder) -> int:
    """The resident kB of this process's mappings of the files in `folder` (`/proc/self/smaps`)."""
    resident, inside = 0, False
    for line in open("/proc/self/smaps"):
        fields = line.split()
        if "-" in fields[0] and len(fields) >= 5:  # a mapping's header line
            inside = len(fields) == 6 and fields[5].startswith(str(folder))
        elif inside and fields[0] == "Rss:":
            resident += int(fields[1])
    return resident


def test_zo_lora_on_a_4bit_base_changes_only_the_adapter(base_dir, tmp_path):
    model = _lora(_load(base_dir, **FOUR_BIT))
    assert is_quantized(model)
    q_proj = model.base_model.model.model.layers[0].self_attn.q_proj
    assert q_proj.base_layer.weight.dtype == torch.uint8  # packed 4-bit weights
    tensors = lambda: [*model.parameters(), *model.buffers()]  # noqa: E731
    # The unquantized tensors are views of the mapped checkpoint after from_pretrained, which keeps every page the
    # quantization read resident (the full-precision weights); ZOTrainer hands those pages back.
    assert not all(tensor.untyped_storage().resizable() for tensor in tensors())
    loaded = _resident_kib_of(base_dir)
    assert loaded > 0
    args = zo_args(tmp_path, learning_rate=0.05, max_steps=6, logging_steps=3)
    trainer = ZOTrainer(model=model, args=args, train_dataset=lm_dataset(16, length=8))
    assert _resident_kib_of(base_dir) <= loaded / 10  # the kernel may keep a page it is working on
    before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    trainer.train()
    after = model.state_dict()
    changed = {name for name in before if not torch.equal(before[name], after[name])}
    # The quantized weights, their quantization state and every other frozen tensor are bitwise unchanged.
    assert changed == {name for name in before if "lora_" in name}
    assert changed and all(after[name].dtype == torch.float32 for name in changed)


def _mapped(folder) -> list[str]:
    """This process's mappings of the files in `folder` (`/proc/self/maps`)."""
    return [line for line in open("/proc/self/maps") if line.split()[-1].startswith(str(folder))]


@pytest.mark.parametrize("flags", [FOUR_BIT, dict(load_in_8bit=True)], ids=["4bit", "8bit"])
def test_a_base_quantized_on_load_reads_its_checkpoint_tensor_by_tensor_into_the_same_model(tmp_path, flags):
    folder = tmp_path / "sharded"
    tiny_causal_lm("llama").save_pretrained(folder, max_shard_size="30KB")
    streamed = from_pretrained_quantized(AutoModelForCausalLM, str(folder), base_quantization_config(**flags))
    # No tensor of the model lies in a mapping of the float32 checkpoint: nothing of it stays resident.
    assert _mapped(folder) == []
    assert is_quantized(streamed) and streamed.name_or_path == streamed.config.name_or_path == str(folder)
    expected = _load(folder, **flags)
    _assert_bitwise(streamed.state_dict(), expected.state_dict())
    assert streamed.generation_config.to_dict() == expected.generation_config.to_dict()

    # A base saved quantized is loaded as it is, by from_pretrained.
    expected.save_pretrained(tmp_path / "quantized")
    saved = from_pretrained_quantized(AutoModelForCausalLM, str(tmp_path / "quantized"), None)
    _assert_bitwise(saved.state_dict(), expected.state_dict())


def test_resume_and_replay_on_a_4bit_base_are_bitwise(base_dir, tmp_path):
    checkpointed = dict(save_strategy="steps", save_steps=3)
    uninterrupted = _train(_lora(_load(base_dir, **FOUR_BIT)), tmp_path, "a", **checkpointed)
    uninterrupted.save_model()
    trained = _trainable(uninterrupted.model)

    shutil.copytree(tmp_path / "a" / "checkpoint-3", tmp_path / "b" / "checkpoint-3")
    checkpoint = str(tmp_path / "b" / "checkpoint-3")
    resumed = _train(_lora(_load(base_dir, **FOUR_BIT)), tmp_path, "b", checkpoint, **checkpointed)
    _assert_bitwise(_trainable(resumed.model), trained)

    # The trajectory records the quantization; the replay quantizes a fresh base from the full-precision checkpoint.
    trajectory = ZOTrajectory.load(tmp_path / "a")
    assert trajectory.header["base_model"]["quantization"] == quantization_record(uninterrupted.model)
    assert trajectory.header["base_model"]["quantization"]["bnb_4bit_quant_type"] == "nf4"
    fresh = _load(base_dir, quantization_config=trajectory.quantization_config)
    replayed = replay(fresh, trajectory)
    _assert_bitwise(_trainable(replayed), trained)

    # The command line does the same from BASE's folder alone.
    assert cli_main(["replay", str(base_dir), str(tmp_path / "a"), str(tmp_path / "replayed")]) == 0
    saved = ZOTrajectory.load(tmp_path / "replayed")
    assert saved.header["base_model"]["quantization"] == trajectory.header["base_model"]["quantization"]

    with pytest.raises(TrajectoryMismatchError, match=r"quantized as none \(full precision\).*quantization_config"):
        replay(AutoModelForCausalLM.from_pretrained(base_dir), trajectory)


def test_the_dual_engine_equals_the_sequential_one_on_a_4bit_base(base_dir, tmp_path):
    sequential = _train(_lora(_load(base_dir, **FOUR_BIT)), tmp_path, "sequential", max_steps=3)
    dual = _train(_lora(_load(base_dir, **FOUR_BIT)), tmp_path, "dual", max_steps=3, zo_engine="dual")
    _assert_bitwise(_trainable(dual.model), _trainable(sequential.model))


def test_zo_lora_on_an_8bit_base_changes_only_the_adapter(base_dir, tmp_path):
    model = _lora(_load(base_dir, load_in_8bit=True))
    assert model.base_model.model.model.layers[0].self_attn.q_proj.base_layer.weight.dtype == torch.int8
    before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    trainer = _train(model, tmp_path, max_steps=3, logging_steps=1)
    after = model.state_dict()
    changed = {name for name in before if not torch.equal(before[name], after[name])}
    assert changed == {name for name in before if "lora_" in name}
    losses = [log["loss"] for log in trainer.state.log_history if "loss" in log]
    assert len(losses) == 3 and all(0 < loss < 10 for loss in losses)


def test_full_parameter_zo_on_a_quantized_base_is_refused(base_dir, tmp_path):
    with pytest.raises(ValueError, match=r"bitsandbytes 4-bit.*full-parameter ZO.*--peft lora"):
        ZOTrainer(model=_load(base_dir, **FOUR_BIT), args=zo_args(tmp_path), train_dataset=lm_dataset(8, length=8))


def test_offloaded_blocks_of_a_quantized_base_are_refused(base_dir, tmp_path):
    args = zo_args(tmp_path, zo_engine="dual", zo_offload="cpu")
    with pytest.raises(ValueError, match=r"zo_offload='cpu' cannot store the blocks of a quantized base"):
        ZOTrainer(model=_lora(_load(base_dir, **FOUR_BIT)), args=args, train_dataset=lm_dataset(8, length=8))


def test_a_base_quantized_by_another_library_is_refused(tmp_path):
    model = tiny_causal_lm("llama")
    model.is_quantized, model.config.quantization_config = True, {"quant_method": "torchao"}
    with pytest.raises(ValueError, match=r"quantized with torchao.*\['bitsandbytes'\] only.*load_in_8bit=True"):
        ZOTrainer(model=_lora(model), args=zo_args(tmp_path), train_dataset=lm_dataset(8, length=8))


def test_zosfttrainer_loads_a_4bit_base_by_name_and_keeps_the_adapter_in_float32(base_dir, tmp_path):
    """TRL casts a quantized base's adapter to bfloat16 for first-order QLoRA; ZO's small moves need float32."""
    from test_sft import _lm_texts, sft_args, tokenizer

    args = sft_args(tmp_path, model_init_kwargs={"quantization_config": BitsAndBytesConfig(**FOUR_BIT)})
    trainer = ZOSFTTrainer(
        model=str(base_dir),
        args=args,
        train_dataset=_lm_texts(),
        processing_class=tokenizer(),
        peft_config=LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"]),
    )
    assert is_quantized(trainer.model)
    start = _trainable(trainer.model)
    assert start and all(tensor.dtype == torch.float32 for tensor in start.values())
    trainer.train()
    assert any(not torch.equal(p, start[n]) for n, p in _trainable(trainer.model).items())


def test_quantization_configs_from_flags_and_records(base_dir):
    config = base_quantization_config(**FOUR_BIT, use_bnb_nested_quant=True)
    assert (config.load_in_4bit, config.bnb_4bit_quant_type, config.bnb_4bit_use_double_quant) == (True, "nf4", True)
    assert config.bnb_4bit_compute_dtype == torch.float32
    assert base_quantization_config(load_in_8bit=True).load_in_8bit
    assert base_quantization_config() is None
    record = quantization_record(_load(base_dir, load_in_8bit=True))
    assert quantization_config_from_record(record).to_dict() == BitsAndBytesConfig(load_in_8bit=True).to_dict()
    assert quantization_record(AutoModelForCausalLM.from_pretrained(base_dir)) is None
    with pytest.raises(ValueError, match=r"Choose one quantization of the base, got \['load_in_4bit', 'load_in_8bit'"):
        base_quantization_config(load_in_4bit=True, load_in_8bit=True)
    with pytest.raises(ValueError, match=r"bnb_4bit_quant_type must be one of \['nf4', 'fp4'\], got 'int4'"):
        base_quantization_config(load_in_4bit=True, bnb_4bit_quant_type="int4")


@pytest.fixture(scope="module")
def example_workspace(tmp_path_factory):
    """The tiny Llama with the examples' word-level tokenizer, and SST-2-shaped training and validation files."""
    from test_examples import sentences, tiny_tokenizer, write_tsv

    root = tmp_path_factory.mktemp("quantized_example")
    tiny_causal_lm("llama").save_pretrained(root / "llama")
    tiny_tokenizer().save_pretrained(root / "llama")
    write_tsv(root / "train.tsv", sentences(16, seed=0))
    write_tsv(root / "validation.tsv", sentences(8, seed=1))
    return root


def _run_train_example(workspace, tmp_path, *extra):
    from test_examples import train_script

    argv = ["--model_name_or_path", str(workspace / "llama"), "--task_name", "sst2"]
    argv += ["--train_file", str(workspace / "train.tsv"), "--validation_file", str(workspace / "validation.tsv")]
    argv += ["--output_dir", str(tmp_path / "out"), "--max_steps", "2", "--per_device_train_batch_size", "4"]
    argv += ["--report_to", "none", "--save_strategy", "no", "--use_cpu", "--disable_tqdm", "true", *extra]
    return train_script.main(argv)


def test_examples_train_py_trains_lora_on_a_4bit_base_and_evaluates(example_workspace, tmp_path):
    trainer, metrics = _run_train_example(example_workspace, tmp_path, "--peft", "lora", "--load_in_4bit")
    assert quantization_record(trainer.model)["load_in_4bit"]
    assert 0 <= metrics["eval_accuracy"] <= 1
    assert (tmp_path / "out" / "adapter_model.safetensors").is_file()
    trajectory = ZOTrajectory.load(tmp_path / "out")
    assert trajectory.header["base_model"]["quantization"]["bnb_4bit_quant_type"] == "nf4"


def test_examples_train_py_on_a_4bit_base_without_an_adapter_names_peft_lora(example_workspace, tmp_path):
    with pytest.raises(ValueError, match=r"full-parameter ZO cannot train a quantized base.*--peft lora"):
        _run_train_example(example_workspace, tmp_path, "--load_in_4bit")


def test_examples_sft_py_trains_lora_on_a_4bit_base(tmp_path):
    """examples/sft.py with TRL's `--load_in_4bit --use_peft`: the adapter trains in float32 on a 4-bit base."""
    import json

    from launch_worker import load_example
    from test_sft import CONVERSATIONS, tokenizer

    tiny_causal_lm("llama").save_pretrained(tmp_path / "model")
    tokenizer().save_pretrained(tmp_path / "model")
    with open(tmp_path / "chat.jsonl", "w") as f:
        f.writelines(json.dumps({"messages": messages}) + "\n" for messages in CONVERSATIONS["messages"])
    argv = ["--model_name_or_path", str(tmp_path / "model"), "--train_file", str(tmp_path / "chat.jsonl")]
    argv += ["--output_dir", str(tmp_path / "out"), "--use_peft", "--lora_target_modules", "q_proj", "v_proj"]
    argv += ["--load_in_4bit", "--max_steps", "2", "--use_cpu", "true", "--bf16", "false", "--report_to", "none"]
    argv += ["--disable_tqdm", "true"]
    sft = load_example("sft")
    trainer = sft.main(*sft.make_parser().parse_args_and_config(argv))
    assert quantization_record(trainer.model)["load_in_4bit"]
    assert all(p.dtype == torch.float32 for p in trainer.model.parameters() if p.requires_grad)
    assert (tmp_path / "out" / "adapter_model.safetensors").is_file()
    assert len(ZOTrajectory.load(tmp_path / "out")) == 2
