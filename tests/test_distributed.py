"""DistZO2 layouts on gloo: perturbation parallelism, ZO data parallelism and both, launched with the real launchers.

Each multi-process scenario is one launch of `tests/distributed_worker.py` (module-scoped fixtures), shared by the
assertions below; every process runs one intra-op thread, so a forward gives the same bits in every layout and all
comparisons are bitwise (no tolerance). Run with ``pytest tests/test_distributed.py -m multiprocess``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import distributed_worker
import pytest
import torch

from hf_zo import ZOConfig, ZOTrajectory, replay
from hf_zo.optim import ZOSGD, HiZOO, ZOSGDConservative
from hf_zo.parallel import DistZOPlugin, ZOMesh
from hf_zo.parallel.estimation import ParallelEstimation

from tiny_models import tiny_causal_lm

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "distributed_worker.py"
BIN = Path(sys.executable).parent
LAUNCH_TIMEOUT = 300


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_ZO_")}
    env.update(OMP_NUM_THREADS="1", ACCELERATE_USE_CPU="true", PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1", **extra)
    return env


def _run(command: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT)


def _launch(command: list[str], out: Path, world_size: int, **env: str) -> list[dict]:
    """Run a launch that must succeed and exit cleanly; return each rank's results."""
    result = _run(command, _env(**env))
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-5000:]
    assert "terminate called" not in output, output[-5000:]
    return [torch.load(out / f"rank{rank}.pt") for rank in range(world_size)]


def _torchrun(nproc: int, scenario: str, out: Path) -> list[str]:
    return [str(BIN / "torchrun"), "--standalone", f"--nproc_per_node={nproc}", str(WORKER), scenario, str(out)]


def _assert_bitwise_equal(params: dict, expected: dict) -> None:
    assert params.keys() == expected.keys()
    for name, tensor in params.items():
        assert torch.equal(tensor, expected[name]), f"{name} differs by {(tensor - expected[name]).abs().max()}"


# ---------------------------------------------------------------------------------------------------- launches


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict:
    """One process (this one, with one intra-op thread like the workers): the runs the layouts must reproduce."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return distributed_worker.run_scenario("reference", tmp_path_factory.mktemp("reference"))
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def pertp2(tmp_path_factory) -> list[dict]:
    """torchrun, 2 processes, PertP = 2 (set through the plugin's environment variable)."""
    out = tmp_path_factory.mktemp("pertp2")
    return _launch(_torchrun(2, "pertp2", out), out, 2, HF_ZO_PERTURBATION_PARALLEL_SIZE="2")


@pytest.fixture(scope="module")
def dp2(tmp_path_factory) -> list[dict]:
    """accelerate launch, 2 processes, DP = 2."""
    out = tmp_path_factory.mktemp("dp2")
    command = [str(BIN / "accelerate"), "launch", "--multi_gpu", "--num_processes=2", "--main_process_port=0"]
    return _launch([*command, str(WORKER), "dp2", str(out)], out, 2)


@pytest.fixture(scope="module")
def mesh2x2(tmp_path_factory) -> list[dict]:
    """torchrun, 4 processes: DP = 2 x PertP = 2, then PertP = 4 with 2 perturbations (layouts from ZOConfig)."""
    out = tmp_path_factory.mktemp("mesh2x2")
    return _launch(_torchrun(4, "2x2", out), out, 4)


# ---------------------------------------------------------------------------------------------------- layouts


@pytest.mark.multiprocess
def test_perturbation_parallel_equals_one_process_doing_both_forwards(pertp2, reference):
    for rank in pertp2:
        _assert_bitwise_equal(rank["runs"]["full"]["params"], reference["full"]["params"])


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "run, reference_run",
    [
        ("full", "full_accumulate2"),  # OPT
        ("lora", "lora_accumulate2"),  # Llama
        ("qwen2", "qwen2_accumulate2"),
        ("gpt2", "gpt2_accumulate2"),
        ("bert_zo", "bert_zo_accumulate2"),  # a classifier, its head trained by ZO too
        ("lozo", "lozo_accumulate2"),
        ("hizoo", "hizoo_accumulate2"),
        ("fzoo", "fzoo_accumulate2"),  # one-sided estimates around each micro-batch's centre loss
        ("ragged", "ragged_accumulate2"),  # batches grouped by length over the global batch
        ("stopped", "stopped_accumulate4"),  # a callback stops training in step 2's accumulation
    ],
)
def test_data_parallel_equals_gradient_accumulation(dp2, reference, run, reference_run):
    # DP rank r's m-th micro-batch is global micro-batch 2m + r with perturbation index 2m + r: the same seeds,
    # batches and record order as one process accumulating 2 micro-batches, so no tolerance is needed.
    for rank in dp2:
        _assert_bitwise_equal(rank["runs"][run]["params"], reference[reference_run]["params"])


