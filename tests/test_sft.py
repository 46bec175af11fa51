"""`ZOSFTTrainer`: the ZO wiring of `ZOTrainer` over TRL's `SFTTrainer`, on tiny models and a word-level tokenizer.

A ZO step through it is `ZOTrainer`'s step bitwise, resume and replay are bitwise, the loss it perturbs covers only
what TRL trains on, `peft_config` trains the adapter with LoRA's defaults, options needing a backward pass fail at
construction, and `import hf_zo` works without TRL.
"""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest
import torch
from peft import LoraConfig
from transformers import PreTrainedTokenizerFast
from trl import SFTConfig

from hf_zo import ZOSFTConfig, ZOSFTTrainer, ZOTrainer, ZOTrajectory, replay
from hf_zo.training import METHOD_DEFAULTS

from tiny_models import VOCAB, lm_dataset, ragged_lm_dataset, tiny_causal_lm, zo_args

WORDS = ["user", "assistant", ":", "is", "it", "good", "bad", "yes", "no", "the", "movie", "plot", "a", "fine"]

CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }} : "
    "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] }} </s>{% endgeneration %}"
    "{% else %}{{ message['content'] }} </s>{% endif %} {% endfor %}"
    "{% if add_generation_prompt %}assistant : {% endif %}"
)
"""A chat template over `WORDS` whose `{% generation %}` markers give TRL the assistant tokens."""


def tokenizer() -> PreTrainedTokenizerFast:
    """A word-level tokenizer with an eos token and `CHAT_TEMPLATE`."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {token: i for i, token in enumerate(["<unk>", "<pad>", "</s>", *WORDS])}
    assert len(vocab) <= VOCAB
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", pad_token="<pad>", eos_token="</s>")
    tok.chat_template = CHAT_TEMPLATE
    return tok


def sft_args(tmp_path, **overrides) -> ZOSFTConfig:
    """A `ZOSFTConfig` for a short, quiet CPU run: batch 8 in dataset order, lr and eps 1e-3, fp32."""
    values = dict(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=8,
        learning_rate=1e-3,
        zo_eps=1e-3,
        max_steps=2,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
        use_cpu=True,
        bf16=False,
        train_sampling_strategy="sequential",
    )
    values.update(overrides)
    return ZOSFTConfig(**values)


def _trainable(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def _assert_bitwise(actual: dict, expected: dict) -> None:
    assert actual.keys() == expected.keys()
    for name in expected:
        assert torch.equal(actual[name], expected[name]), name


def _lm_texts():
    """Language-modelling token ids (TRL takes a pre-tokenized `input_ids` column as is)."""
    return lm_dataset(8).remove_columns(["attention_mask", "labels"])


def test_zo_step_equals_zotrainer_step_bitwise(tmp_path):
    """On the same tokenized batch, ZOSFTTrainer's steps are ZOTrainer's, and SFT's metrics are training metrics."""
    data = lm_dataset(8)
    common = dict(per_device_train_batch_size=8, max_steps=2, logging_steps=1, train_sampling_strategy="sequential")
    reference = ZOTrainer(model=tiny_causal_lm("llama"), args=zo_args(tmp_path, **common), train_dataset=data)
    reference.train()
    trainer = ZOSFTTrainer(
        model=tiny_causal_lm("llama"), args=sft_args(tmp_path), train_dataset=_lm_texts(), processing_class=tokenizer()
    )
    trainer.train()

    _assert_bitwise(_trainable(trainer.model), _trainable(reference.model))
    assert not torch.equal(_trainable(trainer.model)["lm_head.weight"], tiny_causal_lm("llama").lm_head.weight)
    logs = [log for log in trainer.state.log_history if "loss" in log]
    expected = [log for log in reference.state.log_history if "loss" in log]
    assert [log["loss"] for log in logs] == [log["loss"] for log in expected]
    # One record per micro-batch, as training metrics: 8 examples x 16 tokens a step.
    assert [log["num_tokens"] for log in logs] == [128.0, 256.0]
    assert all("entropy" in log and "mean_token_accuracy" in log for log in logs)
    assert not any(key.startswith("eval_") for log in trainer.state.log_history for key in log)
    assert set(trainer.model.model_tags) >= {"zeroth-order", "hf-zo", "trl", "sft"}


