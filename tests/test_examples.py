"""examples/train.py end to end on tiny models and tiny local files: train, save, reload, evaluate, push."""

from __future__ import annotations

import json
import os

import pytest
import torch
from launch_worker import load_example
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, PreTrainedTokenizerFast

from hf_zo.training.defaults import lora_target_names

from tiny_models import VOCAB, tiny_bert_classifier, tiny_causal_lm

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORDS = "good great fine nice bad awful poor dull movie film plot it was terrible is a the".split()
SPECIAL = ["<unk>", "<pad>", "</s>"]


train_script = load_example("train")


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers

    vocab = {token: i for i, token in enumerate(SPECIAL + WORDS)}
    assert len(vocab) <= VOCAB
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.normalizer = normalizers.Lowercase()
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>", pad_token="<pad>", eos_token="</s>")


def sentences(n: int, seed: int) -> list[dict]:
    generator = torch.Generator().manual_seed(seed)
    positive, negative, nouns = ["good", "great", "fine", "nice"], ["bad", "awful", "poor", "dull"], ["movie", "film"]
    rows = []
    for i in range(n):
        label = i % 2
        words = positive if label else negative
        pick = torch.randint(0, 4, (2,), generator=generator).tolist()
        rows.append({"sentence": f"a {words[pick[0]]} {nouns[pick[1] % 2]} , {words[pick[1]]} plot", "label": label})
    return rows


def write_tsv(path, rows):
    with open(path, "w") as f:
        f.write("sentence\tlabel\n" + "".join(f"{r['sentence']}\t{r['label']}\n" for r in rows))


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    """Tiny models with the tiny tokenizer saved next to them, and SST-2-shaped and text files."""
    root = tmp_path_factory.mktemp("example")
    tokenizer = tiny_tokenizer()
    for name, model in (("lm", tiny_causal_lm("opt")), ("bert", tiny_bert_classifier())):
        model.save_pretrained(root / name)
        tokenizer.save_pretrained(root / name)
    write_tsv(root / "train.tsv", sentences(32, seed=0))
    write_tsv(root / "validation.tsv", sentences(12, seed=1))
    for split, n in (("train", 32), ("validation", 8)):
        with open(root / f"{split}.jsonl", "w") as f:
            f.writelines(json.dumps({"text": r["sentence"] + " it was good"}) + "\n" for r in sentences(n, 2))
    return root


def run_example(workspace, tmp_path, *extra: str):
    argv = [
        "--output_dir",
        str(tmp_path / "out"),
        "--max_steps",
        "4",
        "--per_device_train_batch_size",
        "4",
        "--per_device_eval_batch_size",
        "8",
        "--report_to",
        "none",
        "--save_strategy",
        "no",
        "--use_cpu",
        "--max_length",
        "32",
        "--disable_tqdm",
        "true",
        *extra,
    ]
    return train_script.main(argv)


KINDS = {
    "causal_lm": ("lm", "jsonl", ["--task_type", "causal_lm"]),
    "classification": ("bert", "tsv", ["--task_name", "sst2", "--zo_head_init_max_samples", "16"]),
    "prompt_classification": ("lm", "tsv", ["--task_name", "sst2"]),
}


