"""The learning rate and eps `ZOConfig` leaves unset are chosen by what the model trains (hf_zo.training.defaults)."""

import subprocess
import sys
from pathlib import Path

import pytest
from datasets import Dataset
from peft import IA3Config, LNTuningConfig, LoraConfig, PrefixTuningConfig, TaskType, get_peft_model

from hf_zo import ZOConfig, ZOTrainer
from hf_zo.models import norm_module_names
from hf_zo.prompts import PromptClassification
from hf_zo.training import (
    LABEL_WORD_LORA_TARGET_DEFAULTS,
    LABEL_WORD_METHOD_DEFAULTS,
    METHOD_DEFAULTS,
    prompt_lora_layers,
    prompt_lora_target_modules,
    trained_method,
)

from tiny_models import lm_dataset, tiny_causal_lm


def _config(tmp_path, **overrides) -> ZOConfig:
    return ZOConfig(output_dir=str(tmp_path), max_steps=1, report_to=[], disable_tqdm=True, use_cpu=True, **overrides)


def _lora(target_modules=("q_proj",)):
    return get_peft_model(
        tiny_causal_lm("opt"), LoraConfig(task_type=TaskType.CAUSAL_LM, r=2, target_modules=list(target_modules))
    )


def _ln_tuning():
    model = tiny_causal_lm("opt")
    return get_peft_model(model, LNTuningConfig(task_type=TaskType.CAUSAL_LM, target_modules=norm_module_names(model)))


def _prefix():
    return get_peft_model(
        tiny_causal_lm("opt"), PrefixTuningConfig(task_type=TaskType.CAUSAL_LM, num_virtual_tokens=2)
    )


def _transformers_adapter():
    """What transformers' `model.add_adapter(LoraConfig(...))` leaves on the model (it needs peft >= 0.22)."""
    model = tiny_causal_lm("opt")
    model._hf_peft_config_loaded = True
    model.peft_config = {"default": LoraConfig(r=2, target_modules=["q_proj"])}
    model.active_adapters = lambda: ["default"]
    return model


@pytest.mark.parametrize(
    "build, method",
    [
        (lambda: tiny_causal_lm("opt"), "full"),
        (_lora, "lora"),
        (_transformers_adapter, "lora"),
        (_ln_tuning, "ln_tuning"),
        (_prefix, "prefix"),
    ],
    ids=["full", "lora", "add_adapter", "ln_tuning", "prefix"],
)
def test_unset_learning_rate_and_eps_come_from_the_trained_method(tmp_path, build, method):
    model = build()
    assert trained_method(model) == method
    args = _config(tmp_path)
    trainer = ZOTrainer(model=model, args=args, train_dataset=lm_dataset(4))
    expected = METHOD_DEFAULTS[method]
    assert (trainer.args.learning_rate, trainer.args.zo_eps) == (expected.learning_rate, expected.zo_eps)
    optimizer = trainer.create_optimizer()
    assert {group["lr"] for group in optimizer.param_groups} == {expected.learning_rate}
    assert trainer.zo_optimizer.eps == expected.zo_eps
    assert args.learning_rate is None and args.zo_eps is None  # the caller's config can serve another model


