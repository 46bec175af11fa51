"""The bad-input matrix: every bad configuration or input ends in one clear error (what was wrong, how to fix),
raised by hf_zo before any training step, and no checkpoint or output file is damaged."""

import hashlib
import shutil
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest
import torch
from datasets import Dataset
from peft import LoraConfig, get_peft_model

from hf_zo import ZOConfig, ZOTrainer
from hf_zo.engine.blocks import find_blocks
from hf_zo.optim import ZOSGD, ZOSGDMomentum
from hf_zo.parallel.mesh import build_mesh

from tiny_models import lm_dataset, tiny_causal_lm


def _config(tmp_path, **kw):
    return ZOConfig(output_dir=str(tmp_path), report_to=[], use_cpu=True, disable_tqdm=True, **kw)


CONFIG_CASES = [
    ({"zo_eps": 0.0}, "zo_eps must be > 0, got 0.0"),
    ({"zo_eps": -1e-3}, "zo_eps must be > 0, got -0.001"),
    ({"zo_optimizer": "adamw"}, "Unknown zo_optimizer 'adamw'; choose one of"),
    ({"zo_noise": "uniform"}, "Unknown zo_noise 'uniform'; choose one of"),
    ({"zo_num_perturbations": 0}, "zo_num_perturbations must be an integer >= 1, got 0"),
    ({"per_device_train_batch_size": 0}, "per_device_train_batch_size must be an integer >= 1, got 0"),
    ({"gradient_accumulation_steps": 0}, "gradient_accumulation_steps must be an integer >= 1, got 0"),
    ({"zo_momentum": 1.5}, "zo_momentum must be in \\[0, 1\\), got 1.5"),
    ({"zo_max_consecutive_skips": 0}, "zo_max_consecutive_skips must be an integer >= 1, got 0"),
    ({"zo_engine": "parallel"}, "Unknown zo_engine 'parallel'; choose one of"),
    ({"zo_offload": "gpu", "zo_engine": "dual"}, "zo_offload"),
    ({"zo_offload": "disk"}, "zo_engine='dual'"),
    ({"zo_offload_dir": "/tmp/x"}, "zo_offload_dir"),
    ({"zo_perturbation_parallel_size": 0}, "zo_perturbation_parallel_size must be an integer >= 1, got 0"),
    ({"zo_perturbation_parallel_size": 3}, "zo_perturbation_parallel_size \\(3\\) must divide"),
    ({"zo_head_init": "random"}, "Unknown zo_head_init 'random'; choose one of"),
    ({"zo_head_training": "second_order"}, "Unknown zo_head_training 'second_order'; choose one of"),
    ({"zo_head_learning_rate": 0.0}, "zo_head_learning_rate must be > 0, got 0.0"),
    ({"zo_head_init_l2": 0.0}, "zo_head_init_l2 must be > 0, or None to choose it by cross-validation, got 0.0"),
]


@pytest.mark.parametrize(
    "values, message", CONFIG_CASES, ids=[next(iter(v)) + "-" + str(i) for i, (v, _) in enumerate(CONFIG_CASES)]
)
def test_invalid_zo_config_values(tmp_path, values, message):
    with pytest.raises(ValueError, match=message):
        _config(tmp_path, **values)


def test_fp16_mixed_precision_is_refused_with_the_alternatives(tmp_path, monkeypatch):
    # What ZOConfig(fp16=True) used to build on a GPU: Accelerate's GradScaler around the ZO optimizer, whose first
    # step fails because no loss went through scaler.scale(...).backward().
    with pytest.raises(ValueError, match=r"fp16=True asks for fp16 mixed precision.*GradScaler.*use bf16=True"):
        _config(tmp_path, fp16=True)
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "fp16")  # accelerate launch --mixed_precision fp16
    with pytest.raises(ValueError, match=r"ACCELERATE_MIXED_PRECISION='fp16'.*--mixed_precision no or bf16"):
        _config(tmp_path)
    assert _config(tmp_path, bf16=True).mixed_precision == "bf16"  # bf16 overrides the variable and is allowed
    monkeypatch.delenv("ACCELERATE_MIXED_PRECISION")
    assert _config(tmp_path, bf16=True).mixed_precision == "bf16"


def test_model_without_trainable_parameters(tmp_path):
    model = tiny_causal_lm("opt").requires_grad_(False)
    with pytest.raises(ValueError, match="has no trainable parameters.*get_peft_model"):
        ZOTrainer(model=model, args=_config(tmp_path), train_dataset=lm_dataset(4))