@pytest.mark.parametrize("peft", [None, "lora", "ln_tuning"])
@pytest.mark.parametrize("kind", list(KINDS))
def test_train_save_reload_evaluate(workspace, tmp_path, kind, peft):
    model_dir, extension, extra = KINDS[kind]
    base = str(workspace / model_dir)
    argv = [
        "--model_name_or_path",
        base,
        "--train_file",
        str(workspace / f"train.{extension}"),
        "--validation_file",
        str(workspace / f"validation.{extension}"),
        "--learning_rate",
        "1e-2",
        *extra,
    ]
    if peft:
        argv += ["--peft", peft, "--zo_eps", "1e-2"]
    trainer, metrics = run_example(workspace, tmp_path, *argv)

    assert trainer.state.global_step == 4
    assert "eval_loss" in metrics and (kind == "causal_lm") == ("eval_accuracy" not in metrics)
    if kind == "prompt_classification":
        assert trainer.compute_loss_func.__self__.label_words == (" terrible", " great")
        assert trainer.model.config.architectures == ["OPTForCausalLM"]
    if peft == "lora" and kind != "classification":  # a prompt task adapts q_proj alone, PEFT's choice otherwise
        expected = {"q_proj"} if kind == "prompt_classification" else {"q_proj", "v_proj"}
        assert lora_target_names(trainer.model) == expected
    if kind == "classification":
        assert trainer.zo_heads.names  # the default head options applied to the new head

    # The saved model (or adapter) reloads to the same weights and reproduces the evaluation.
    auto = AutoModelForSequenceClassification if kind == "classification" else AutoModelForCausalLM
    reloaded = auto.from_pretrained(base if peft else str(tmp_path / "out"))
    if peft:
        from peft import PeftModel

        reloaded = PeftModel.from_pretrained(reloaded, str(tmp_path / "out"))
    trained = trainer.model.state_dict()
    original = auto.from_pretrained(base).state_dict()
    reloaded_state = reloaded.state_dict()
    assert trained.keys() == reloaded_state.keys()
    for name, tensor in trained.items():
        assert torch.equal(tensor, reloaded_state[name]), name
    if peft is None:
        assert any(not torch.equal(t, original[n]) for n, t in reloaded_state.items() if n in original)
    elif peft == "lora":
        assert any("lora_B" in n and bool(t.abs().sum() > 0) for n, t in reloaded_state.items())
    else:  # the trained copies of the norm layers moved away from the originals
        tuned = {n: t for n, t in reloaded_state.items() if ".ln_tuning_layers." in n}
        originals = [
            original[n.replace(".ln_tuning_layers.default", "").removeprefix("base_model.model.")] for n in tuned
        ]
        assert tuned and any(not torch.equal(t, o) for t, o in zip(tuned.values(), originals))
    trainer.model = trainer.model_wrapped = reloaded.eval()
    again = trainer.evaluate()
    for key in ("eval_loss", "eval_accuracy"):
        if key in metrics:
            assert again[key] == pytest.approx(metrics[key], abs=1e-6), key

    # The documented evaluate-only command, on the output folder (an adapter's loads onto the base it names).
    validation = ["--validation_file", str(workspace / f"validation.{extension}")]
    _, evaluated = train_script.main(
        ["--model_name_or_path", str(tmp_path / "out"), *validation, *extra, "--do_eval"]
        + ["--output_dir", str(tmp_path / "eval-out"), "--report_to", "none", "--use_cpu", "--max_length", "32"]
    )
    for key in ("eval_loss", "eval_accuracy"):
        if key in metrics:
            assert evaluated[key] == pytest.approx(metrics[key], abs=1e-6), key


def test_prompt_evaluation_scores_label_words(workspace, tmp_path):
    """Evaluation picks the label word with the highest log-likelihood after the prompt."""
    trainer, metrics = run_example(
        workspace,
        tmp_path,
        "--model_name_or_path",
        str(workspace / "lm"),
        "--task_name",
        "sst2",
        "--train_file",
        str(workspace / "train.tsv"),
        "--validation_file",
        str(workspace / "validation.tsv"),
        "--learning_rate",
        "0",
    )
    model, tokenizer = trainer.model, trainer.processing_class
    batch = trainer.data_collator([trainer.eval_dataset[0], trainer.eval_dataset[1]])
    assert batch["input_ids"].shape[0] == 2 and batch["logits_to_keep"] == 1  # one prompt per example, one position
    output = trainer.predict(trainer.eval_dataset)
    words = [tokenizer(w, add_special_tokens=False)["input_ids"][0] for w in (" terrible", " great")]
    assert tokenizer.decode(words[1]).strip() == "great"
    expected = []
    for row in trainer.eval_dataset:  # each prompt alone, unpadded: the batch's left padding changes nothing
        with torch.no_grad():
            logprobs = torch.log_softmax(model(input_ids=torch.tensor([row["input_ids"]])).logits[0, -1], -1)
        expected.append([float(logprobs[w]) for w in words])
    assert torch.allclose(torch.tensor(output.predictions), torch.tensor(expected), atol=1e-4)


