"""Killing training at any moment (SIGKILL) loses nothing: the last complete checkpoint resumes bitwise."""

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from transformers.trainer_utils import get_last_checkpoint

WORKER = Path(__file__).parent / "crash_worker.py"
KILLS = int(os.environ.get("HF_ZO_CRASH_KILLS", "4"))  # raise it for a longer campaign


def _launch(output_dir: Path, slow: bool, mode: str = "") -> subprocess.Popen:
    env = dict(os.environ, OMP_NUM_THREADS="1", TRANSFORMERS_VERBOSITY="error")
    command = [sys.executable, str(WORKER), str(output_dir), "slow" if slow else mode]
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)


def _run_to_completion(output_dir: Path, process: subprocess.Popen | None = None, mode: str = "") -> dict:
    """Let a run (started here unless `process` is given) finish; return its final weights."""
    process = process or _launch(output_dir, slow=False, mode=mode)
    out, _ = process.communicate(timeout=300)
    assert process.returncode == 0 and "DONE" in out, out
    return torch.load(output_dir / "final_state.pt", weights_only=True)


def _check_last_checkpoint_loads(output_dir: Path) -> None:
    last = get_last_checkpoint(str(output_dir)) if output_dir.is_dir() else None
    if last is None:
        return
    from safetensors.torch import load_file

    load_file(os.path.join(last, "model.safetensors"))
    state = torch.load(os.path.join(last, "optimizer.pt"), weights_only=True)
    assert state["zo"]["step"] == int(last.rsplit("-", 1)[1])


@pytest.mark.slow
def test_sigkill_during_training_and_saves_then_resume_is_bitwise(tmp_path):
    # The uninterrupted reference runs beside the kills (each process has one thread; the machine has two cores).
    reference_process = _launch(tmp_path / "reference", slow=False)

    crashed = tmp_path / "crashed"
    rng = random.Random(0)
    kills = {"during_step": 0, "during_save": 0}
    for attempt in range(KILLS):
        during_save = attempt % 2 == 1
        process = _launch(crashed, slow=during_save)
        target_step = rng.randint(1, 15)
        for line in process.stdout:
            line = line.strip()
            if during_save and line == "SAVING":
                time.sleep(rng.uniform(0.0, 0.25))
                break
            if not during_save and line.startswith("STEP ") and int(line.split()[1]) >= target_step:
                time.sleep(rng.uniform(0.0, 0.05))
                break
        if process.poll() is None:
            os.kill(process.pid, signal.SIGKILL)
            process.wait()
            kills["during_save" if during_save else "during_step"] += 1
        else:
            process.wait()
        _check_last_checkpoint_loads(crashed)
        assert not (crashed / "checkpoint-16.replaced").exists()

    assert kills["during_step"] >= 1 and kills["during_save"] >= 1, kills
    print(f"kills: {kills}")
    reference = _run_to_completion(tmp_path / "reference", reference_process)
    resumed = _run_to_completion(crashed)
    for name, value in reference.items():
        assert torch.equal(value, resumed[name]), name


def test_sigkill_during_a_disk_offload_step_then_resume_is_bitwise(tmp_path):
    """The disk tier writes each step's updates into its block files in place; a kill in the middle of a step leaves
    them half-updated, and the resume starts from the last complete checkpoint, not from those files."""
    reference_process = _launch(tmp_path / "reference", slow=False, mode="offload")
    crashed = tmp_path / "crashed"
    process = _launch(crashed, slow=False, mode="offload")
    for line in process.stdout:
        if line.strip() == "STEP 5":
            break
    time.sleep(0.02)  # inside step 6: a checkpoint was written at step 4
    os.kill(process.pid, signal.SIGKILL)
    process.wait()
    assert get_last_checkpoint(str(crashed)) is not None
    reference = _run_to_completion(tmp_path / "reference", reference_process)
    resumed = _run_to_completion(crashed, mode="offload")
    for name, value in reference.items():
        assert torch.equal(value, resumed[name]), name