def test_dataset_without_labels(tmp_path):
    data = Dataset.from_list([{"input_ids": [2, 3, 4, 5], "attention_mask": [1, 1, 1, 1]}] * 4)
    with pytest.raises(ValueError, match="The training batches have no labels.*DataCollatorForLanguageModeling"):
        ZOTrainer(model=tiny_causal_lm("opt"), args=_config(tmp_path), train_dataset=data)


def test_empty_dataset(tmp_path):
    data = Dataset.from_dict({"input_ids": [], "labels": []})
    with pytest.raises(ValueError, match="train_dataset is empty"):
        ZOTrainer(model=tiny_causal_lm("opt"), args=_config(tmp_path), train_dataset=data)


def test_first_order_optimizer_is_rejected(tmp_path):
    model = tiny_causal_lm("opt")
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(TypeError, match="ZOTrainer needs a ZOOptimizer, got SGD"):
        ZOTrainer(model=model, args=_config(tmp_path), train_dataset=lm_dataset(4), optimizers=(sgd, None))


def test_optimizer_without_parameters():
    with pytest.raises(ValueError, match="empty parameter list"):
        ZOSGD([], lr=0.1)
    with pytest.raises(ValueError, match="got no parameters: check that some have requires_grad=True"):
        ZOSGD([{"params": []}], lr=0.1)


@pytest.mark.parametrize(
    "optimizer, kwargs, message",
    [
        (ZOSGD, {"weight_decy": 0.1}, "ZOSGD got unexpected keyword arguments ['weight_decy']; its options are lr,"),
        (ZOSGD, {"noise_algorithm": "torch"}, "choose the noise algorithm with noise=Noise('gaussian', algorithm="),
        (ZOSGDMomentum, {"momentun": 0.5}, "['momentun']; its options are lr, eps, weight_decay,"),
    ],
)
def test_optimizer_refuses_an_unknown_keyword(optimizer, kwargs, message):
    # As torch.optim does: a misspelt option must not become a silent per-group key.
    with pytest.raises(TypeError) as error:
        optimizer(torch.nn.Linear(2, 2).parameters(), lr=1e-3, **kwargs)
    assert message in str(error.value)


def test_negative_learning_rate():
    with pytest.raises(ValueError, match="lr must be >= 0, got -0.1"):
        ZOSGD([torch.nn.Parameter(torch.zeros(2))], lr=-0.1)


def test_loss_closure_must_return_a_scalar():
    weight = torch.nn.Parameter(torch.zeros(3))
    with pytest.raises(ValueError, match="must return a scalar, got a tensor of shape \\(3,\\)"):
        ZOSGD([weight], lr=0.1).step(lambda: weight * 2)


def test_perturbation_parallel_size_must_divide_world_size():
    with pytest.raises(ValueError, match="number of processes \\(1\\) must be a multiple of zo_perturbation_parallel"):
        build_mesh(pertp_size=2, backend="gloo", timeout=timedelta(seconds=10))


def test_unsupported_model_for_the_dual_engine():
    class Plain(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(4, 4)

    with pytest.raises(ValueError, match="Could not find the repeated blocks of Plain: looked for"):
        find_blocks(Plain())


def test_offload_dir_not_writable(tmp_path):
    from hf_zo.offload.storage import DiskStorage

    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    with pytest.raises(OSError, match="is not a writable folder"):
        DiskStorage(str(blocker / "offload"))


def test_offload_dir_full(tmp_path, monkeypatch):
    from hf_zo.offload import storage

    disk = storage.DiskStorage(str(tmp_path / "offload"))
    monkeypatch.setattr(storage.shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(10, 10, 5))
    with pytest.raises(OSError, match="has 0.0 MiB free but block 0 needs"):
        disk.store_block(0, [("weight", torch.zeros(1000))])
    assert [p.name for p in Path(disk.directory).iterdir()] == [disk.LOCK_NAME]  # no block written
    disk.close()
    assert not (tmp_path / "offload").exists()  # the storage created the folder, so it goes with the storage


def test_mismatched_peft_config(tmp_path):
    with pytest.raises(ValueError, match="Target modules .*not found in the base model"):
        get_peft_model(tiny_causal_lm("opt"), LoraConfig(r=4, target_modules=["query_key_value"]))


# ---------------------------------------------------------------------------- resume from a wrong checkpoint


def _digest(folder: Path) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in folder.rglob("*")
        if p.is_file()
    }


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("trained")
    args = ZOConfig(
        output_dir=str(folder),
        max_steps=2,
        save_steps=2,
        per_device_train_batch_size=2,
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
    )
    ZOTrainer(model=tiny_causal_lm("opt"), args=args, train_dataset=lm_dataset(4)).train()
    return folder / "checkpoint-2"


