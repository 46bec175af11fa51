"""ZO under FSDP2 (`hf_zo.parallel.fsdp`): two CPU processes launched with `accelerate launch` and the FSDP2 config of
the examples train bitwise as one process with gradient accumulation 2, and what FSDP2 does not combine with is
refused at construction.

The launch is one module-scoped fixture (`tests/fsdp_worker.py`, every case in one launch); the reference runs in
this process with one intra-op thread, as the workers do, so every comparison is bitwise.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import fsdp_worker
import pytest
import torch
from safetensors.torch import load_file

from hf_zo.optim import ZO_OPTIMIZERS
from hf_zo.parallel import DistZOPlugin
from hf_zo.parallel.fsdp import (
    check_fsdp_layout,
    check_fsdp_state_dict_type,
    check_fsdp_version,
    fsdp_version_from_env,
    sharding_mesh,
)

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "examples" / "accelerate_configs" / "fsdp2_cpu_2_processes.yaml"
HSDP_CONFIG = ROOT / "examples" / "accelerate_configs" / "fsdp2_cpu_2x2.yaml"
BIN = Path(sys.executable).parent
RUNS = [*fsdp_worker.FAMILIES, "llama_lora", "bert"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict:
    """One process, gradient accumulation 2: the runs FSDP2 on two processes must reproduce."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return fsdp_worker.run_scenario("reference", tmp_path_factory.mktemp("reference"))
    finally:
        torch.set_num_threads(threads)


def _run(command: list[str]) -> str:
    """Run `command` from the repository root (one intra-op thread, offline); return its output, which must end
    cleanly."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_ZO_", "ACCELERATE_", "FSDP_"))}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1")
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-5000:]
    assert "terminate called" not in output, output[-5000:]
    return output


def _launch_fsdp2(script: Path, *args: str, config: Path = CONFIG, launcher: tuple[str, ...] = ()) -> str:
    return _run([str(BIN / "accelerate"), "launch", "--config_file", str(config), *launcher, str(script), *args])


@pytest.fixture(scope="module")
def fsdp2(tmp_path_factory) -> list[dict]:
    """accelerate launch with examples/accelerate_configs/fsdp2_cpu_2_processes.yaml: each rank's results."""
    out = tmp_path_factory.mktemp("fsdp2")
    _launch_fsdp2(ROOT / "tests" / "fsdp_worker.py", "fsdp2", str(out))
    return [torch.load(out / f"rank{rank}.pt") for rank in range(2)]


def _assert_bitwise_equal(tensors: dict, expected: dict) -> None:
    assert tensors.keys() == expected.keys()
    for name, tensor in tensors.items():
        assert torch.equal(tensor, expected[name]), f"{name} differs by {(tensor - expected[name]).abs().max()}"


@pytest.mark.multiprocess
@pytest.mark.parametrize("run", RUNS)
def test_fsdp2_on_two_processes_equals_gradient_accumulation(fsdp2, reference, run):
    # Each rank runs the forwards of its own micro-batch at its point of the step (global micro-batch 2m + r, as in
    # ZO data parallelism), so the losses, the weights and the saved folder are those of one process.
    expected = reference[run]
    assert len(expected["losses"]) == fsdp_worker.STEPS
    for rank in fsdp2:
        assert rank[run]["losses"] == expected["losses"]
        _assert_bitwise_equal(rank[run]["params"], expected["params"])
    _assert_bitwise_equal(fsdp2[0][run]["saved"], expected["saved"])


@pytest.mark.multiprocess
@pytest.mark.parametrize("run", ["opt", "llama_lora"])
def test_fsdp2_resumes_from_its_checkpoint_bitwise(fsdp2, reference, run):
    # checkpoint-2 holds the whole weights (an ordinary folder); each rank loads its own rows of them.
    for rank in fsdp2:
        assert rank[f"{run}_resumed"]["losses"] == reference[run]["losses"]
        _assert_bitwise_equal(rank[f"{run}_resumed"]["params"], reference[run]["params"])
    _assert_bitwise_equal(fsdp2[0][f"{run}_resumed"]["saved"], reference[run]["saved"])


