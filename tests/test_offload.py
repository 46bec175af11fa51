"""Offload (ZO2): sequential, dual and dual + offloaded blocks train identically; disk-tier memory is bounded."""

import gc
import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch
from peft import LoraConfig, get_peft_model
from safetensors import safe_open

from hf_zo import ZOConfig, ZOTrainer
from hf_zo.engine import DualEngine, find_blocks, offload_model
from hf_zo.optim import ZOSGD

from tiny_models import lm_dataset, tiny_causal_lm

ENGINES = {
    "sequential": dict(zo_engine="sequential"),
    "dual": dict(zo_engine="dual"),
    "dual+disk": dict(zo_engine="dual", zo_offload="disk"),
}


def _args(out, **overrides):
    values = dict(
        output_dir=str(out),
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        learning_rate=1e-3,
        lr_scheduler_type="linear",  # each deferred update must use the learning rate of its own step
        weight_decay=0.1,
        zo_eps=1e-3,
        max_steps=6,
        logging_steps=1,
        eval_strategy="steps",
        eval_steps=3,
        save_strategy="steps",
        save_steps=3,
        report_to=[],
        disable_tqdm=True,
        use_cpu=True,
    )
    values.update(overrides)
    return ZOConfig(**values)


def _model(use_lora, seed=0):
    model = tiny_causal_lm("opt", seed=seed)
    if use_lora:
        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "fc1"]))
    return model


def _train(out, engine, use_lora, resume=None, seed=0):
    data, eval_data = lm_dataset(24, seed=1), lm_dataset(4, seed=2)
    hyper = dict(learning_rate=0.05, zo_eps=1e-2) if use_lora else {}
    trainer = ZOTrainer(
        model=_model(use_lora, seed=seed),
        args=_args(out, **hyper, **ENGINES[engine]),
        train_dataset=data,
        eval_dataset=eval_data,
    )
    trainer.train(resume_from_checkpoint=resume)
    logs = [(h["step"], h["loss"], h["projected_grad"]) for h in trainer.state.log_history if "loss" in h]
    evals = [(h["step"], h["eval_loss"]) for h in trainer.state.log_history if "eval_loss" in h]
    weights = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    return trainer, logs, evals, weights


@pytest.mark.parametrize("use_lora", [False, True], ids=["full", "lora"])
def test_engines_and_offload_train_identically(tmp_path, use_lora):
    """Same per-step losses, projected gradients, eval losses, checkpoints and final weights, bitwise (fp32, CPU)."""
    _, logs, evals, weights = _train(tmp_path / "sequential", "sequential", use_lora)
    assert len(logs) == 6 and len(evals) == 2
    for engine in ("dual", "dual+disk"):
        _, other_logs, other_evals, other_weights = _train(tmp_path / engine, engine, use_lora)
        assert other_logs == logs, engine
        assert other_evals == evals, engine
        for name, value in weights.items():
            assert torch.equal(other_weights[name], value), (engine, name)
        # With offloaded blocks a full model is saved in shards of two blocks (model-0000k-of-0000n.safetensors).
        reference = _saved_tensors(tmp_path / "sequential" / "checkpoint-3")
        saved = _saved_tensors(tmp_path / engine / "checkpoint-3")
        assert saved.keys() == reference.keys()
        for key, value in reference.items():
            assert torch.equal(saved[key], value), (engine, key)


def _saved_tensors(folder) -> dict[str, torch.Tensor]:
    """Every tensor of the safetensors files of a saved model or adapter folder, whatever their sharding."""
    tensors = {}
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(str(path), "pt") as stored:
            tensors.update({key: stored.get_tensor(key) for key in stored.keys()})
    return tensors


def test_resume_with_pending_update_is_exact(tmp_path):
    """The checkpoint at step 3 is written while ZO-SGD's update is still pending: resuming reproduces the run."""
    _, logs, _, weights = _train(tmp_path / "a", "dual+disk", use_lora=False)
    resumed = tmp_path / "b"
    resumed.mkdir()
    shutil.copytree(tmp_path / "a" / "checkpoint-3", resumed / "checkpoint-3")
    _, resumed_logs, _, resumed_weights = _train(
        resumed, "dual+disk", use_lora=False, resume=str(resumed / "checkpoint-3"), seed=7
    )
    assert resumed_logs == logs  # steps 1-3 come from the checkpoint's trainer state, 4-6 are recomputed
    for name, value in weights.items():
        assert torch.equal(resumed_weights[name], value), name