@pytest.mark.multiprocess
def test_a_stop_in_an_accumulation_discards_the_step_on_every_rank(dp2, reference):
    # Step 2 is recorded without an update: the seeds of global micro-batches 0 and 1, swept, and no records.
    for results in (*(rank["runs"]["stopped"] for rank in dp2), reference["stopped_accumulate4"]):
        steps = list(ZOTrajectory.from_bytes(results["trajectory"]).steps())
        assert len(steps) == 2 and steps[1].records == [] and len(steps[1].seeds) == 2


@pytest.mark.multiprocess
def test_data_parallel_classifier_replicas_agree_with_zo_and_first_order_heads(dp2):
    for run in ("bert", "bert_first_order"):
        _assert_bitwise_equal(dp2[0]["runs"][run]["params"], dp2[1]["runs"][run]["params"])


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "layout, run, reference_run",
    [
        ("pertp2", "bert_first_order", "bert_first_order_accumulate1"),
        ("dp2", "bert_first_order_accumulate2", "bert_first_order_accumulate4"),
        ("mesh2x2", "bert_first_order_accumulate1", "bert_first_order_accumulate2"),
        ("mesh2x2", "bert_first_order_accumulate2", "bert_first_order_accumulate4"),
    ],
)
def test_first_order_head_equals_one_process_in_every_layout(request, reference, layout, run, reference_run):
    # Every forward's head gradients are gathered and added in one process's order: each micro-batch's forwards
    # (split between PertP ranks) left to right, then the micro-batches (split between DP groups) in global order.
    for rank in request.getfixturevalue(layout):
        _assert_bitwise_equal(rank["runs"][run]["params"], reference[reference_run]["params"])


@pytest.mark.multiprocess
def test_first_order_head_runs_differ_with_their_accumulation(reference):
    # Guards the equalities above: one more micro-batch per step must change the head.
    heads = [reference[f"bert_first_order_accumulate{k}"]["params"]["classifier.weight"] for k in (1, 2, 4)]
    assert not torch.equal(heads[0], heads[1]) and not torch.equal(heads[1], heads[2])


@pytest.mark.multiprocess
@pytest.mark.parametrize("run", ["full", "lora", "lora_dual", "disk", "hizoo", "fzoo", "stopped"])
def test_trajectory_of_a_data_parallel_run_replays_in_one_process(dp2, run):
    # Each rank records the perturbations of every rank, in global order, so one process replays the whole run.
    base = (
        tiny_causal_lm("opt")
        if run in ("full", "disk", "hizoo", "fzoo", "stopped")
        else distributed_worker.lora(tiny_causal_lm("llama"))
    )
    model = replay(base, ZOTrajectory.from_bytes(dp2[0]["runs"][run]["trajectory"]))
    trained = {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}
    _assert_bitwise_equal(trained, dp2[0]["runs"][run]["params"])


@pytest.mark.multiprocess
def test_2d_mesh_equals_gradient_accumulation_on_every_rank(mesh2x2, reference):
    for rank in mesh2x2:
        _assert_bitwise_equal(rank["runs"]["full"]["params"], reference["full_accumulate2"]["params"])


