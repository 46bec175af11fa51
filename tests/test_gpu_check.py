"""benchmarks/gpu_check.sh, the one-call GPU check: its dry run (every part starts, finds no CUDA, skips cleanly),
its time limits and how it judges a part."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PARTS = ["environment", "tests", "step_cost", "offload", "accuracy", "quantized", "fsdp2", "big_model"]


def _gpu_check_module():
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "benchmarks" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_dry_run_starts_every_part_and_each_skips_cleanly(tmp_path):
    env = {key: value for key, value in os.environ.items() if key != "OUT"}
    env["PYTHON"] = sys.executable
    command = ["bash", str(ROOT / "benchmarks" / "gpu_check.sh"), "--dry-run", "--out", str(tmp_path)]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]

    figures = [json.loads(line) for line in (tmp_path / "figures.jsonl").read_text().splitlines()]
    by_part = {}
    for figure in figures:
        by_part.setdefault(figure["part"], []).append(figure)
    assert list(by_part) == PARTS
    (environment,) = by_part["environment"]
    assert environment["cuda_available"] is False and environment["torch"]
    (tests,) = by_part["tests"]  # pytest really ran: its report counts the skipped gpu tests
    assert tests["tests_passed"] == tests["tests_failed"] == 0
    assert tests["tests_skipped"] >= 10 and tests["skipped"] == "needs a CUDA device"
    for part in ("step_cost", "offload", "accuracy", "quantized"):  # each script printed its own skip line
        assert [f["skipped"] for f in by_part[part]] == ["CUDA is not available"], part
    (fsdp2,) = by_part["fsdp2"]  # benchmarks/fsdp2.py gpu started, counted no GPU and skipped
    assert fsdp2["gpus"] == 0 and fsdp2["skipped"] == "needs 2 or more GPUs"
    # big_model.py started for each stage (7B resident, 13B offloaded) and skipped, building nothing
    stages = [(f["shape"], f["mode"], f["skipped"]) for f in by_part["big_model"]]
    assert stages == [("7b", "bf16", "CUDA is not available"), ("13b", "bf16-cpu-offload", "CUDA is not available")]
    assert not (tmp_path / "big_model.jsonl").exists()

    log = (tmp_path / "log.txt").read_text()
    summary = (tmp_path / "summary.md").read_text()
    assert "dry run" in summary
    for part in PARTS:
        assert f"===== {part} (limit" in log
        status = "passed" if part == "environment" else "skipped"
        assert f"| {part} | {status} |" in summary
        assert f"gpu_check: {part} {status} in" in result.stdout


def test_a_part_past_its_limit_is_stopped_with_its_children(tmp_path):
    gpu_check = _gpu_check_module()
    child = "import subprocess, sys; subprocess.run([sys.executable, '-c', 'import time; time.sleep(60)'])"
    part = gpu_check.Part("offload", 1, [sys.executable, "-c", child])
    result = gpu_check.run_part(part, dict(os.environ), tmp_path)
    assert result["status"] == "failed" and result["note"] == "time limit of 1 s reached"
    assert result["seconds"] < 15


def test_outcome_of_a_part():
    gpu_check = _gpu_check_module()
    part = gpu_check.Part("step_cost", 120, ["step_cost"])
    skip = {"skipped": "CUDA is not available"}
    measured = {"shape": "opt-1.3b", "zo_step/forward": 2.4}
    assert gpu_check.outcome(part, 0, [skip], "") == ("skipped", "CUDA is not available")
    assert gpu_check.outcome(part, 0, [measured], "") == ("passed", "")
    assert gpu_check.outcome(part, 0, [], "") == ("failed", "printed no figures")
    assert gpu_check.outcome(part, 1, [measured], "Traceback\nRuntimeError: CUDA out of memory\n") == (
        "failed",
        "exit code 1: RuntimeError: CUDA out of memory",
    )
    assert gpu_check.outcome(part, 124, [measured], "") == ("failed", "time limit of 120 s reached")
    # Every figure skipped, for one reason or several: skipped; some: passed, the reasons in the note.
    assert gpu_check.outcome(part, 0, [skip, skip], "") == ("skipped", "CUDA is not available")
    short = {"shape": "13b", "skipped": "the 13b bf16 checkpoint needs 28.1 GB free"}
    assert gpu_check.outcome(part, 0, [measured, short], "") == (
        "passed",
        "some skipped: the 13b bf16 checkpoint needs 28.1 GB free",
    )
    tests = gpu_check.Part("tests", 75, ["pytest"])
    assert gpu_check.outcome(tests, 5, [], "") == ("failed", "no test carries the `gpu` marker")


def test_time_limits_keep_the_promised_totals():
    gpu_check = _gpu_check_module()
    parts = gpu_check.build_parts(sys.executable, ROOT / "gpu_check_results")
    assert [p.name for p in parts] == PARTS  # big_model last: it cannot take time from the others
    limits = {p.name: p.limit_s for p in parts}
    grace, wheels = 5, 30
    assert sum(limits.values()) + grace * len(parts) + wheels <= 12.5 * 60
    # The quick subset leaves out big_model and fsdp2 (which needs two GPUs).
    without = sum(limits.values()) - limits["big_model"] - limits["fsdp2"]
    assert without + grace * (len(parts) - 2) + wheels <= 8.5 * 60
    stage_limits = [limit for _, _, limit in gpu_check.BIG_MODEL_STAGES if limit is not None]
    assert sum(stage_limits) + gpu_check.BIG_MODEL_MARGIN_S < gpu_check.BIG_MODEL_LIMIT_S == limits["big_model"]


def test_big_model_figure_keeps_the_headline_and_the_binding_part():
    record = {
        "mode": "bf16-cpu-offload",
        "params": 13015864320,
        "peak_gpu_mib": 3561.25,
        "gpu_memory_mib": 81559.0,
        "s_per_step": 2.3456789,
        "limit_s_per_step": 1.1,
        "ratio_to_limit": 2.13243,
        "limit_parts": {"compute_s": 0.01, "memory_s": 0.2, "pcie_h2d_s": 1.1, "pcie_d2h_s": 1.05},
        "machine": {
            "device": "cuda",
            "memory_gb_s": 2800.123,
            "h2d_gb_s": 24.56,
            "d2h_gb_s": 25.1,
            "matmul_gflop_s": {"bfloat16": 412345.6, "float32": 50000.0},
        },
        "step_s": [3.0, 2.3456789],
    }
    figure = _gpu_check_module().big_model_figure("13b", record)
    assert figure["shape"] == "13b" and figure["mode"] == "bf16-cpu-offload"
    assert figure["peak_gpu_mib"] == 3561.0 and figure["s_per_step"] == 2.346 and figure["ratio_to_limit"] == 2.132
    assert figure["limited_by"] == "pcie_h2d_s"
    assert figure["rates"] == {"memory_gb_s": 2800.0, "h2d_gb_s": 24.56, "d2h_gb_s": 25.1, "bf16_tflop_s": 412.3}
    assert "step_s" not in figure and "machine" not in figure
    skipped = {"mode": "bf16", "shape": "7b", "skipped": "CUDA is not available"}
    assert _gpu_check_module().big_model_figure("7b", skipped) == {
        "shape": "7b",
        "mode": "bf16",
        "skipped": "CUDA is not available",
    }


def test_pytest_report_becomes_one_figure(tmp_path):
    report = tmp_path / "tests.xml"
    report.write_text(
        '<?xml version="1.0" encoding="utf-8"?><testsuites>'
        '<testsuite name="pytest" errors="1" failures="1" skipped="1" tests="4" time="3.21">'
        '<testcase classname="tests.test_gpu" name="test_a" time="0.1"/>'
        '<testcase classname="tests.test_gpu" name="test_b" time="0.1"><failure message="assert 0 == 1"/></testcase>'
        '<testcase classname="tests.test_gpu" name="test_c" time="0"><skipped message="needs CUDA"/></testcase>'
        '<testcase classname="tests.test_other" name="" time="0"><error message="collection failure"/></testcase>'
        "</testsuite></testsuites>"
    )
    (figure,) = _gpu_check_module().junit_figure(report)
    assert figure == {
        "tests_passed": 1,
        "tests_failed": 2,
        "tests_skipped": 1,
        "seconds": 3.2,
        "failed_tests": ["tests.test_gpu::test_b", "tests.test_other::"],
    }