def test_push_to_hub_uploads_model_and_card(workspace, tmp_path, monkeypatch):
    """--push_to_hub uploads the trained model with a model card tagged zeroth-order and hf-zo (no network)."""
    import huggingface_hub

    calls = {}

    class RepoUrl(str):
        repo_id = "someone/tiny-zo"

    def create_repo(self, repo_id, **kwargs):
        calls["create_repo"] = repo_id
        return RepoUrl(f"https://huggingface.co/{repo_id}")

    def upload_folder(self, repo_id, folder_path, **kwargs):
        files = sorted(os.listdir(folder_path))
        with open(os.path.join(folder_path, "README.md")) as f:
            calls["upload_folder"] = {"repo_id": repo_id, "files": files, "card": f.read(), **kwargs}
        return "commit"

    monkeypatch.setattr(huggingface_hub.HfApi, "create_repo", create_repo)
    monkeypatch.setattr(huggingface_hub.HfApi, "upload_folder", upload_folder)
    monkeypatch.setattr(huggingface_hub.HfApi, "model_info", lambda *a, **k: (_ for _ in ()).throw(OSError()))
    run_example(
        workspace,
        tmp_path,
        "--model_name_or_path",
        str(workspace / "bert"),
        "--task_name",
        "sst2",
        "--train_file",
        str(workspace / "train.tsv"),
        "--validation_file",
        str(workspace / "validation.tsv"),
        "--peft",
        "lora",
        "--push_to_hub",
        "--hub_model_id",
        "someone/tiny-zo",
        "--zo_head_init_max_samples",
        "16",
    )
    assert calls["create_repo"] == "someone/tiny-zo"
    upload = calls["upload_folder"]
    assert upload["repo_id"] == "someone/tiny-zo"
    assert {"adapter_model.safetensors", "adapter_config.json", "README.md", "tokenizer.json"} <= set(upload["files"])
    header = upload["card"].split("---")[1]
    assert "- zeroth-order" in header and "- hf-zo" in header
    assert "library_name: peft" in header


@pytest.mark.parametrize("peft", ["prefix", "prompt"])
def test_prefix_and_prompt_tuning_train_their_virtual_tokens(workspace, tmp_path, peft):
    trainer, metrics = run_example(
        workspace,
        tmp_path,
        "--model_name_or_path",
        str(workspace / "lm"),
        "--task_name",
        "sst2",
        "--train_file",
        str(workspace / "train.tsv"),
        "--validation_file",
        str(workspace / "validation.tsv"),
        "--peft",
        peft,
        "--num_virtual_tokens",
        "3",
        "--learning_rate",
        "1e-2",
        "--zo_eps",
        "1e-1",
    )
    from peft import PeftModel

    trained = {n: p for n, p in trainer.model.named_parameters() if p.requires_grad}
    assert trained and all("prompt_encoder" in n for n in trained)
    reloaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(workspace / "lm")), tmp_path / "out")
    torch.testing.assert_close(
        reloaded.get_prompt_embedding_to_save("default"), trainer.model.get_prompt_embedding_to_save("default")
    )
    assert 0.0 <= metrics["eval_accuracy"] <= 1.0 and metrics["eval_loss"] > 0


def test_api_reference_lists_every_public_object():
    """docs/api.md has an entry for every name that hf_zo and its subpackages export."""
    import importlib

    with open(os.path.join(ROOT, "docs", "api.md")) as f:
        entries = {line.split("`")[1].split("(")[0] for line in f if line.startswith("### `")}
    modules = ["hf_zo", "hf_zo.optim", "hf_zo.heads", "hf_zo.metrics", "hf_zo.engine", "hf_zo.offload"]
    modules += ["hf_zo.parallel", "hf_zo.trajectory", "hf_zo.philox", "hf_zo.models", "hf_zo.training"]
    modules += ["hf_zo.peft_warnings", "hf_zo.sft"]
    missing = {m: sorted(set(importlib.import_module(m).__all__) - entries) for m in modules}
    assert not any(missing.values()), f"docs/api.md lacks {missing}: run python docs/gen_api.py"