@pytest.mark.multiprocess
def test_four_way_perturbation_parallelism_splits_two_perturbations(mesh2x2, reference):
    # 2 perturbations = 4 signed forwards, one per rank.
    for rank in mesh2x2:
        _assert_bitwise_equal(rank["runs"]["pertp4_q2"]["params"], reference["full_q2"]["params"])
        assert rank["runs"]["pertp4_q2"]["bytes_per_step"] == 8 * 3  # one loss to each of 3 peers


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "run, reference_run",
    [("dual", "full"), ("disk", "full"), ("disk_sliced", "full"), ("lora_disk_sliced", "lora")],
)
def test_perturbation_parallel_dual_engine_and_offload_equal_one_sequential_process(
    pertp2, reference, run, reference_run
):
    # Rank 0 runs the + pass, rank 1 the - pass; each replays the other's sweeps block by block (sliced: each rank
    # uploads half of every block from its own disk tier and the pair all-gathers it).
    for rank in pertp2:
        _assert_bitwise_equal(rank["runs"][run]["params"], reference[reference_run]["params"])


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "run, reference_run",
    [("disk", "full_accumulate2"), ("lora_dual", "lora_accumulate2"), ("lora_disk", "lora_accumulate2")],
)
def test_data_parallel_dual_engine_and_offload_equal_gradient_accumulation(dp2, reference, run, reference_run):
    # Each rank runs both passes of its micro-batch and replays the other group's (every block visited, no forward).
    for rank in dp2:
        _assert_bitwise_equal(rank["runs"][run]["params"], reference[reference_run]["params"])


@pytest.mark.multiprocess
def test_2d_mesh_with_sliced_upload_equals_gradient_accumulation(mesh2x2, reference):
    for rank in mesh2x2:
        _assert_bitwise_equal(rank["runs"]["disk_sliced"]["params"], reference["full_accumulate2"]["params"])


@pytest.mark.multiprocess
def test_training_moved_the_weights(reference):
    # Guards the equalities above against a run that silently did nothing.
    moved = reference["full"]["params"]["model.decoder.layers.0.fc1.weight"]
    moved_more = reference["full_accumulate2"]["params"]["model.decoder.layers.0.fc1.weight"]
    assert not torch.equal(moved, moved_more)


@pytest.mark.multiprocess
def test_total_batch_counts_data_parallel_groups_only(pertp2, dp2, mesh2x2):
    # per_device_train_batch_size=2: PertP ranks share their batch, DP groups add theirs.
    assert [rank["runs"]["full"]["total_batch"] for rank in pertp2] == [2, 2]
    assert [rank["runs"]["full"]["total_batch"] for rank in dp2] == [4, 4]
    assert [rank["runs"]["full"]["total_batch"] for rank in mesh2x2] == [4, 4, 4, 4]


# ---------------------------------------------------------------------------------------------------- communication


@pytest.mark.multiprocess
def test_bytes_per_step_are_scalars_independent_of_model_size(pertp2, dp2, mesh2x2):
    for rank in pertp2:
        runs = rank["runs"]
        # One float64 loss each way per micro-batch, for a 2-layer width-32 and a width-128 model alike.
        assert runs["full"]["bytes_per_step"] == runs["wide"]["bytes_per_step"] == 8
        wide_numel = sum(p.numel() for p in runs["wide"]["params"].values())
        assert wide_numel > 4 * sum(p.numel() for p in runs["full"]["params"].values())
    for rank in dp2:
        # The record count (8 bytes), then one (index, seed, g, L+, L-) record of 5 int64 (40 bytes); LoRA alike.
        assert rank["runs"]["full"]["bytes_per_step"] == rank["runs"]["lora"]["bytes_per_step"] == 48
        assert rank["runs"]["full"]["calls_per_step"] == 2
        assert rank["runs"]["hizoo"]["bytes_per_step"] == 48 + 8  # HiZOO's records carry their curvature too
    for rank in mesh2x2:
        assert rank["runs"]["full"]["bytes_per_step"] == rank["runs"]["disk_sliced"]["bytes_per_step"] == 8 + 48
        assert rank["runs"]["full"]["calls_per_step"] == 3


