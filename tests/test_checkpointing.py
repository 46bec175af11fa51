"""Checkpoints as a user and the Hub see them: complete when published, pushed from where they end up, resumable
after a second `train()` call, and checked only on the files resuming reads."""

import collections
import os
from concurrent.futures import Future
from pathlib import Path

import pytest
import torch
import transformers.trainer
from huggingface_hub.utils import filter_repo_objects
from transformers import TrainerCallback

import hf_zo.training.checkpointing
from hf_zo import ZOTrainer
from hf_zo.training.checkpointing import check_resumable

from tiny_models import classification_dataset, lm_dataset, tiny_bert_classifier, tiny_causal_lm, zo_args


class _FakeHub:
    """Stands in for `huggingface_hub.HfApi` (no network): records, at call time, which folder each upload was
    handed, whether it existed, and which of its files the upload's ignore patterns let through."""

    def __init__(self):
        self.uploads: list[dict] = []

    def upload_folder(self, folder_path, ignore_patterns=None, path_in_repo=None, **kwargs):
        folder = Path(folder_path)
        files = [str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file()] if folder.is_dir() else []
        self.uploads.append(
            {
                "folder": folder,
                "existed": folder.is_dir(),
                "path_in_repo": path_in_repo,
                "files": sorted(filter_repo_objects(files, ignore_patterns=ignore_patterns)),
            }
        )
        future = Future()
        future.set_result(None)
        return future


@pytest.fixture
def hub(monkeypatch):
    fake = _FakeHub()
    monkeypatch.setattr(transformers.trainer, "hf_api", lambda: fake)

    def init_hf_repo(self, token=None, private=None):
        self.hub_model_id, self.push_in_progress = "someone/tiny-zo", None

    monkeypatch.setattr(ZOTrainer, "init_hf_repo", init_hf_repo)
    monkeypatch.setattr(ZOTrainer, "create_model_card", lambda self, *args, **kwargs: None)
    return fake


def _assert_clean(upload: dict) -> None:
    assert upload["existed"], f"{upload['folder']} was gone when its upload began"
    assert not any(".zo-" in part for part in upload["folder"].parts), upload["folder"]
    staged = [f for f in upload["files"] if ".zo-" in f]
    assert not staged, f"the upload of {upload['folder']} carries staging files {staged}"


@pytest.mark.parametrize("hub_strategy", ["every_save", "checkpoint", "all_checkpoints"])
def test_checkpoint_pushes_upload_the_published_checkpoint(tmp_path, hub, hub_strategy):
    """Every upload is handed a folder that exists (uploads run in the background) and carries no staging files; a
    checkpoint upload is the published checkpoint, the first-order head's state included."""
    args = zo_args(
        tmp_path,
        push_to_hub=True,
        hub_model_id="someone/tiny-zo",
        hub_strategy=hub_strategy,
        save_strategy="steps",
        save_steps=2,
        max_steps=2,
    )
    trainer = ZOTrainer(model=tiny_bert_classifier(), args=args, train_dataset=classification_dataset(8))
    assert trainer.zo_heads.first_order is None  # before train(): the head options apply there
    trainer.train()
    assert hub.uploads
    for upload in hub.uploads:
        _assert_clean(upload)
    model_upload = hub.uploads[0]
    assert model_upload["folder"] == tmp_path / "out" and "model.safetensors" in model_upload["files"]
    checkpoint_uploads = [u for u in hub.uploads if u["path_in_repo"] is not None]
    if hub_strategy == "every_save":
        assert not checkpoint_uploads
    else:
        (upload,) = checkpoint_uploads
        assert upload["folder"] == tmp_path / "out" / "checkpoint-2"
        assert upload["path_in_repo"] == ("last-checkpoint" if hub_strategy == "checkpoint" else "checkpoint-2")
        assert {"optimizer.pt", "trainer_state.json", "zo_head_optimizer.pt"} <= set(upload["files"])