def _sft_run(tmp_path, output_dir, resume_from_checkpoint=None):
    trainer = ZOSFTTrainer(
        model=tiny_causal_lm("llama"),
        args=sft_args(tmp_path, output_dir=str(output_dir), max_steps=4, save_strategy="steps", save_steps=2),
        train_dataset=_lm_texts(),
        processing_class=tokenizer(),
    )
    trainer.train(resume_from_checkpoint=resume_from_checkpoint)
    trainer.save_model()
    return trainer


def test_resume_and_replay_through_zosfttrainer_are_bitwise(tmp_path):
    uninterrupted = _sft_run(tmp_path, tmp_path / "a")
    trained = _trainable(uninterrupted.model)

    shutil.copytree(tmp_path / "a" / "checkpoint-2", tmp_path / "b" / "checkpoint-2")
    resumed = _sft_run(tmp_path, tmp_path / "b", str(tmp_path / "b" / "checkpoint-2"))
    _assert_bitwise(_trainable(resumed.model), trained)

    trajectory = ZOTrajectory.load(tmp_path / "b")
    assert len(trajectory) == 4
    base = tiny_causal_lm("llama")
    replay(base, trajectory)
    _assert_bitwise(_trainable(base), trained)


def _masked_loss(model, batch) -> torch.Tensor:
    """The mean next-token cross-entropy over the positions whose label is not -100."""
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    labels = batch["labels"][:, 1:]
    return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), labels.flatten(), ignore_index=-100)


CONVERSATIONS = {
    "messages": [
        [{"role": "user", "content": "is the movie good"}, {"role": "assistant", "content": "yes"}],
        [{"role": "user", "content": "is the plot bad"}, {"role": "assistant", "content": "no it is fine"}],
        [{"role": "user", "content": "a fine movie"}, {"role": "assistant", "content": "yes it is good"}],
    ]
}
PROMPT_COMPLETIONS = {
    "prompt": ["is the movie good", "is the plot bad", "a fine movie"],
    "completion": [" yes", " no it is fine", " yes it is good"],
}


@pytest.mark.parametrize(
    "data, option",
    [(CONVERSATIONS, "assistant_only_loss"), (PROMPT_COMPLETIONS, "completion_only_loss")],
    ids=["assistant_only_loss", "completion_only_loss"],
)
def test_zo_perturbs_and_scores_only_the_trained_tokens(tmp_path, data, option):
    """The loss of ZO's forwards is the cross-entropy over the assistant/completion tokens only."""
    from datasets import Dataset

    trainer = ZOSFTTrainer(
        model=tiny_causal_lm("llama"),
        args=sft_args(tmp_path, **{option: True}),
        train_dataset=Dataset.from_dict(data),
        processing_class=tokenizer(),
    )
    batch = trainer._prepare_inputs(next(iter(trainer.get_train_dataloader())))
    trained = batch["labels"] != -100
    assert 0 < int(trained.sum()) < int(batch["attention_mask"].sum())  # the prompts' tokens are left out
    words = set(tokenizer().convert_ids_to_tokens(batch["input_ids"][trained].tolist()))
    assert words <= {"yes", "no", "it", "is", "fine", "good", "</s>"}  # the answers' words and their eos
    reference = _masked_loss(trainer.model, batch)
    trainer.model.eval()
    assert torch.allclose(trainer.compute_loss(trainer.model, dict(batch)), reference, atol=1e-6)

    losses = []

    def closure():  # what ZOTrainerMixin.training_step hands the optimizer: SFTTrainer.compute_loss on the batch
        losses.append(trainer.compute_loss(trainer.model, dict(batch)).detach())
        return losses[-1]

    records = trainer.create_optimizer().estimate(closure)
    assert len(losses) == 2 and len(records) == 1
    # The two forwards at θ ± eps·z straddle the unperturbed masked loss.
    assert torch.allclose((losses[0] + losses[1]) / 2, reference, atol=1e-4)