BASES = {
    "llama_lora": lambda: fsdp_worker.tiny_causal_lm("llama"),  # the bare base: replay adds the recorded adapter
    "bert": fsdp_worker.tiny_bert_classifier,
    **{family: (lambda family=family: fsdp_worker.tiny_causal_lm(family)) for family in fsdp_worker.FAMILIES},
}


@pytest.mark.multiprocess
@pytest.mark.parametrize("run", [*RUNS, "opt_resumed", "llama_lora_resumed"])
def test_fsdp2_trajectory_replays_from_the_unsharded_base_to_the_saved_weights(fsdp2, reference, run):
    # Every rank records the step records; the saving rank writes the trajectory, its checksums taken on the whole
    # (gathered) weights. A resumed run continues checkpoint-2's trajectory, so it replays from the base too.
    from hf_zo.trajectory import ZOTrajectory, replay

    trajectory = ZOTrajectory.from_bytes(fsdp2[0][run]["trajectory"])
    assert trajectory.first_step == 0 and len(trajectory) == fsdp_worker.STEPS
    model = replay(BASES[run.removesuffix("_resumed")](), trajectory)  # verify: start and end checksums
    replayed = {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}
    _assert_bitwise_equal(replayed, reference[run.removesuffix("_resumed")]["params"])


@pytest.mark.multiprocess
def test_fsdp2_runs_move_their_weights(reference):
    # Guards the equalities above: three steps change every run's weights.
    base = fsdp_worker.lora(fsdp_worker.tiny_causal_lm("llama"))
    start = {n: p.detach() for n, p in base.named_parameters() if p.requires_grad}
    assert all(not torch.equal(start[n], p) for n, p in reference["llama_lora"]["params"].items())


@pytest.mark.multiprocess
def test_fsdp2_sharded_checkpoints_resume_bitwise(reference, tmp_path):
    # fsdp_state_dict_type SHARDED_STATE_DICT: each checkpoint holds every process's shards
    # (torch.distributed.checkpoint), and a resume from it continues as the uninterrupted run; save_model still
    # writes the whole weights.
    launcher = ("--fsdp_state_dict_type", "SHARDED_STATE_DICT")
    _launch_fsdp2(ROOT / "tests" / "fsdp_worker.py", "sharded", str(tmp_path), launcher=launcher)
    ranks = [torch.load(tmp_path / f"rank{rank}.pt") for rank in range(2)]
    for run in ("llama", "llama_lora"):
        checkpoint = tmp_path / run / "checkpoint-2"
        assert (checkpoint / "pytorch_model_fsdp_0").is_dir()
        assert not any(checkpoint.glob("*.safetensors"))  # no gathered weights in a sharded checkpoint
        for rank in ranks:
            for name in (run, f"{run}_resumed"):
                _assert_bitwise_equal(rank[name]["params"], reference[run]["params"])
        _assert_bitwise_equal(ranks[0][f"{run}_resumed"]["saved"], reference[run]["saved"])
        assert ranks[0][f"{run}_resumed"]["losses"] == reference[run]["losses"]