def _train_offloaded(model, offloader, steps=3, device="cpu"):
    optimizer = ZOSGD(model.parameters(), lr=1e-3, eps=1e-3, seed=1)
    optimizer.attach_engine(DualEngine(model, offloader=offloader))
    ids = torch.randint(2, 64, (2, 8), generator=torch.Generator().manual_seed(0)).to(device)
    losses = [optimizer.step(lambda: model(input_ids=ids, labels=ids).loss) for _ in range(steps)]
    optimizer.flush()
    return losses, [p.detach().cpu().clone() for p in model.parameters()]


def test_cpu_tier_and_prefetch_depth_do_not_change_results():
    runs = []
    for prefetch in (0, 2):
        model = tiny_causal_lm("llama")
        runs.append(_train_offloaded(model, offload_model(model, "cpu", device="cpu", prefetch=prefetch)))
    assert runs[0][0] == runs[1][0]
    assert all(torch.equal(a, b) for a, b in zip(runs[0][1], runs[1][1]))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_transport_matches_resident_blocks():
    """Pinned host blocks streamed on a side stream give the resident dual engine's losses and weights on the GPU."""
    runs = []
    for offload in (False, True):
        model = tiny_causal_lm("llama")
        offloader = offload_model(model, "cpu", device="cuda", prefetch=1) if offload else None
        model.to("cuda")  # offloaded blocks stay in pinned host memory
        runs.append(_train_offloaded(model, offloader, device="cuda"))
        if offload:
            assert all(p.device.type == "cpu" and p.is_pinned() for p in find_blocks(model)[0].parameters())
    assert runs[0][0] == runs[1][0]
    assert all(torch.equal(a, b) for a, b in zip(runs[0][1], runs[1][1]))