def test_fused_lm_head_projects_only_the_labelled_positions_on_cpu(tmp_path, monkeypatch):
    """ZOSFTTrainer's loss on the CPU projects the completion's positions only, to the same value as TRL's projection
    of every position (which TRL makes on devices without Triton)."""
    from datasets import Dataset
    from trl import SFTTrainer
    from trl.trainer import utils as trl_utils

    trainer = ZOSFTTrainer(
        model=tiny_causal_lm("llama"),
        args=sft_args(tmp_path, completion_only_loss=True),
        train_dataset=Dataset.from_dict(PROMPT_COMPLETIONS),
        processing_class=tokenizer(),
    )
    batch = trainer._prepare_inputs(next(iter(trainer.get_train_dataloader())))
    projected = []
    project = trl_utils._ChunkedLogProbFunction.apply

    def counting(hidden, *args):
        projected.append(hidden.shape[0])
        return project(hidden, *args)

    monkeypatch.setattr(trl_utils._ChunkedLogProbFunction, "apply", counting)
    trainer.model.eval()
    with torch.no_grad():
        compact = trainer.compute_loss(trainer.model, dict(batch))
        every_position = SFTTrainer.compute_loss(trainer, trainer.model, dict(batch))
    labelled = int((batch["labels"][:, 1:] != -100).sum())
    assert projected == [labelled, batch["input_ids"].numel() - batch["input_ids"].shape[0]]
    assert trl_utils._use_triton(torch.device("cpu")) is False  # the context restored TRL's choice
    assert torch.allclose(compact, every_position, rtol=1e-6, atol=0)
    assert torch.allclose(compact, _masked_loss(trainer.model, batch), atol=1e-6)


def test_peft_config_trains_the_adapter_only_with_lora_defaults(tmp_path):
    model = tiny_causal_lm("llama")
    frozen = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer = ZOSFTTrainer(
        model=model,
        args=sft_args(tmp_path, learning_rate=None, zo_eps=None),
        train_dataset=_lm_texts(),
        processing_class=tokenizer(),
        peft_config=LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False),
    )
    lora = METHOD_DEFAULTS["lora"]
    assert (trainer.args.learning_rate, trainer.args.zo_eps) == (lora.learning_rate, lora.zo_eps)
    trainable = _trainable(trainer.model)
    assert trainable and all("lora_" in name for name in trainable)
    optimized = {id(p) for group in trainer.create_optimizer().param_groups for p in group["params"]}
    assert optimized == {id(p) for p in trainer.model.parameters() if p.requires_grad}

    trainer.train()
    after = _trainable(trainer.model)
    assert any(not torch.equal(after[n], trainable[n]) for n in after)
    base = trainer.model.get_base_model()
    for name, param in base.named_parameters():
        if "lora_" not in name:
            assert torch.equal(param, frozen[name.replace(".base_layer", "")]), name


def test_packed_padding_free_batches_train_and_count_their_tokens(tmp_path):
    """Packing (TRL's best-fit, padding-free: `position_ids` and no attention mask) under ZO's default sampler."""
    data = ragged_lm_dataset(8).remove_columns(["attention_mask", "labels"])
    args = sft_args(tmp_path, packing=True, max_length=32, train_sampling_strategy="group_by_length")
    trainer = ZOSFTTrainer(model=tiny_causal_lm("llama"), args=args, train_dataset=data, processing_class=tokenizer())
    before = _trainable(trainer.model)
    trainer.train()
    tokens = sum(len(ids) for ids in data["input_ids"])  # all 8 examples fit one batch of packed rows
    assert [log["num_tokens"] for log in trainer.state.log_history if "loss" in log] == [tokens, 2 * tokens]
    after = _trainable(trainer.model)
    assert any(not torch.equal(after[n], before[n]) for n in after)


def test_model_given_by_name_is_loaded_before_the_zo_checks(tmp_path):
    tiny_causal_lm("llama").save_pretrained(tmp_path / "model")
    trainer = ZOSFTTrainer(
        model=str(tmp_path / "model"),
        args=sft_args(tmp_path, learning_rate=None, zo_eps=None),
        train_dataset=_lm_texts(),
        processing_class=tokenizer(),
    )
    full = METHOD_DEFAULTS["full"]
    assert (trainer.args.learning_rate, trainer.args.zo_eps) == (full.learning_rate, full.zo_eps)