@pytest.mark.multiprocess
def test_offload_keeps_scalar_traffic_and_counts_sliced_upload_apart(pertp2, dp2, mesh2x2):
    for rank in pertp2:
        runs = rank["runs"]
        # The scalar collectives are those of the resident sequential run, whatever the engine and offload.
        for run in ("dual", "disk", "disk_sliced", "lora_disk_sliced"):
            assert runs[run]["bytes_per_step"] == 8
        # Only sliced upload moves parameter bytes between ranks, and only through its own counter.
        assert runs["disk"]["upload_bytes_per_step"] == 0
        assert runs["disk_sliced"]["upload_bytes_per_step"] > 0
        assert runs["lora_disk_sliced"]["upload_bytes_per_step"] > 0
    for run in ("disk_sliced", "lora_disk_sliced"):  # each rank sends its half of every block
        assert pertp2[0]["runs"][run]["upload_bytes_per_step"] == pertp2[1]["runs"][run]["upload_bytes_per_step"]
    for rank in dp2:
        assert rank["runs"]["disk"]["bytes_per_step"] == rank["runs"]["lora_disk"]["bytes_per_step"] == 48
        assert rank["runs"]["disk"]["upload_bytes_per_step"] == 0
    assert all(rank["runs"]["disk_sliced"]["upload_bytes_per_step"] > 0 for rank in mesh2x2)


# ---------------------------------------------------------------------------------------------------- checkpoints


@pytest.mark.multiprocess
def test_checkpoints_are_written_by_the_main_process_only(pertp2):
    main, other = pertp2[0]["writes"], pertp2[1]["writes"]
    assert {"config.json", "optimizer.pt", "scheduler.pt", "trainer_state.json", "rng_state_0.pth"} <= set(main)
    assert main.count("optimizer.pt") == 2  # checkpoint-2 and checkpoint-4, once each
    # Each process saves its own RNG state (Trainer's resume contract); nothing else.
    assert set(other) == {"rng_state_1.pth"}


@pytest.mark.multiprocess
def test_resume_is_exact_in_the_same_layout(pertp2, dp2):
    for rank in pertp2:
        _assert_bitwise_equal(rank["runs"]["resumed"]["params"], rank["runs"]["full"]["params"])
    # Data parallel, resumed in the second epoch of length-grouped batches, each rank skipping its done batches.
    for rank in dp2:
        _assert_bitwise_equal(rank["runs"]["ragged_resumed"]["params"], rank["runs"]["ragged"]["params"])


# ---------------------------------------------------------------------------------------------------- failures


@pytest.mark.multiprocess
def test_a_hung_rank_makes_the_others_fail_within_the_timeout(tmp_path):
    start = time.monotonic()
    result = _run(_torchrun(2, "hang", tmp_path), _env(HF_ZO_PERTURBATION_PARALLEL_SIZE="2", HF_ZO_TIMEOUT="3"))
    elapsed = time.monotonic() - start
    output = result.stdout + result.stderr
    assert result.returncode != 0
    assert "did not answer within 3 s" in output, output[-5000:]
    assert elapsed < 120  # start-up plus the 3 s bound, not the 600 s the hung rank sleeps


@pytest.mark.multiprocess
def test_replica_verification_passes_on_agreeing_replicas_and_stops_diverged_ones(dp2, tmp_path):
    _assert_bitwise_equal(dp2[0]["runs"]["verified"]["params"], dp2[1]["runs"]["verified"]["params"])
    result = _run(_torchrun(2, "diverge", tmp_path), _env())
    output = result.stdout + result.stderr
    assert result.returncode != 0
    assert "the replicas' trainable parameters differ after step 2" in output, output[-5000:]
    assert "terminate called" not in output


def test_parameter_checksum_sees_every_bit():
    from hf_zo.parallel.replicas import parameter_checksum

    tensors = [torch.randn(1000), torch.randn(3, 7).to(torch.bfloat16)]
    reference = parameter_checksum(tensors)
    assert parameter_checksum([t.clone() for t in tensors]) == reference
    nudged = [tensors[0].clone(), tensors[1]]
    nudged[0][500] = torch.nextafter(nudged[0][500], torch.tensor(1e9))
    assert parameter_checksum(nudged) != reference
    assert parameter_checksum(tensors[::-1]) != reference