@pytest.mark.multiprocess
def test_fsdp2_over_two_groups_of_two_shards_equals_gradient_accumulation_4(tmp_path):
    # HSDP, fsdp2_cpu_2x2.yaml: two groups each hold the model in two shards; the four processes run their own
    # micro-batches and exchange the losses as ZO data parallelism does, so the steps are one process's with
    # gradient accumulation 4, and the replicas' shards stay equal.
    output = _launch_fsdp2(ROOT / "tests" / "fsdp_worker.py", "hsdp", str(tmp_path), config=HSDP_CONFIG)
    lines = {line[line.index("hf_zo layout") :] for line in output.splitlines() if "hf_zo layout: fsdp2" in line}
    assert len(lines) == 2  # one per run, the same on every rank
    for line in lines:
        fields = dict(field.split("=") for field in line.split()[3:])
        assert fields["world"] == "4" and fields["replicas"] == "2"
        assert int(fields["local_param_bytes"]) <= 0.6 * int(fields["total_param_bytes"])  # half of each block
    ranks = [torch.load(tmp_path / f"rank{rank}.pt") for rank in range(4)]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        reference = fsdp_worker.run_scenario("reference_hsdp", tmp_path / "reference")
    finally:
        torch.set_num_threads(threads)
    for run, expected in reference.items():
        assert ranks[0][run]["losses"] == expected["losses"], run
        _assert_bitwise_equal(ranks[0][run]["saved"], expected["saved"])
        for rank in ranks:
            _assert_bitwise_equal(rank[run]["params"], expected["params"])


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("tuning", ["full", "lora_prompt"])
def test_examples_train_on_the_embedded_llm_under_fsdp2_equals_gradient_accumulation(tmp_path, tuning):
    # Bitwise because the embedded LLM's file aligns its tensors as FSDP2's gathered buffers are aligned: the CPU
    # matrix kernel of the tied head rounds differently at other alignments (hf_zo.models.smollm2.TENSOR_ALIGNMENT).
    from hf_zo.models import embedded_llm_path

    data = ROOT / "examples" / "data" / "sst2"
    arguments = ["--model_name_or_path", embedded_llm_path(), "--task_name", "sst2"]
    arguments += ["--train_file", str(data / "train.tsv"), "--validation_file", str(data / "validation.tsv")]
    arguments += [
        "--num_train",
        "32",
        "--num_eval",
        "8",
        "--max_steps",
        "2",
        "--per_device_train_batch_size",
        "2",
        "--logging_steps",
        "1",
    ]
    arguments += ["--save_strategy", "no", "--report_to", "none", "--log_level", "info"]
    if tuning == "lora_prompt":  # FZOO and LoRA on the upper layers' q_proj
        arguments += ["--peft", "lora", "--recipe", "prompt"]
    train = ROOT / "examples" / "train.py"
    output = _launch_fsdp2(train, *arguments, "--output_dir", str(tmp_path / "fsdp2"))
    _run(
        [
            sys.executable,
            str(train),
            *arguments,
            "--gradient_accumulation_steps",
            "2",
            "--output_dir",
            str(tmp_path / "one"),
        ]
    )

    (line,) = [line for line in output.splitlines() if "hf_zo layout: fsdp2" in line]
    fields = dict(field.split("=") for field in line.split()[3:])
    assert fields["world"] == "2" and int(fields["local_param_bytes"]) <= 0.6 * int(fields["total_param_bytes"])
    weights = "model.safetensors" if tuning == "full" else "adapter_model.safetensors"
    _assert_bitwise_equal(load_file(tmp_path / "fsdp2" / weights), load_file(tmp_path / "one" / weights))
    losses = [
        [
            entry["loss"]
            for entry in json.loads((tmp_path / run / "trainer_state.json").read_text())["log_history"]
            if "loss" in entry
        ]
        for run in ("fsdp2", "one")
    ]
    assert len(losses[0]) == 2 and losses[0] == losses[1]


def test_fsdp_version_is_read_from_accelerate_launch(monkeypatch):
    monkeypatch.delenv("ACCELERATE_USE_FSDP", raising=False)
    assert fsdp_version_from_env() is None
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.setenv("FSDP_VERSION", "2")
    assert fsdp_version_from_env() == 2
    monkeypatch.setenv("FSDP_VERSION", "1")
    with pytest.raises(ValueError, match="fsdp_version=1: hf_zo trains under FSDP2 only.*fsdp_version: 2"):
        DistZOPlugin()