@pytest.mark.parametrize(
    "option", ["activation_offloading", "gradient_checkpointing", "activation_checkpointing", "use_liger_kernel"]
)
def test_options_needing_a_backward_pass_fail_at_construction(tmp_path, option):
    with pytest.raises(ValueError, match=f"{option}=True"):
        sft_args(tmp_path, **{option: True})


def test_sft_config_with_trl_defaults_is_refused_naming_the_option(tmp_path):
    """An `SFTConfig` (TRL turns gradient checkpointing on by default) fails when the trainer is built."""
    args = SFTConfig(output_dir=str(tmp_path / "out"), report_to=[], use_cpu=True, bf16=False)
    with pytest.raises(ValueError, match="gradient_checkpointing=True"):
        ZOSFTTrainer(model=tiny_causal_lm("llama"), args=args, train_dataset=_lm_texts(), processing_class=tokenizer())


def test_config_parses_from_the_command_line():
    from transformers import HfArgumentParser
    from trl import TrlParser

    argv = ["--output_dir", "out", "--zo_eps", "0.01", "--assistant_only_loss", "true", "--use_cpu", "true"]
    for parser in (HfArgumentParser(ZOSFTConfig), TrlParser(ZOSFTConfig)):
        (args,) = parser.parse_args_into_dataclasses(argv)
        assert (args.zo_eps, args.assistant_only_loss, args.gradient_checkpointing) == (0.01, True, False)
        assert args.learning_rate is None and args.max_grad_norm == 0.0  # ZOConfig's defaults hold


def test_import_works_without_trl_and_zosfttrainer_names_the_install():
    code = (
        "import sys; sys.modules['trl'] = None\n"
        "import hf_zo\n"
        "try:\n"
        "    hf_zo.ZOSFTTrainer\n"
        "except ImportError as error:\n"
        "    print('ERROR', error)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert 'ERROR ZOSFTTrainer and ZOSFTConfig need TRL, which is not installed: pip install "hf_zo[trl]"' in (
        result.stdout
    )


def test_example_script_trains_lora_on_local_chat_file(tmp_path):
    """examples/sft.py: TRL's flags (`--use_peft`) over a local JSONL chat file; the adapter lands in output_dir."""
    import json
    from pathlib import Path

    tiny_causal_lm("llama").save_pretrained(tmp_path / "model")
    tokenizer().save_pretrained(tmp_path / "model")
    with open(tmp_path / "chat.jsonl", "w") as f:
        f.writelines(json.dumps({"messages": messages}) + "\n" for messages in CONVERSATIONS["messages"])
    script = Path(__file__).resolve().parents[1] / "examples" / "sft.py"
    command = [sys.executable, str(script), "--model_name_or_path", str(tmp_path / "model")]
    command += ["--train_file", str(tmp_path / "chat.jsonl"), "--output_dir", str(tmp_path / "out")]
    command += ["--use_peft", "--lora_target_modules", "q_proj", "v_proj", "--assistant_only_loss", "true"]
    command += ["--max_steps", "2", "--use_cpu", "true", "--bf16", "false", "--report_to", "none"]
    subprocess.run(command, check=True, capture_output=True, text=True)
    assert (tmp_path / "out" / "adapter_model.safetensors").is_file()
    assert len(ZOTrajectory.load(tmp_path / "out")) == 2


@pytest.mark.parametrize(
    "modules, expected",
    [
        (["q_proj"], {"q_proj"}),
        (["q_proj", "v_proj"], {"q_proj", "v_proj"}),
        (["all-linear"], "all-linear"),
        ([r".*\.q_proj"], r".*\.q_proj"),
    ],
)
def test_example_script_keeps_one_lora_target_a_module_name(modules, expected):
    """TRL's `ModelConfig` collapses one `--lora_target_modules` value to a string, which PEFT reads as a regular
    expression; examples/sft.py keeps a single plain name a name, and passes `all-linear` and regexes on."""
    from launch_worker import load_example
    from trl import ModelConfig

    config = load_example("sft").peft_config(ModelConfig(use_peft=True, lora_target_modules=modules))
    assert config.target_modules == expected