def test_save_model_pushes_once_the_files_are_in_place(tmp_path, hub):
    """A user's `save_model()` with `push_to_hub` uploads the output directory after the saved files are moved in,
    never the temporary folder they are written to."""
    args = zo_args(tmp_path, push_to_hub=True, hub_model_id="someone/tiny-zo", max_steps=2)
    trainer = ZOTrainer(model=tiny_causal_lm(), args=args, train_dataset=lm_dataset(8))
    trainer.train()
    hub.uploads.clear()
    trainer.save_model()
    (upload,) = hub.uploads
    _assert_clean(upload)
    assert upload["folder"] == tmp_path / "out"
    assert {"model.safetensors", "config.json", "zo_trajectory.bin"} <= set(upload["files"])
    assert sorted(os.listdir(tmp_path / "out")) == sorted(upload["files"])


class _ListCheckpoint(TrainerCallback):
    def __init__(self):
        self.seen: dict[int, list[str]] = {}

    def on_save(self, args, state, control, **kwargs):
        folder = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
        self.seen[state.global_step] = sorted(os.listdir(folder))


def test_the_first_order_heads_state_is_published_with_the_checkpoint(tmp_path, monkeypatch):
    """The head's AdamW state is in the staged checkpoint, so a published checkpoint (what a kill right after the
    publish leaves, and what callbacks and Hub pushes see) is never without it."""
    published = []
    publish = hf_zo.training.checkpointing.publish_checkpoint

    def recording_publish(staged, final):
        published.append(sorted(os.listdir(staged)))
        publish(staged, final)

    monkeypatch.setattr(hf_zo.training.checkpointing, "publish_checkpoint", recording_publish)
    watcher = _ListCheckpoint()
    args = zo_args(tmp_path, save_strategy="steps", save_steps=2, max_steps=4)
    trainer = ZOTrainer(
        model=tiny_bert_classifier(), args=args, train_dataset=classification_dataset(8), callbacks=[watcher]
    )
    trainer.train()
    assert trainer.zo_heads.first_order is not None
    assert len(published) == 2 and all("zo_head_optimizer.pt" in files for files in published)
    assert set(watcher.seen) == {2, 4}
    assert all("zo_head_optimizer.pt" in files for files in watcher.seen.values())


def _weights(model) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def test_a_checkpoint_of_a_second_train_call_resumes_exactly(tmp_path):
    """The ZO step counter runs on across `train()` calls while `global_step` starts again: a checkpoint written in
    the second call resumes, and reproduces that call's weights bitwise."""
    common = dict(max_steps=4, save_strategy="steps", save_steps=2)
    trainer = ZOTrainer(model=tiny_causal_lm(), args=zo_args(tmp_path, **common), train_dataset=lm_dataset())
    trainer.train()
    trainer.args.output_dir = str(tmp_path / "second")
    trainer.train()
    assert trainer.zo_optimizer.zo_step == 8 and trainer.state.global_step == 4
    expected = _weights(trainer.model)

    model = tiny_causal_lm(seed=3)
    resumed = ZOTrainer(
        model=model, args=zo_args(tmp_path, output_dir=str(tmp_path / "resumed"), **common), train_dataset=lm_dataset()
    )
    resumed.train(resume_from_checkpoint=str(tmp_path / "second" / "checkpoint-2"))
    assert resumed.zo_optimizer.zo_step == 8
    for name, value in _weights(model).items():
        assert torch.equal(value, expected[name]), name


def test_an_optimizer_state_from_another_checkpoint_is_refused(tmp_path):
    """Saving the trainer's step with the ZO state keeps the check that both halves of a checkpoint belong
    together."""
    args = zo_args(tmp_path, max_steps=4, save_strategy="steps", save_steps=2)
    ZOTrainer(model=tiny_causal_lm(), args=args, train_dataset=lm_dataset()).train()
    out = tmp_path / "out"
    os.replace(out / "checkpoint-2" / "optimizer.pt", out / "checkpoint-4" / "optimizer.pt")
    trainer = ZOTrainer(model=tiny_causal_lm(), args=zo_args(tmp_path, max_steps=6), train_dataset=lm_dataset())
    message = "trainer_state.json is at step 4 but the ZO optimizer of optimizer.pt was saved at step 2"
    with pytest.raises(ValueError, match=message):
        trainer.train(resume_from_checkpoint=str(out / "checkpoint-4"))