# ------------------------------------------------------------------------------------------ plugin (in process)


def test_plugin_reads_hf_zo_environment_variables(monkeypatch):
    monkeypatch.setenv("HF_ZO_PERTURBATION_PARALLEL_SIZE", "4")
    monkeypatch.setenv("HF_ZO_TIMEOUT", "12")
    monkeypatch.setenv("HF_ZO_BACKEND", "gloo")
    plugin = DistZOPlugin()
    assert (plugin.perturbation_parallel_size, plugin.timeout_seconds, plugin.backend) == (4, 12.0, "gloo")
    assert DistZOPlugin(perturbation_parallel_size=2).perturbation_parallel_size == 2


def test_plugin_from_zo_config_rejects_a_conflicting_environment(monkeypatch, tmp_path):
    args = ZOConfig(output_dir=str(tmp_path), zo_perturbation_parallel_size=2, ddp_timeout=60)
    plugin = DistZOPlugin.from_zo_config(args)
    assert (plugin.perturbation_parallel_size, plugin.timeout_seconds) == (2, 60.0)
    monkeypatch.setenv("HF_ZO_PERTURBATION_PARALLEL_SIZE", "1")
    with pytest.raises(ValueError, match="zo_perturbation_parallel_size=2 disagrees with HF_ZO_PERTURBATION"):
        DistZOPlugin.from_zo_config(args)
    monkeypatch.delenv("HF_ZO_PERTURBATION_PARALLEL_SIZE")
    monkeypatch.setenv("HF_ZO_TIMEOUT", "5")
    with pytest.raises(ValueError, match="ddp_timeout=60.0 disagrees with HF_ZO_TIMEOUT=5.0"):
        DistZOPlugin.from_zo_config(args)
    # Fields at their defaults give way to the environment; an agreeing variable is fine.
    defaults = ZOConfig(output_dir=str(tmp_path))
    assert DistZOPlugin.from_zo_config(defaults).timeout_seconds == 5.0
    monkeypatch.setenv("HF_ZO_TIMEOUT", "60")
    monkeypatch.setenv("HF_ZO_PERTURBATION_PARALLEL_SIZE", "2")
    assert DistZOPlugin.from_zo_config(args).timeout_seconds == 60.0
    assert DistZOPlugin.from_zo_config(defaults).perturbation_parallel_size == 2


def test_plugin_rejects_bad_values():
    with pytest.raises(ValueError, match="perturbation_parallel_size must be an integer >= 1, got 0"):
        DistZOPlugin(perturbation_parallel_size=0)
    with pytest.raises(ValueError, match="backend must be 'gloo' or 'nccl', got 'mpi'"):
        DistZOPlugin(backend="mpi")
    with pytest.MonkeyPatch.context() as env:
        env.setenv("HF_ZO_TIMEOUT", "ten")
        with pytest.raises(ValueError, match="HF_ZO_TIMEOUT must be a valid float, got 'ten'"):
            DistZOPlugin()
    with pytest.raises(ValueError, match="\\(4\\) must divide the 2 signed forwards"):
        ZOConfig(output_dir="unused", zo_perturbation_parallel_size=4)