def test_frozen_weights_are_never_written_back_and_use_offload_dtype(tmp_path):
    model = _model(use_lora=True)
    frozen_before = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    offloader = offload_model(model, "disk", directory=str(tmp_path), device="cpu", offload_dtype="bfloat16")
    written = []
    unload = offloader.transport.unload
    offloader.transport.unload = lambda tensors, pairs, then=None: (
        written.extend(v for v, _ in pairs),
        unload(tensors, pairs, then),
    )
    trainable_views = {
        id(view)
        for params, views in zip(offloader.params, offloader.views)
        for p, view in zip(params, views)
        if p.requires_grad
    }
    optimizer = ZOSGD([p for p in model.parameters() if p.requires_grad], lr=0.1, eps=1e-2, seed=1)
    optimizer.attach_engine(DualEngine(model, offloader=offloader))
    ids = torch.randint(2, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    optimizer.step(lambda: model(input_ids=ids, labels=ids).loss)
    optimizer.step(lambda: model(input_ids=ids, labels=ids).loss)  # the first update is applied as blocks arrive
    optimizer.flush()
    assert written and all(id(view) in trainable_views for view in written)
    with safe_open(os.path.join(offloader.storage.directory, "block_00000.safetensors"), "pt") as stored:
        dtypes = {key: stored.get_tensor(key).dtype for key in stored.keys()}
    assert {d for k, d in dtypes.items() if "lora_" not in k} == {torch.bfloat16}
    assert {d for k, d in dtypes.items() if "lora_" in k} == {torch.float32}
    in_blocks = {id(p) for block in find_blocks(model) for p in block.parameters()}
    for name, param in model.named_parameters():
        if name in frozen_before and id(param) in in_blocks:  # at rest: the stored bf16 copy, never rewritten
            assert torch.equal(param.detach(), frozen_before[name].to(torch.bfloat16)), name


def test_plain_forward_streams_blocks_and_matches_resident(tmp_path):
    resident = tiny_causal_lm("gpt2").eval()
    offloaded = tiny_causal_lm("gpt2").eval()
    offloader = offload_model(offloaded, "disk", directory=str(tmp_path), device="cpu", prefetch=1)
    ids = torch.randint(2, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected, got = resident(input_ids=ids).logits, offloaded(input_ids=ids).logits
    assert torch.equal(expected, got)
    assert not offloader.busy_blocks
    block_param = next(find_blocks(offloaded)[0].parameters())
    assert block_param.untyped_storage().nbytes() == block_param.nbytes  # at rest: its own file-backed map


@pytest.mark.parametrize("convert", ["to_bf16", "half"])
def test_converting_the_dtype_of_offloaded_blocks_is_a_clear_error(tmp_path, convert):
    """`model.to(torch.bfloat16)` (what Trainer.evaluate does with bf16_full_eval) cannot reach parameters that live
    in storage: refused with the cause and the fixes, instead of a forward failing on mixed dtypes."""
    model = tiny_causal_lm("opt").eval()
    offload_model(model, "cpu", device="cpu")
    with pytest.raises(RuntimeError, match=r"from torch.float32 to torch.(bfloat16|float16).*bf16_full_eval=True"):
        model.to(dtype=torch.bfloat16) if convert == "to_bf16" else model.half()
    assert {p.dtype for block in find_blocks(model) for p in block.parameters()} == {torch.float32}


def test_conversions_that_keep_the_blocks_dtype_still_apply(tmp_path):
    """Moves and same-dtype conversions (`Trainer` placing the model, `.float()`) pass through the blocks as before:
    their buffers follow, their parameters stay in storage, and the forward is unchanged."""
    model = tiny_causal_lm("gpt2").eval()
    resident = tiny_causal_lm("gpt2").eval()
    offload_model(model, "cpu", device="cpu")
    model = model.to("cpu").float().to(dtype=torch.float32)
    ids = torch.randint(2, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, resident(input_ids=ids).logits)


@pytest.mark.parametrize("flag", ["bf16_full_eval", "fp16_full_eval"])
def test_full_eval_casts_with_offload_are_refused_at_construction(tmp_path, flag):
    """Refused before the model is touched: a cast inside `Trainer.evaluate` would fail half-way through the model."""
    with pytest.raises(ValueError, match=rf"{flag}=True casts the model .* zo_offload='cpu' .*\(bf16=True evaluates"):
        _args(tmp_path, zo_engine="dual", zo_offload="cpu", **{flag: True})


def test_offload_config_errors():
    with pytest.raises(ValueError, match="zo_offload='disk' needs zo_engine='dual'"):
        ZOConfig(output_dir="x", zo_offload="disk")
    with pytest.raises(ValueError, match="needs zo_optimizer='zo_sgd'"):
        ZOConfig(output_dir="x", zo_engine="dual", zo_offload="cpu", zo_optimizer="zo_adam")
    with pytest.raises(ValueError, match="Unknown zo_offload 'gpu'"):
        ZOConfig(output_dir="x", zo_engine="dual", zo_offload="gpu")
    with pytest.raises(ValueError, match="zo_offload_prefetch must be an integer >= 0"):
        ZOConfig(output_dir="x", zo_engine="dual", zo_offload="disk", zo_offload_prefetch=-1)
    with pytest.raises(ValueError, match="Unknown zo_offload_dtype 'int8'"):
        ZOConfig(output_dir="x", zo_engine="dual", zo_offload="disk", zo_offload_dtype="int8")
    with pytest.raises(ValueError, match="zo_offload_dir='d' is set but zo_offload is None"):
        ZOConfig(output_dir="x", zo_offload_dir="d")


MEMORY_SCRIPT = textwrap.dedent(
    """
    import json, sys
    import torch
    from transformers import OPTConfig, OPTForCausalLM
    from hf_zo.engine import DualEngine
    from hf_zo.engine import offload_model
    from hf_zo.optim import ZOSGD

    def anonymous_rss():
        with open("/proc/self/status") as status:
            return next(int(line.split()[1]) * 1024 for line in status if line.startswith("RssAnon:"))

    layers, prefetch, directory = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    torch.manual_seed(0)
    config = OPTConfig(vocab_size=64, hidden_size=256, num_hidden_layers=layers, ffn_dim=1024, num_attention_heads=4,
                       max_position_embeddings=64, word_embed_proj_dim=256, dropout=0.0, pad_token_id=1)
    ids = torch.randint(2, 64, (2, 16))
    with torch.no_grad():  # load kernels and warm the allocator on a one-layer model of the same width
        OPTForCausalLM(OPTConfig(**{**config.to_dict(), "num_hidden_layers": 1})).eval()(input_ids=ids, labels=ids)
    start = anonymous_rss()
    model = OPTForCausalLM(config).eval()
    block_bytes = sum(p.nbytes for p in model.model.decoder.layers[0].parameters())
    resident_bytes = sum(p.nbytes for p in model.parameters()) - layers * block_bytes
    offloader = offload_model(model, "disk", directory=directory, device="cpu", prefetch=prefetch)
    after_offload = anonymous_rss()
    optimizer = ZOSGD(model.parameters(), lr=1e-3, eps=1e-3, seed=0)
    optimizer.attach_engine(DualEngine(model, offloader=offloader))
    samples = []
    for block in offloader.blocks:  # sampled while a block computes: the most working copies in memory
        block.register_forward_hook(lambda *args: samples.append(anonymous_rss()))
    optimizer.step(lambda: model(input_ids=ids, labels=ids).loss)
    optimizer.step(lambda: model(input_ids=ids, labels=ids).loss)  # the first update is applied as blocks arrive
    optimizer.flush()
    samples.append(anonymous_rss())
    print(json.dumps(dict(start=start, after_offload=after_offload, peak=max(samples), block_bytes=block_bytes,
                          resident_bytes=resident_bytes, blocks_bytes=layers * block_bytes)))
    """
)

ACTIVATIONS_AND_RUNTIME_BYTES = 16 << 20
"""Allowance for activations, noise-sweep scratch, the pass threads and allocator slack (measured: ~10 MiB)."""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads RssAnon from /proc/self/status")
def test_disk_tier_anonymous_memory_is_bounded(tmp_path):
    """32 blocks of 3 MiB on disk: anonymous memory grows by at most (prefetch + 1) blocks + activations."""
    prefetch = 1
    # A fixed mmap threshold makes glibc return every freed tensor at once, so RSS measures live memory rather
    # than the allocator's cache of freed chunks.
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536")
    result = subprocess.run(
        [sys.executable, "-c", MEMORY_SCRIPT, "32", str(prefetch), str(tmp_path)],
        capture_output=True,
        text=True,
        env=env,
        check=True,
    )
    figures = json.loads(result.stdout.strip().splitlines()[-1])
    bound = figures["resident_bytes"] + (prefetch + 1) * figures["block_bytes"] + ACTIVATIONS_AND_RUNTIME_BYTES
    assert figures["blocks_bytes"] > 4 * bound, figures
    assert figures["after_offload"] - figures["start"] < figures["resident_bytes"] + (4 << 20), figures
    assert figures["peak"] - figures["start"] < bound, (figures, bound)


def test_failure_mid_estimate_writes_blocks_back_and_restores(tmp_path):
    model = tiny_causal_lm("qwen2")
    before = [p.detach().clone() for p in model.parameters()]
    offloader = offload_model(model, "disk", directory=str(tmp_path), device="cpu", prefetch=1)
    optimizer = ZOSGD(model.parameters(), lr=1e-3, eps=1e-3, seed=1)
    optimizer.attach_engine(DualEngine(model, offloader=offloader))
    ids = torch.randint(2, 64, (2, 8), generator=torch.Generator().manual_seed(0))

    def explode(module, args):
        raise RuntimeError("out of memory in block 1")

    handle = find_blocks(model)[1].register_forward_pre_hook(explode)
    with pytest.raises(RuntimeError, match="out of memory in block 1"):
        optimizer.estimate(lambda: model(input_ids=ids, labels=ids).loss)
    handle.remove()
    assert not offloader.busy_blocks
    optimizer.flush()
    assert all(torch.allclose(p, b, rtol=0, atol=1e-6) for p, b in zip(model.parameters(), before))


def test_peft_after_offload_is_refused(tmp_path):
    model = tiny_causal_lm("opt")
    offloader = offload_model(model, "disk", directory=str(tmp_path), device="cpu")
    model = get_peft_model(model, LoraConfig(r=2, target_modules=["q_proj"]))
    optimizer = ZOSGD([p for p in model.parameters() if p.requires_grad], lr=1e-3, eps=1e-3)
    optimizer.attach_engine(DualEngine(model, offloader=offloader))
    ids = torch.randint(2, 64, (2, 8))
    with pytest.raises(RuntimeError, match="Block 0 has parameters that were not offloaded"):
        optimizer.estimate(lambda: model(input_ids=ids, labels=ids).loss)


def _user_files(folder):
    """A user's own files in `folder`, one named like a block file of the disk tier: name -> bytes."""
    files = {"block_00000.safetensors": b"my block", "notes.txt": b"keep me\n"}
    for name, data in files.items():
        (folder / name).write_bytes(data)
    return files


def _contents(folder):
    return {path.name: path.read_bytes() for path in folder.iterdir()}


def test_a_users_files_in_offload_dir_survive_the_run(tmp_path):
    # ZOTrainer keeps the model offloaded after train() (evaluate, save and predict still stream its blocks), so the
    # blocks go when the storage is collected or the process exits; the folder and its files are the user's and stay.
    script = textwrap.dedent(
        f"""
        import os, sys
        sys.path.insert(0, {os.path.dirname(__file__)!r})
        from hf_zo import ZOConfig, ZOTrainer
        from tiny_models import lm_dataset, tiny_causal_lm

        args = ZOConfig(output_dir={str(tmp_path / "run")!r}, max_steps=2, per_device_train_batch_size=2,
                        zo_engine="dual", zo_offload="disk", zo_offload_dir={str(tmp_path / "zo")!r},
                        save_strategy="no", report_to=[], use_cpu=True, disable_tqdm=True)
        trainer = ZOTrainer(model=tiny_causal_lm("opt"), args=args, train_dataset=lm_dataset(8))
        trainer.train()
        print(sorted(os.listdir({str(tmp_path / "zo")!r})))
        print(sorted(os.listdir(trainer.zo_offloader.storage.directory)))
        """
    )
    (tmp_path / "zo").mkdir()
    files = _user_files(tmp_path / "zo")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert _contents(tmp_path / "zo") == files  # byte for byte, and nothing of the storage's left
    during, ours = result.stdout.strip().splitlines()[-2:]
    assert "'hf_zo-offload-" in during and "'notes.txt'" in during  # the blocks live in a folder of their own
    assert "'block_00000.safetensors'" in ours and "'block_00001.safetensors'" in ours


def test_disk_storage_writes_and_removes_only_its_own_files(tmp_path):
    from hf_zo.offload import DiskStorage

    files = _user_files(tmp_path)
    first, second = DiskStorage(str(tmp_path)), DiskStorage(str(tmp_path))  # two ranks, or two runs, share it
    assert first.directory != second.directory
    assert os.path.dirname(first.directory) == str(tmp_path)
    views = first.store_block(0, [("weight", torch.ones(4))])
    second.store_block(0, [("weight", torch.zeros(4))])
    assert torch.equal(views[0], torch.ones(4))  # not overwritten by the other storage's block 0
    assert (tmp_path / "block_00000.safetensors").read_bytes() == b"my block"
    first.close()
    assert not os.path.exists(first.directory) and os.path.exists(second.directory)
    del second, views
    gc.collect()  # collected without close(): its folder goes too
    assert _contents(tmp_path) == files

    # Folders the storage had to create go with it (when empty); an existing parent stays.
    storage = DiskStorage(str(tmp_path / "new" / "deeper"))
    storage.store_block(0, [("weight", torch.ones(4))])
    storage.close()
    assert _contents(tmp_path) == files

    # A file put into a folder the storage created is not the storage's: it stays, with its folders.
    storage = DiskStorage(str(tmp_path / "new"))
    (tmp_path / "new" / "later.txt").write_bytes(b"mine")
    storage.close()
    assert _contents(tmp_path / "new") == {"later.txt": b"mine"}


def test_a_killed_runs_block_files_go_with_the_next_storage_in_the_folder(tmp_path):
    """A process killed with SIGKILL cannot remove its block files; the next storage created in the same folder
    does, and leaves the folders of storages that are alive, and any folder holding a file it did not write."""
    from hf_zo.offload import DiskStorage

    script = textwrap.dedent(
        f"""
        import os, signal, sys, torch
        from hf_zo.offload import DiskStorage
        storage = DiskStorage({str(tmp_path)!r})
        storage.store_block(0, [("weight", torch.ones(4))])
        print(storage.directory, flush=True)
        if sys.argv[1] == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        sys.stdin.read()  # alive until the test closes its input
        """
    )
    kept_by_user = subprocess.run([sys.executable, "-c", script, "kill"], capture_output=True, text=True, timeout=120)
    with_user_file = kept_by_user.stdout.strip()
    open(os.path.join(with_user_file, "notes.txt"), "w").write("mine")
    alive = subprocess.Popen([sys.executable, "-c", script, "live"], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        live_folder = alive.stdout.readline().decode().strip()
        killed = subprocess.run([sys.executable, "-c", script, "kill"], capture_output=True, text=True, timeout=120)
        abandoned = killed.stdout.strip()
        assert os.path.isdir(abandoned) and os.path.isdir(live_folder)
        storage = DiskStorage(str(tmp_path))
        assert not os.path.exists(abandoned)
        assert os.path.isfile(os.path.join(live_folder, "block_00000.safetensors"))
        assert open(os.path.join(with_user_file, "notes.txt")).read() == "mine"
        storage.close()
    finally:
        alive.communicate(timeout=60)
    assert not os.path.exists(live_folder)  # the live storage removed its own on exit


def test_storages_created_at_once_in_one_folder_never_remove_each_other(tmp_path):
    """The ranks of a run start their storages in one zo_offload_dir at the same moment: each one's clean-up of
    killed runs' folders must never take a live storage's folder (or its lock) for abandoned."""
    script = textwrap.dedent(
        f"""
        import torch
        from hf_zo.offload import DiskStorage
        for _ in range(40):
            storage = DiskStorage({str(tmp_path)!r})
            storage.store_block(0, [("weight", torch.ones(4))])
            storage.close()
        """
    )
    processes = [subprocess.Popen([sys.executable, "-c", script], stderr=subprocess.PIPE) for _ in range(4)]
    errors = [process.communicate(timeout=300)[1].decode() for process in processes]
    assert [process.returncode for process in processes] == [0] * 4, "\n".join(errors)[-3000:]
    assert list(tmp_path.iterdir()) == []


def test_a_disk_offload_runs_trajectory_replays_from_the_written_base_to_its_weights(tmp_path):
    """Trained from a base folder with the disk tier, saved shard by shard from the block files: replaying the
    trajectory onto that base folder gives every saved tensor (the replay checks the end checksum too)."""
    from transformers import AutoModelForCausalLM

    from hf_zo import replay

    tiny_causal_lm("llama").save_pretrained(tmp_path / "base")
    args = ZOConfig(
        output_dir=str(tmp_path / "run"),
        max_steps=3,
        per_device_train_batch_size=2,
        learning_rate=1e-3,
        zo_engine="dual",
        zo_offload="disk",
        zo_offload_dir=str(tmp_path / "zo"),
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
    )
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "base")
    trainer = ZOTrainer(model=model, args=args, train_dataset=lm_dataset(8))
    trainer.train()
    trainer.save_model()
    saved = AutoModelForCausalLM.from_pretrained(tmp_path / "run").state_dict()
    replayed = replay(AutoModelForCausalLM.from_pretrained(tmp_path / "base"), tmp_path / "run").state_dict()
    base = AutoModelForCausalLM.from_pretrained(tmp_path / "base").state_dict()
    assert saved.keys() == replayed.keys()
    assert any(not torch.equal(saved[name], base[name]) for name in saved)  # the run moved the weights
    for name in saved:
        assert torch.equal(replayed[name], saved[name]), name