@pytest.mark.parametrize("kind", list(KINDS))
def test_data_without_the_task_columns_fails_naming_them(workspace, tmp_path, kind):
    model, _, flags = KINDS[kind]
    wrong = tmp_path / "wrong.tsv"
    wrong.write_text("review\tsentiment\na good film\t1\n")
    expected = r"\['text'\]" if kind == "causal_lm" else r"\['sentence', 'label'\]"  # sst2's fields and label
    with pytest.raises(ValueError, match=rf"train data \(.*wrong.tsv\) has no column {expected}; its columns are"):
        run_example(
            workspace,
            tmp_path,
            "--model_name_or_path",
            str(workspace / model),
            "--train_file",
            str(wrong),
            "--validation_file",
            str(wrong),
            *flags,
        )


def test_text_and_label_columns_name_the_columns_of_data_without_a_task(workspace, tmp_path):
    lines = [f"{r['sentence']}\t{r['label']}\n" for r in sentences(16, seed=3)]
    (tmp_path / "reviews.tsv").write_text("review\tsentiment\n" + "".join(lines))
    files = ["--train_file", str(tmp_path / "reviews.tsv"), "--validation_file", str(tmp_path / "reviews.tsv")]
    model = ["--model_name_or_path", str(workspace / "bert"), "--zo_head_init_max_samples", "16"]
    columns = ["--text_column", "review", "--label_column", "sentiment"]
    trainer, metrics = run_example(workspace, tmp_path, *model, *files, *columns, "--task_type", "classification")
    assert len(trainer.train_dataset) == 16 and 0.0 <= metrics["eval_accuracy"] <= 1.0
    # A task reads its own fields: --text_column would be silently ignored, so it is refused.
    with pytest.raises(ValueError, match=r"--text_column review applies to data without --task_name.*\['sentence'\]"):
        run_example(workspace, tmp_path, *model, *files, *columns, "--task_name", "sst2")


def test_text_labels_are_numbered_in_sorted_order_without_a_task(workspace, tmp_path):
    rows = [{**r, "label": ("negative", "positive")[r["label"]]} for r in sentences(16, seed=3)]
    write_tsv(tmp_path / "text_labels.tsv", rows)
    files = ["--train_file", str(tmp_path / "text_labels.tsv"), "--validation_file", str(tmp_path / "text_labels.tsv")]
    model = ["--model_name_or_path", str(workspace / "bert"), "--zo_head_init_max_samples", "16"]
    trainer, metrics = run_example(workspace, tmp_path, *model, *files, "--task_type", "classification")
    assert trainer.model.config.id2label == {0: "negative", 1: "positive"}
    assert trainer.eval_dataset["label"] == [int(r["label"] == "positive") for r in rows]
    trainer, evaluated = run_example(  # the saved classifier, evaluated on integer labels without a training split
        workspace,
        tmp_path / "eval",
        *["--model_name_or_path", str(tmp_path / "out"), "--task_type", "classification", "--do_eval"],
        *["--validation_file", str(workspace / "validation.tsv")],
    )
    assert trainer.train_dataset is None and "eval_accuracy" in evaluated
    with pytest.raises(
        ValueError, match=r"--task_name sst2 numbers its labels 0 to 1 .* holds \['negative', 'positive'\]"
    ):
        run_example(workspace, tmp_path / "sst2", *model, *files, "--task_name", "sst2")