Ema = collections.namedtuple("Ema", "decay step")


@pytest.fixture
def checkpoint_folder(tmp_path):
    folder = tmp_path / "checkpoint-2"
    folder.mkdir()
    torch.save({"state": {}, "param_groups": []}, folder / "optimizer.pt")
    return folder


def test_a_callbacks_own_file_does_not_make_a_checkpoint_damaged(checkpoint_folder):
    """Files resuming does not read are never unpickled: a callback's state of its own classes passes."""
    torch.save({"ema": Ema(0.999, 10)}, checkpoint_folder / "ema_state.pt")
    (checkpoint_folder / "notes.json").write_text("one line of JSON per event\n{}\n")
    (checkpoint_folder / "legacy.bin").write_bytes(b"\x80\x02not a zip archive")
    check_resumable(checkpoint_folder)


def test_a_truncated_archive_of_a_callback_is_still_named(checkpoint_folder):
    torch.save({"ema": Ema(0.999, 10)}, checkpoint_folder / "ema_state.pt")
    path = checkpoint_folder / "ema_state.pt"
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(ValueError, match="ema_state.pt is damaged or truncated"):
        check_resumable(checkpoint_folder)


def test_a_file_resuming_reads_is_still_loaded_as_its_loader_loads_it(checkpoint_folder):
    """`zo_head_optimizer.pt` is loaded with `weights_only=True` on resume, so a class inside it is refused now."""
    torch.save({"ema": Ema(0.999, 10)}, checkpoint_folder / "zo_head_optimizer.pt")
    with pytest.raises(ValueError, match="zo_head_optimizer.pt is damaged or truncated"):
        check_resumable(checkpoint_folder)


def test_what_killed_saves_left_is_cleared_and_an_older_checkpoint_restored(tmp_path):
    """Unpublished folders are removed; a `.replaced` checkpoint is renamed back when its step has no checkpoint
    (killed between the publish's two renames) and removed when the new one is in place."""
    from hf_zo.training.checkpointing import clean_interrupted_saves

    run = tmp_path / "run"
    for folder, file in [
        (".zo-staging/checkpoint-6", "optimizer.pt"),
        (".zo-save-tmp", "model.safetensors"),
        ("checkpoint-2.replaced", "older"),
        ("checkpoint-4", "newer"),
        ("checkpoint-4.replaced", "older"),
    ]:
        (run / folder).mkdir(parents=True)
        (run / folder / file).write_text(folder)

    clean_interrupted_saves(run)

    assert sorted(p.name for p in run.iterdir()) == ["checkpoint-2", "checkpoint-4"]
    assert (run / "checkpoint-2" / "older").read_text() == "checkpoint-2.replaced"
    assert (run / "checkpoint-4" / "newer").read_text() == "checkpoint-4"


def test_resuming_after_a_publish_killed_half_way_finds_the_older_checkpoint(tmp_path, monkeypatch):
    args = zo_args(tmp_path, max_steps=4, save_strategy="steps", save_steps=2)
    ZOTrainer(model=tiny_causal_lm(), args=args, train_dataset=lm_dataset()).train()
    out = tmp_path / "out"
    os.replace(out / "checkpoint-4", out / "checkpoint-4.replaced")  # the older copy, its successor never moved in
    (out / ".zo-staging" / "checkpoint-4").mkdir(parents=True)
    checked = []
    monkeypatch.setattr(hf_zo.training.checkpointing, "check_resumable", checked.append)

    trainer = ZOTrainer(model=tiny_causal_lm(), args=zo_args(tmp_path, max_steps=4), train_dataset=lm_dataset())
    trainer.train(resume_from_checkpoint=True)

    assert checked == [str(out / "checkpoint-4")]
    assert sorted(p.name for p in out.iterdir() if p.name.startswith((".zo-", "checkpoint-"))) == [
        "checkpoint-2",
        "checkpoint-4",
    ]