@pytest.mark.parametrize("value", ["LOCAL_STATE_DICT", "local_state_dict", "2"])
def test_a_local_state_dict_type_is_refused_when_the_trainer_is_built(monkeypatch, tmp_path, value):
    # Checkpoints under FSDP2 hold the whole weights or each process's shards; FSDP1's local type has no meaning here.
    from hf_zo import ZOConfig, ZOTrainer

    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.setenv("FSDP_VERSION", "2")
    monkeypatch.setenv("FSDP_STATE_DICT_TYPE", value)
    args = ZOConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none", max_steps=1)
    message = "fsdp_state_dict_type='LOCAL_STATE_DICT' cannot combine with hf_zo's FSDP2.*FSDP_STATE_DICT_TYPE"
    with pytest.raises(ValueError, match=message):
        ZOTrainer(model=fsdp_worker.tiny_causal_lm("llama"), args=args, train_dataset=fsdp_worker.lm_dataset(4))
    with pytest.raises(ValueError, match=message):
        DistZOPlugin()
    for accepted, expected in (
        ("FULL_STATE_DICT", "FULL_STATE_DICT"),
        ("1", "FULL_STATE_DICT"),
        ("3", "SHARDED_STATE_DICT"),
    ):
        monkeypatch.setenv("FSDP_STATE_DICT_TYPE", accepted)
        assert DistZOPlugin().fsdp_state_dict_type == expected
    monkeypatch.delenv("FSDP_STATE_DICT_TYPE")
    assert DistZOPlugin().fsdp_state_dict_type is None  # unset: the whole weights are saved
    check_fsdp_state_dict_type(None, "SHARDED_STATE_DICT")  # without FSDP the type means nothing


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(offload="disk"), "zo_offload='disk' cannot combine with FSDP2.*launch without FSDP and keep zo_offload"),
        (dict(pertp_size=2), "zo_perturbation_parallel_size=2 cannot combine with FSDP2.*=1"),
        (dict(engine="dual"), "zo_engine='dual' cannot combine with FSDP2.*zo_engine='sequential'"),
    ],
)
def test_what_fsdp2_does_not_combine_with_is_refused(kwargs, message):
    check_fsdp_layout(None, **kwargs)  # without FSDP, all fine
    with pytest.raises(ValueError, match=message):
        check_fsdp_layout(2, **kwargs)


def test_the_groups_of_sharded_replicas_are_read_from_accelerate_launch(monkeypatch):
    # A launch config's parallelism_config_dp_replicate_size (HSDP: groups of processes that each shard the model).
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.setenv("FSDP_VERSION", "2")
    monkeypatch.setenv("ACCELERATE_USE_PARALLELISM_CONFIG", "true")
    monkeypatch.setenv("PARALLELISM_CONFIG_DP_SHARD_SIZE", "2")
    monkeypatch.setenv("PARALLELISM_CONFIG_DP_REPLICATE_SIZE", "2")
    assert DistZOPlugin().fsdp_replicate_size == 2
    monkeypatch.setenv("PARALLELISM_CONFIG_DP_REPLICATE_SIZE", "1")  # what accelerate launch sets by default
    assert DistZOPlugin().fsdp_replicate_size == 1
    monkeypatch.setenv("PARALLELISM_CONFIG_DP_REPLICATE_SIZE", "2")
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "false")  # without FSDP the parallelism config is not hf_zo's
    assert DistZOPlugin().fsdp_replicate_size == 1
    with pytest.raises(ValueError, match="fsdp_replicate_size must be an integer >= 1, got 0"):
        DistZOPlugin(fsdp_version=2, fsdp_replicate_size=0)


def test_groups_of_sharded_replicas_must_divide_the_processes():
    four_processes = SimpleNamespace(size=lambda: 4)
    with pytest.raises(ValueError, match="dp_replicate_size=3 must divide the 4 processes"):
        sharding_mesh(four_processes, 3)
    assert sharding_mesh(four_processes, 1) is four_processes


def test_the_plugin_refuses_fsdp2_with_offload_at_construction():
    with pytest.raises(ValueError, match="cannot combine with FSDP2"):
        DistZOPlugin(fsdp_version=2, offload="cpu")
    check_fsdp_version(None)
    check_fsdp_version(2)


@pytest.mark.parametrize("name", sorted(ZO_OPTIMIZERS))
def test_only_optimizers_whose_update_waits_in_the_pending_move_run_under_fsdp2(name):
    optimizer = ZO_OPTIMIZERS[name]
    if name in ("zo_sgd", "fzoo"):
        optimizer.check_execution(fsdp=True)
    else:
        with pytest.raises(ValueError, match=f"FSDP2 needs zo_optimizer='zo_sgd' or 'fzoo' \\(got '{name}'\\)"):
            optimizer.check_execution(fsdp=True)