@pytest.mark.parametrize(
    "loss, target_modules, expected",
    [
        ("classification", ["q_proj"], (4e-3, 1e-2)),
        ("classification", ["q_proj", "v_proj"], (2e-3, 1e-2)),
        ("lm", ["q_proj"], (1e-4, 1e-2)),
    ],
    ids=["label-words-q", "label-words-q-v", "lm-loss"],
)
def test_lora_on_the_label_word_loss_takes_its_own_defaults(tmp_path, loss, target_modules, expected):
    """Prompt classification's label-word cross-entropy: 4e-3 for LoRA on q_proj alone, 2e-3 on other modules (both
    measured on the embedded LLM); its full-vocabulary variant keeps MeZO's LoRA grid, as every other loss does."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.WordLevel({"<unk>": 0, "<pad>": 1, "good": 2, "bad": 3, "it": 4}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", pad_token="<pad>")
    task = PromptClassification(tokenizer, "{sentence} it", [" bad", " good"], loss=loss)
    data = task.tokenize(Dataset.from_dict({"sentence": ["good", "bad"], "label": [1, 0]}))
    model = _lora(target_modules)
    trainer = ZOTrainer(model=model, args=_config(tmp_path), train_dataset=data, **task.trainer_kwargs())
    assert (trainer.args.learning_rate, trainer.args.zo_eps) == expected
    assert LABEL_WORD_METHOD_DEFAULTS["lora"].learning_rate == 2e-3
    assert LABEL_WORD_LORA_TARGET_DEFAULTS[frozenset({"q_proj"})].learning_rate == 4e-3


def test_prompt_tasks_adapt_the_query_projections_where_the_model_has_them():
    """LoRA's default targets for a prompt task: q_proj on a causal LM that names it, PEFT's choice elsewhere."""
    assert prompt_lora_target_modules(tiny_causal_lm("opt")) == ["q_proj"]
    assert prompt_lora_target_modules(tiny_causal_lm("gpt2")) is None  # a fused c_attn: PEFT's choice


def test_prompt_tasks_leave_the_lowest_third_of_the_layers_out():
    """LoRA's default layers for a prompt task: above the lowest third (10-29 of SmolLM2-135M's 30)."""
    from types import SimpleNamespace

    from transformers import LlamaConfig

    assert prompt_lora_layers(SimpleNamespace(config=LlamaConfig(num_hidden_layers=30))) == list(range(10, 30))
    assert prompt_lora_layers(tiny_causal_lm("opt")) == [0, 1]  # two layers: both
    assert prompt_lora_layers(SimpleNamespace(config=None)) is None  # no layer count: every layer, PEFT's default


def test_fzoo_takes_its_own_scale_and_refuses_a_method_it_was_not_measured_on(tmp_path):
    from hf_zo.training import OPTIMIZER_METHOD_DEFAULTS

    args = _config(tmp_path, zo_optimizer="fzoo", zo_num_perturbations=2)
    trainer = ZOTrainer(model=_lora(), args=args, train_dataset=lm_dataset(4))
    expected = OPTIMIZER_METHOD_DEFAULTS["fzoo"]["lora"]
    assert (trainer.args.learning_rate, trainer.args.zo_eps) == (expected.learning_rate, expected.zo_eps)
    with pytest.raises(ValueError, match="zo_optimizer='fzoo' has no measured default learning_rate"):
        ZOTrainer(model=tiny_causal_lm("opt"), args=args, train_dataset=lm_dataset(4))


def test_values_the_user_set_are_kept(tmp_path):
    trainer = ZOTrainer(model=_lora(), args=_config(tmp_path, learning_rate=3e-5), train_dataset=lm_dataset(4))
    assert trainer.args.learning_rate == 3e-5
    lora = METHOD_DEFAULTS["lora"]
    assert trainer.args.zo_eps == lora.zo_eps  # the unset one still follows the method
    trainer = ZOTrainer(model=_lora(), args=_config(tmp_path, zo_eps=1e-3), train_dataset=lm_dataset(4))
    assert (trainer.args.learning_rate, trainer.args.zo_eps) == (lora.learning_rate, 1e-3)


def test_a_model_from_model_init_gets_its_defaults_when_training_starts(tmp_path):
    trainer = ZOTrainer(model_init=lambda: _lora(), args=_config(tmp_path), train_dataset=lm_dataset(4))
    trainer.train()
    lora = METHOD_DEFAULTS["lora"]
    assert trainer.args.learning_rate == lora.learning_rate
    assert trainer.zo_optimizer.param_groups[0]["lr"] == lora.learning_rate


def test_a_peft_method_without_defaults_asks_for_both_values(tmp_path):
    model = get_peft_model(tiny_causal_lm("opt"), IA3Config(task_type=TaskType.CAUSAL_LM, target_modules=["fc1"]))
    with pytest.raises(ValueError, match="PEFT method IA3; set both .*learning_rate=1e-4, zo_eps=1e-2"):
        ZOTrainer(model=model, args=_config(tmp_path), train_dataset=lm_dataset(4))
    trainer = ZOTrainer(model=model, args=_config(tmp_path, learning_rate=1e-3, zo_eps=1e-2))
    assert trainer.args.learning_rate == 1e-3
    # Evaluation needs no learning rate: a trainer built without training data does not ask for one.
    assert ZOTrainer(model=model, args=_config(tmp_path), eval_dataset=lm_dataset(4)).args.learning_rate is None


@pytest.mark.parametrize("field, value", [("learning_rate", -1e-4), ("learning_rate", "fast"), ("zo_eps", 0.0)])
def test_bad_learning_rate_or_eps_fail_at_construction(tmp_path, field, value):
    with pytest.raises(ValueError, match=f"{field} must be"):
        _config(tmp_path, **{field: value})


CHOICE_LOGGED = """
import logging
import sys
sys.path.insert(0, {tests!r})
from hf_zo import ZOConfig, ZOTrainer
from tiny_models import lm_dataset, tiny_causal_lm
{setup}
args = ZOConfig(output_dir={out!r}, max_steps=1, report_to=[], use_cpu=True, log_level={level!r})
ZOTrainer(model=tiny_causal_lm("opt"), args=args, train_dataset=lm_dataset(4))
"""


LOG_LEVEL_CASES = [
    ("info", "", True),  # a plain script: hf_zo's INFO records follow `log_level` like transformers' do
    ("passive", "", False),
    ("passive", "logging.basicConfig(level=logging.INFO)", True),  # the application's configuration rules
    ("warning", "logging.basicConfig(level=logging.INFO)", False),
]


@pytest.fixture(scope="module")
def log_level_runs(tmp_path_factory) -> dict[tuple[str, str], subprocess.CompletedProcess]:
    """Each case's script in a fresh interpreter (logging is process-wide state), all started at once: their
    imports take most of their time and overlap on the cores."""
    processes = {}
    for level, setup, _ in LOG_LEVEL_CASES:
        out = tmp_path_factory.mktemp("log_level")
        script = CHOICE_LOGGED.format(tests=str(Path(__file__).parent), out=str(out), level=level, setup=setup)
        command = [sys.executable, "-c", script]
        processes[level, setup] = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    runs = {}
    try:
        for case, process in processes.items():
            stdout, stderr = process.communicate(timeout=300)
            runs[case] = subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)
    finally:  # a case that timed out leaves no process behind
        for process in processes.values():
            process.kill()
            process.wait()
    return runs


@pytest.mark.parametrize("level, setup, shown", LOG_LEVEL_CASES)
def test_the_chosen_values_are_logged_at_the_trainers_log_level(log_level_runs, level, setup, shown):
    result = log_level_runs[level, setup]
    assert result.returncode == 0, result.stderr[-3000:]
    message = "ZOConfig: learning_rate=1e-06, zo_eps=0.001 for method 'full'"
    assert (message in result.stderr) == shown, result.stderr[-3000:]


def test_no_pinned_memory_warning_without_an_accelerator(tmp_path, monkeypatch):
    """Pinned memory only helps copies to an accelerator: without one, torch would warn on every dataloader."""
    import warnings

    import torch

    monkeypatch.setattr(torch.accelerator, "is_available", lambda: False)  # as on this project's CPU machines
    args = ZOConfig(output_dir=str(tmp_path), max_steps=2, report_to=[], learning_rate=1e-3, zo_eps=1e-3)
    assert args.dataloader_pin_memory is False
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ZOTrainer(model=tiny_causal_lm("opt"), args=args, train_dataset=lm_dataset(8)).train()
    assert not [w for w in caught if "pin_memory" in str(w.message)]

    monkeypatch.setattr(torch.accelerator, "is_available", lambda: True)
    assert ZOConfig(output_dir=str(tmp_path)).dataloader_pin_memory is True
    assert ZOConfig(output_dir=str(tmp_path), dataloader_pin_memory=False).dataloader_pin_memory is False


def test_the_docs_hold_the_one_table_of_defaults():
    from hf_zo.training.defaults import defaults_table

    docs = (Path(__file__).resolve().parent.parent / "docs" / "hyperparameters.md").read_text()
    assert defaults_table() in docs, "docs/hyperparameters.md: paste hf_zo.training.defaults.defaults_table()"


def test_training_logs_the_optimizer_rate_and_eps_it_trains_with_once(tmp_path, caplog):
    trainer = ZOTrainer(model=_lora(), args=_config(tmp_path), train_dataset=lm_dataset(8))
    with caplog.at_level("WARNING", logger="hf_zo"):
        trainer.train()
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("ZO training with")]
    assert lines == [
        "ZO training with zo_optimizer=zo_sgd, learning_rate=0.0001, zo_eps=0.01, zo_num_perturbations=1, "
        "zo_noise=gaussian (defaults: docs/hyperparameters.md)"
    ]