def test_integer_labels_not_from_zero_are_numbered_like_text_labels(workspace, tmp_path):
    """Star ratings 1 and 2 become classes 0 and 1 named "1" and "2" (as `run_glue.py` numbers them), instead of a
    head with too few outputs; and a .jsonl training file goes with a .json validation file."""
    rows = [{"sentence": r["sentence"], "label": r["label"] + 1} for r in sentences(16, seed=3)]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "validation.json").write_text(json.dumps(rows))
    files = ["--train_file", str(tmp_path / "train.jsonl"), "--validation_file", str(tmp_path / "validation.json")]
    model = ["--model_name_or_path", str(workspace / "bert"), "--zo_head_init_max_samples", "16"]
    trainer, metrics = run_example(workspace, tmp_path, *model, *files, "--task_type", "classification")
    assert trainer.model.config.id2label == {0: "1", 1: "2"}
    assert trainer.eval_dataset["label"] == [r["label"] - 1 for r in rows]
    assert 0.0 <= metrics["eval_accuracy"] <= 1.0
    with pytest.raises(ValueError, match=r"--task_name sst2 numbers its labels 0 to 1 .* holds \[1, 2\]"):
        run_example(workspace, tmp_path / "sst2", *model, *files, "--task_name", "sst2")


def test_classifier_takes_prompt_tuning_and_refuses_prefix_tuning_with_the_fix(workspace, tmp_path):
    flags = [
        "--model_name_or_path",
        str(workspace / "bert"),
        "--task_name",
        "sst2",
        "--zo_head_init_max_samples",
        "16",
    ]
    flags += ["--train_file", str(workspace / "train.tsv"), "--validation_file", str(workspace / "validation.tsv")]
    trainer, _ = run_example(workspace, tmp_path, *flags, "--peft", "prompt", "--num_virtual_tokens", "3")
    trained = {n for n, p in trainer.model.named_parameters() if p.requires_grad}
    assert any("prompt_encoder" in n for n in trained) and any("classifier" in n for n in trained)
    # PEFT passes a prefix as past_key_values, which BERT does not take: the script says so before loading data.
    with pytest.raises(
        ValueError, match=r"--peft prefix needs a classifier that takes past_key_values.*--peft prompt"
    ):
        run_example(workspace, tmp_path / "prefix", *flags, "--peft", "prefix")


def test_empty_file_and_sizes_below_one_fail_naming_the_fix(workspace, tmp_path):
    (tmp_path / "empty.tsv").write_text("sentence\tlabel\n")
    model = ["--model_name_or_path", str(workspace / "bert"), "--task_name", "sst2"]
    files = ["--train_file", str(tmp_path / "empty.tsv"), "--validation_file", str(workspace / "validation.tsv")]
    with pytest.raises(ValueError, match=r"Could not read \[.*empty.tsv.*\].*at least one example"):
        run_example(workspace, tmp_path, *model, *files)
    for flag in ("--num_train", "--num_eval", "--max_length"):
        with pytest.raises(ValueError, match=rf"{flag} must be at least 1, got 0"):
            train_script.parse_arguments([*model, flag, "0", "--output_dir", str(tmp_path / "out")])


def test_a_missing_model_folder_unknown_lora_targets_and_do_predict_fail_naming_the_fix(
    workspace, tmp_path, monkeypatch
):
    missing = str(tmp_path / "no-such-model")
    with pytest.raises(ValueError, match=rf"--model_name_or_path {missing} is not a folder"):
        train_script.parse_arguments(["--model_name_or_path", missing, "--output_dir", str(tmp_path / "out")])
    flags = ["--model_name_or_path", str(workspace / "bert"), "--task_name", "sst2", "--peft", "lora"]
    flags += ["--train_file", str(workspace / "train.tsv"), "--validation_file", str(workspace / "validation.tsv")]
    with pytest.raises(ValueError, match=r"no module named \['q_proj'\]; its linear layers are named \[.*'query'"):
        run_example(workspace, tmp_path, *flags, "--lora_target_modules", "query", "q_proj")
    with pytest.raises(ValueError, match=r"--do_predict: this script trains and evaluates but writes no predictions"):
        run_example(workspace, tmp_path, *flags, "--do_predict")
    monkeypatch.setattr(train_script, "get_available_reporting_integrations", lambda: [])
    with pytest.raises(ValueError, match=r"--report_to tensorboard: not installed here; .* --report_to none"):
        run_example(workspace, tmp_path, *flags, "--report_to", "tensorboard")