def test_single_process_plugin_leaves_the_optimizer_alone(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    optimizer = ZOSGD([torch.nn.Parameter(torch.zeros(3))], lr=0.1)
    plugin = DistZOPlugin()
    assert plugin.prepare_optimizer(optimizer).parallel is None
    assert not plugin.is_distributed
    with pytest.raises(ValueError, match="number of processes \\(1\\) must be a multiple"):
        DistZOPlugin(perturbation_parallel_size=2).setup()


def test_strategy_rejects_a_pertp_size_that_does_not_divide_the_forwards():
    optimizer = ZOSGD([torch.nn.Parameter(torch.zeros(3))], lr=0.1, num_perturbations=1)
    strategy = ParallelEstimation(ZOMesh(dp_size=1, pertp_size=4), collectives=None)
    with pytest.raises(ValueError, match="\\(4\\) must divide the 2 signed forwards"):
        strategy.check(optimizer)


def test_strategy_rejects_layouts_the_replicas_cannot_agree_on():
    params = [torch.nn.Parameter(torch.zeros(3))]
    data_parallel = ParallelEstimation(ZOMesh(dp_size=2, pertp_size=1), collectives=None)
    with pytest.raises(ValueError, match="zo_sgd_cons chooses its update from the loss on each rank's own"):
        data_parallel.check(ZOSGDConservative(params, lr=0.1))
    perturbation_parallel = ParallelEstimation(ZOMesh(dp_size=1, pertp_size=2), collectives=None)
    with pytest.raises(
        ValueError, match="HiZOO measures the loss at the unperturbed .* zo_perturbation_parallel_size=1"
    ):
        perturbation_parallel.check(HiZOO(params, lr=0.1))


@pytest.mark.parametrize("dp_size, pertp_size, refused", [(2, 1, True), (2, 2, True), (1, 2, False)])
def test_the_plugin_refuses_zo_sgd_cons_under_data_parallelism(dp_size, pertp_size, refused):
    """`prepare_optimizer`, which ZOTrainer calls on every rank before any step, refuses a layout whose DP replicas
    would each pick the conservative candidate from their own batch (and so diverge)."""
    plugin = DistZOPlugin(perturbation_parallel_size=pertp_size)
    plugin.mesh = ZOMesh(dp_size=dp_size, pertp_size=pertp_size)  # as setup() builds it on dp x pertp processes
    weight = torch.nn.Parameter(torch.zeros(3))
    optimizer = ZOSGDConservative([weight], lr=0.1, num_perturbations=pertp_size)
    if not refused:  # the ranks of one PertP group share the batch, so they agree on the candidate
        assert plugin.prepare_optimizer(optimizer).parallel is not None
        return
    with pytest.raises(ValueError, match=rf"zo_sgd_cons .* replicas \(dp={dp_size}\) would diverge; use another"):
        plugin.prepare_optimizer(optimizer)
    assert optimizer.parallel is None and torch.equal(weight.detach(), torch.zeros(3))


def test_sliced_upload_needs_offload_and_a_perturbation_parallel_group(tmp_path):
    with pytest.raises(ValueError, match="zo_offload_sliced_upload=True shares the upload of offloaded blocks"):
        ZOConfig(output_dir=str(tmp_path), zo_offload_sliced_upload=True)
    args = ZOConfig(output_dir=str(tmp_path), zo_engine="dual", zo_offload="disk", zo_offload_sliced_upload=True)
    with pytest.raises(ValueError, match="but perturbation_parallel_size is 1; set zo_perturbation_parallel_size"):
        DistZOPlugin.from_zo_config(args)
    with pytest.raises(ValueError, match="but offload is None; set zo_offload='cpu' or 'disk'"):
        DistZOPlugin(perturbation_parallel_size=2, sliced_upload=True)
    plugin = DistZOPlugin.from_zo_config(ZOConfig(output_dir=str(tmp_path), zo_engine="dual", zo_offload="cpu"))
    assert (plugin.offload, plugin.offload_prefetch, plugin.sliced_upload) == ("cpu", 1, False)


@pytest.mark.parametrize("multi_process_request", [True, False])
def test_a_single_process_launch_that_asked_for_several_is_named(monkeypatch, caplog, multi_process_request):
    # `accelerate launch --cpu --num_processes 2` without --multi_gpu runs the script once, with a rendezvous address
    # but no WORLD_SIZE; a plain single-process `accelerate launch` sets neither.
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setenv("ACCELERATE_DYNAMO_BACKEND", "NO")
    if multi_process_request:
        monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    else:
        monkeypatch.delenv("MASTER_ADDR", raising=False)
    with caplog.at_level("WARNING", logger="hf_zo"):
        assert DistZOPlugin(backend="gloo").setup() == ZOMesh()
    named = [r for r in caplog.records if "started this script once" in r.getMessage()]
    assert len(named) == int(multi_process_request)
    if multi_process_request:
        assert "--multi_gpu" in named[0].getMessage()