def _resume(tmp_path, checkpoint, model, **config):
    before = _digest(checkpoint)
    args = _config(tmp_path / "resumed", max_steps=4, per_device_train_batch_size=2, **config)
    trainer = ZOTrainer(model=model, args=args, train_dataset=lm_dataset(4))
    try:
        trainer.train(resume_from_checkpoint=str(checkpoint))
    finally:
        assert _digest(checkpoint) == before, "the checkpoint was modified"


def test_resume_with_another_optimizer(tmp_path, checkpoint):
    with pytest.raises(ValueError, match="written by ZOSGD but this run uses ZOAdam; resume with the same"):
        _resume(tmp_path, checkpoint, tiny_causal_lm("opt"), zo_optimizer="zo_adam")


def test_resume_with_another_noise(tmp_path, checkpoint):
    with pytest.raises(ValueError, match="used zo_noise='gaussian' but this run uses 'rademacher'"):
        _resume(tmp_path, checkpoint, tiny_causal_lm("opt"), zo_noise="rademacher")


def test_resume_with_another_model(tmp_path, checkpoint):
    from transformers import OPTConfig, OPTForCausalLM

    wider = OPTForCausalLM(
        OPTConfig(
            vocab_size=64,
            hidden_size=48,
            num_hidden_layers=2,
            ffn_dim=64,
            num_attention_heads=4,
            max_position_embeddings=64,
            word_embed_proj_dim=48,
        )
    )
    with pytest.raises(ValueError, match="was saved from a different model or adapter \\(size mismatch"):
        _resume(tmp_path, checkpoint, wider)


def _damaged_copy(tmp_path, checkpoint, damage):
    copy = tmp_path / "damaged" / checkpoint.name
    shutil.copytree(checkpoint, copy)
    damage(copy)
    return copy


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _flip_last_weight_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-5] ^= 0xFF  # inside the tensor data, after the header
    path.write_bytes(bytes(data))


def _step_back(path: Path) -> None:
    path.write_text(path.read_text().replace('"global_step": 2', '"global_step": 1'))


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda c: (c / "optimizer.pt").unlink(), "has no optimizer.pt, which holds the ZO optimizer's step counter"),
        (lambda c: _truncate(c / "optimizer.pt"), "optimizer.pt is damaged or truncated"),
        (lambda c: _truncate(c / "scheduler.pt"), "scheduler.pt is damaged or truncated"),
        (lambda c: _truncate(c / "rng_state.pth"), "rng_state.pth is damaged or truncated"),
        (lambda c: _truncate(c / "model.safetensors"), "model.safetensors is damaged or truncated"),
        (lambda c: _truncate(c / "trainer_state.json"), "trainer_state.json is damaged or truncated"),
        (lambda c: _step_back(c / "trainer_state.json"), "trainer_state.json is at step 1 but the ZO optimizer of"),
        (lambda c: _flip_last_weight_byte(c / "model.safetensors"), "are not those its zo_trajectory.bin recorded"),
    ],
    ids=["no-optimizer", "optimizer", "scheduler", "rng", "weights", "state", "state-step", "weights-byte"],
)
def test_resume_from_a_damaged_checkpoint_names_the_file(tmp_path, checkpoint, damage, message):
    """A damaged or missing file is named before training goes on from a state the run never had."""
    damaged = _damaged_copy(tmp_path, checkpoint, damage)
    with pytest.raises(ValueError, match=message):
        _resume(tmp_path, damaged, tiny_causal_lm("opt"))