def test_resume_from_checkpoint_true_continues_from_the_last_checkpoint(workspace, tmp_path):
    flags = ["--model_name_or_path", str(workspace / "bert"), "--task_name", "sst2"]
    flags += ["--zo_head_init_max_samples", "16"]
    flags += ["--train_file", str(workspace / "train.tsv"), "--validation_file", str(workspace / "validation.tsv")]
    whole, _ = run_example(workspace, tmp_path / "whole", *flags)
    checkpoints = [*flags, "--save_strategy", "steps", "--save_steps", "2"]
    run_example(workspace, tmp_path / "resumed", *checkpoints, "--max_steps", "2")
    resumed, _ = run_example(workspace, tmp_path / "resumed", *checkpoints, "--resume_from_checkpoint", "True")
    assert resumed.state.global_step == 4
    for (name, a), b in zip(whole.model.named_parameters(), resumed.model.parameters()):
        assert torch.equal(a, b), name
    with pytest.raises(ValueError, match="No valid checkpoint found"):
        run_example(workspace, tmp_path / "fresh", *flags, "--resume_from_checkpoint", "true")


def test_the_prompt_recipe_is_a_named_choice(workspace, tmp_path):
    """`--recipe prompt` gives LoRA on a prompt task `PROMPT_ZO_DEFAULTS`, each flag given for one of its fields
    winning; without it every run keeps `ZOConfig`'s defaults, whichever flags were typed; where the recipe does not
    apply, it fails naming the flag."""
    out = ["--output_dir", str(tmp_path / "out")]
    full = ["--model_name_or_path", str(workspace / "lm"), "--task_name", "sst2", *out]
    prompt = [*full, "--peft", "lora"]

    def estimator(*argv):
        args = train_script.parse_arguments(list(argv))[2]
        return args.zo_optimizer, args.zo_num_perturbations, args.zo_noise, args.learning_rate

    assert estimator(*prompt)[:3] == ("zo_sgd", 1, "gaussian")
    assert estimator(*prompt, "--zo_num_perturbations", "8")[:3] == ("zo_sgd", 8, "gaussian")
    assert estimator(*prompt, "--recipe", "prompt") == ("fzoo", 4, "rademacher", 6e-5)
    assert estimator(*prompt, "--recipe", "prompt", "--zo_num_perturbations", "8") == ("fzoo", 8, "rademacher", 6e-5)
    assert estimator(*prompt, "--recipe=prompt", "--learning_rate", "1e-4") == ("fzoo", 4, "rademacher", 1e-4)
    with pytest.raises(ValueError, match="add --peft lora"):
        estimator(*full, "--recipe", "prompt")
    with pytest.raises(ValueError, match="for a prompt task"):
        estimator(
            "--model_name_or_path",
            str(workspace / "bert"),
            "--task_name",
            "sst2",
            "--peft",
            "lora",
            *out,
            "--recipe",
            "prompt",
        )
    with pytest.raises(ValueError, match="sequential engine"):
        estimator(*prompt, "--recipe", "prompt", "--zo_engine", "dual")
    config = tmp_path / "config.yaml"
    config.write_text(
        f"model_name_or_path: {workspace / 'lm'}\ntask_name: sst2\npeft: lora\nrecipe: prompt\nzo_noise: gaussian\n"
    )
    assert estimator(str(config), *out) == ("fzoo", 4, "gaussian", 6e-5)


def test_lora_layers_to_transform_and_the_frozen_blocks_below_them(workspace, tmp_path):
    flags = ["--model_name_or_path", str(workspace / "lm"), "--task_name", "sst2", "--peft", "lora"]
    flags += ["--train_file", str(workspace / "train.tsv"), "--validation_file", str(workspace / "validation.tsv")]
    trainer, _ = run_example(workspace, tmp_path, *flags, "--recipe", "prompt", "--lora_layers_to_transform", "1")
    lora = [name for name, _ in trainer.model.named_parameters() if "lora" in name]
    assert {name.split(".layers.")[1].split(".")[0] for name in lora} == {"1"}
    prefix = trainer._zo_frozen_prefix[1]
    assert len(prefix.blocks) == 1 and prefix.reused == 4 * 4  # FZOO: a centre and 4 one-sided forwards a step