def test_resume_without_the_first_order_heads_state_names_it(tmp_path):
    from tiny_models import classification_dataset, tiny_bert_classifier

    args = _config(tmp_path / "run", max_steps=2, save_steps=2, per_device_train_batch_size=4)
    ZOTrainer(model=tiny_bert_classifier(), args=args, train_dataset=classification_dataset(8)).train()
    checkpoint = tmp_path / "run" / "checkpoint-2"
    (checkpoint / "zo_head_optimizer.pt").unlink()
    args = _config(tmp_path / "resumed", max_steps=4, per_device_train_batch_size=4)
    trainer = ZOTrainer(model=tiny_bert_classifier(), args=args, train_dataset=classification_dataset(8))
    with pytest.raises(ValueError, match="has no zo_head_optimizer.pt, the AdamW state of the head"):
        trainer.train(resume_from_checkpoint=str(checkpoint))


def test_resume_from_a_missing_checkpoint(tmp_path):
    with pytest.raises(ValueError, match="Can't find a valid checkpoint at"):
        _resume(tmp_path, tmp_path / "nowhere", tiny_causal_lm("opt"))


def test_non_finite_losses_stop_with_the_step(tmp_path):
    weight = torch.nn.Parameter(torch.ones(3))
    optimizer = ZOSGD([weight], lr=0.01, max_consecutive_skips=2)
    optimizer.step(lambda: torch.tensor(float("inf")))
    with pytest.raises(
        FloatingPointError, match="2 consecutive ZO estimates had a non-finite loss \\(at optimizer step 1\\)"
    ):
        optimizer.step(lambda: torch.tensor(float("nan")))
    torch.testing.assert_close(weight.detach(), torch.ones(3))


def test_unreachable_hub_fails_at_construction_with_the_fix(tmp_path, monkeypatch):
    import huggingface_hub

    def create_repo(self, repo_id, **kwargs):
        raise RuntimeError("[Errno -2] Name or service not known")  # what httpx raises without network

    monkeypatch.setattr(huggingface_hub.HfApi, "create_repo", create_repo)
    args = _config(tmp_path, push_to_hub=True, hub_model_id="someone/tiny-zo")
    with pytest.raises(ConnectionError, match=r"'someone/tiny-zo' could not be created .*Name or service not known"):
        ZOTrainer(model=tiny_causal_lm("opt"), args=args, train_dataset=lm_dataset(4))


def test_example_script_exits_with_the_message_and_no_traceback(tmp_path):
    import subprocess
    import sys

    script = Path(__file__).resolve().parents[1] / "examples" / "train.py"
    command = [sys.executable, str(script), "--model_name_or_path", str(tmp_path), "--output_dir", str(tmp_path)]
    result = subprocess.run([*command, "--zo_eps", "0"], capture_output=True, text=True, timeout=300)
    assert result.returncode == 2
    assert "error: zo_eps must be > 0, got 0.0" in result.stderr
    assert "Traceback" not in result.stderr


def test_demo_option_below_one_ends_in_one_line_naming_it():
    result = subprocess.run(
        [sys.executable, "-m", "hf_zo.demo", "--lora_rank", "0"], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 1
    assert result.stderr.strip() == "error: --lora_rank must be at least 1, got 0; leave it out for its default."


def test_trainers_first_order_optim_is_reported_as_unused(tmp_path, caplog):
    import logging

    with caplog.at_level(logging.WARNING, logger="hf_zo.training.config"):
        _config(tmp_path)
        assert "optim=" not in caplog.text and "neftune" not in caplog.text
        _config(tmp_path, optim="adafactor")
        _config(tmp_path, neftune_noise_alpha=5.0)
    assert "optim='adafactor' chooses Trainer's first-order optimizer, which ZOTrainer does not use" in caplog.text
    assert "neftune_noise_alpha=5.0 is ignored" in caplog.text


@pytest.mark.parametrize("problem", ["regression", "multi_label_classification"])
def test_linear_probe_forced_on_a_head_that_is_not_a_softmax_names_the_fix(tmp_path, problem):
    from transformers import BertForSequenceClassification

    from tiny_models import tiny_bert_config

    num_labels = 1 if problem == "regression" else 3
    model = BertForSequenceClassification(tiny_bert_config(num_labels=num_labels, problem_type=problem))
    rows = [
        {"input_ids": [5, 6, 7], "label": [0.25, 1.0, 0.0][:num_labels] if problem != "regression" else 2.5}
        for _ in range(4)
    ]
    trainer = ZOTrainer(
        model=model, args=_config(tmp_path, zo_head_init="linear_probe"), train_dataset=Dataset.from_list(rows)
    )
    with pytest.raises(ValueError, match=f"problem_type is {problem}.*zo_head_init='none'"):
        trainer.train()