def test_config_file_with_flags_that_override_it(tmp_path):
    config = tmp_path / "config.yaml"
    config.write_text(
        "model_name_or_path: some/model\n"
        "task_name: sst2\n"
        "learning_rate: 1e-3\n"  # YAML reads this as a string: it goes through the flag's type
        "max_steps: 100\n"
        "remove_unused_columns: false\n"  # a flag whose default is True (argparse also has --no_...)
        "lr_scheduler_type: linear\n"  # a choice among an enum's values
        "peft: ln_tuning\n"
        f"output_dir: {tmp_path / 'out'}\n"
    )
    model_args, data, args = train_script.parse_arguments([str(config), "--max_steps", "7", "--use_cpu"])
    assert model_args.model_name_or_path == "some/model" and data.task_name == "sst2"
    assert args.learning_rate == 1e-3 and args.max_steps == 7 and args.remove_unused_columns is False
    assert model_args.peft == "ln_tuning"
    # The file's PEFT method switched off from the command line: full fine-tuning.
    assert train_script.parse_arguments([str(config), "--peft", "none", "--use_cpu"])[0].peft is None

    as_json = tmp_path / "config.json"
    as_json.write_text(json.dumps({"model_name_or_path": "some/model", "output_dir": str(tmp_path / "out")}))
    assert train_script.parse_arguments([str(as_json), "--use_cpu"])[0].model_name_or_path == "some/model"

    config.write_text("model_name_or_path: some/model\nlearning_rat: 1e-3\n")
    with pytest.raises(ValueError, match=r"unknown arguments \['learning_rat'\]"):
        train_script.parse_arguments([str(config)])
    # A value outside a flag's choices: argparse checks flags, not the defaults a file sets, so the script does.
    config.write_text("model_name_or_path: some/model\ntask_name: sst3\n")
    with pytest.raises(ValueError, match=r"sets task_name to 'sst3'; choose one of \['sst2'"):
        train_script.parse_arguments([str(config)])


def test_an_output_dir_holding_a_run_is_refused_unless_resumed_or_overwritten(workspace, tmp_path):
    import hashlib
    import shutil
    from pathlib import Path

    def digest(folder):
        return {p: hashlib.sha256(p.read_bytes()).hexdigest() for p in Path(folder).rglob("*") if p.is_file()}

    flags = ["--model_name_or_path", str(workspace / "bert"), "--task_name", "sst2"]
    flags += ["--zo_head_init_max_samples", "16", "--train_file", str(workspace / "train.tsv")]
    first, _ = run_example(workspace, tmp_path, *flags)
    saved = digest(first.args.output_dir)
    with pytest.raises(ValueError, match=r"already holds a run or model \(.*model.safetensors.*\); training there"):
        run_example(workspace, tmp_path, *flags)
    assert digest(first.args.output_dir) == saved
    run_example(workspace, tmp_path, *flags, "--overwrite_output_dir")

    # The folder the model comes from is refused by ZOTrainer itself, even when asked to overwrite.
    model = tmp_path / "model"
    shutil.copytree(workspace / "bert", model)
    flags[1] = str(model)
    before = digest(model)
    with pytest.raises(ValueError, match="is the folder the model was loaded from"):
        run_example(workspace, tmp_path, *flags, "--output_dir", str(model), "--overwrite_output_dir")
    assert digest(model) == before
    with pytest.raises(ValueError, match=r"output_dir '.*notes.txt' is a file; checkpoints and the model are saved"):
        (tmp_path / "notes.txt").write_text("mine")
        run_example(workspace, tmp_path, *flags, "--output_dir", str(tmp_path / "notes.txt"))
