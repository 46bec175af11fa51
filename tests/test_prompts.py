"""hf_zo.prompts: MeZO's prompt-based classification (label-word loss and scores from one left-padded forward)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import PreTrainedTokenizerFast

from hf_zo import ZOTrainer
from hf_zo.prompts import PROMPT_TASKS, PromptClassification

from tiny_models import VOCAB, tiny_causal_lm, zo_args

WORDS = "good great bad terrible movie film plot it was a the not".split()
TEMPLATE = "{sentence} it was"


def tokenizer() -> PreTrainedTokenizerFast:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {token: i for i, token in enumerate(["<unk>", "<pad>", "</s>", *WORDS])}
    assert len(vocab) <= VOCAB
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", pad_token="<pad>", eos_token="</s>")


def examples():
    from datasets import Dataset

    sentences = ["a good movie", "not a good plot at all , the film", "bad", "the plot was terrible", "a great film"]
    return Dataset.from_dict({"sentence": sentences, "label": [1, 0, 0, 0, 1]})


def _forward(family: str, **options):
    """A tiny LM of `family`, a task, its rows, and the model's output on all rows as one collated batch."""
    model = tiny_causal_lm(family).eval()
    task = PromptClassification(tokenizer(), TEMPLATE, [" bad", " good"], **options)
    rows = task.tokenize(examples())
    batch = task([rows[i] for i in range(len(rows))])
    labels = batch.pop("labels")
    with torch.no_grad():
        output = model(**batch)
    return model, task, rows, output, labels


@pytest.mark.parametrize("family", ["opt", "llama", "gpt2", "qwen2"])
def test_left_padded_batch_scores_each_prompt_as_alone(family):
    """The collator's left padding and positions leave every prompt's next-token distribution as unpadded."""
    model, task, rows, output, labels = _forward(family)
    with torch.no_grad():
        assert output.logits.shape[1] == 1  # logits_to_keep=1: the LM head ran on one position
        scores = task.scores(output.logits)
        for i, row in enumerate(rows):
            alone = model(input_ids=torch.tensor([row["input_ids"]])).logits[0, -1]
            expected = torch.log_softmax(alone, -1)[task.label_word_ids]
            torch.testing.assert_close(scores[i], expected, atol=1e-5, rtol=1e-5)
    assert labels.tolist() == [1, 0, 0, 0, 1]


@pytest.mark.parametrize("family", ["opt", "llama"])
def test_classification_loss_is_the_two_way_cross_entropy_over_the_label_words(family):
    model, task, rows, output, labels = _forward(family)
    with torch.no_grad():
        loss = task.compute_loss(output, labels)
        by_hand = []
        for row in rows:
            logits = model(input_ids=torch.tensor([row["input_ids"]])).logits[0, -1]
            two_way = torch.stack([logits[task.label_word_ids[0]], logits[task.label_word_ids[1]]])
            by_hand.append(-torch.log_softmax(two_way, -1)[row["labels"]])
    torch.testing.assert_close(loss, torch.stack(by_hand).mean(), atol=1e-5, rtol=1e-5)


def test_lm_loss_is_the_full_vocabulary_cross_entropy_of_the_correct_word():
    _, task, _, output, labels = _forward("llama", loss="lm")
    expected = F.cross_entropy(output.logits[:, -1], task.label_word_ids[labels])
    torch.testing.assert_close(task.compute_loss(output, labels), expected)


def test_multi_token_label_word_is_refused_naming_its_tokens():
    with pytest.raises(ValueError, match=r"'not good' is 2 tokens .*one token each"):
        PromptClassification(tokenizer(), TEMPLATE, [" bad", "not good"])


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"loss": "hinge"}, "loss='hinge' is not one of"),
        ({"label_words": [" good"]}, "at least two label words"),
        ({"label_words": [" good", "good"]}, "share a token"),
    ],
)
def test_bad_options_are_refused(kwargs, message):
    options = {"template": TEMPLATE, "label_words": [" bad", " good"], **kwargs}
    with pytest.raises(ValueError, match=message):
        PromptClassification(tokenizer(), **options)


def test_template_field_missing_from_the_data_is_named():
    task = PromptClassification(tokenizer(), "{premise} {hypothesis}", [" bad", " good"])
    with pytest.raises(ValueError, match=r"formats \['premise', 'hypothesis'\]"):
        task.tokenize(examples())


def test_long_prompts_keep_their_last_tokens():
    task = PromptClassification(tokenizer(), TEMPLATE, [" bad", " good"], max_length=4)
    row = task.tokenize(examples())[1]
    assert task.tokenizer.convert_ids_to_tokens(row["input_ids"]) == ["the", "film", "it", "was"]


def test_zo_trainer_trains_and_evaluates_a_prompt_task_with_the_stock_hooks(tmp_path):
    """`trainer_kwargs()` plugs the task into `ZOTrainer` (no subclass): the ZO steps move the loss and evaluation
    reports accuracy over the label words."""
    task = PromptClassification(tokenizer(), TEMPLATE, [" bad", " good"])
    rows = task.tokenize(examples())
    args = zo_args(tmp_path, max_steps=3, per_device_train_batch_size=5, learning_rate=1e-2, label_names=["labels"])
    trainer = ZOTrainer(
        model=tiny_causal_lm("llama"), args=args, train_dataset=rows, eval_dataset=rows, **task.trainer_kwargs()
    )
    before = trainer.evaluate()["eval_loss"]
    trainer.train()
    metrics = trainer.evaluate()
    assert metrics["eval_loss"] != before
    predictions = trainer.predict(rows).predictions
    assert predictions.shape == (5, 2)


def test_scores_come_back_in_the_data_sets_order_though_batches_run_longest_first(tmp_path):
    """`predict_scores` and `Trainer.predict` (whose evaluation batches run longest first) give row i the scores of
    prompt i scored alone, and `predict`'s labels stay beside their rows."""
    model = tiny_causal_lm("llama").eval()
    task = PromptClassification(tokenizer(), TEMPLATE, [" bad", " good"])
    rows = task.tokenize(examples())
    assert [len(r) for r in rows["input_ids"]] != sorted((len(r) for r in rows["input_ids"]), reverse=True)
    with torch.no_grad():
        alone = torch.stack([task.scores(model(input_ids=torch.tensor([r["input_ids"]])).logits) for r in rows])[:, 0]

    torch.testing.assert_close(task.predict_scores(model, rows, batch_size=2), alone, atol=1e-5, rtol=1e-5)
    args = zo_args(tmp_path, per_device_eval_batch_size=2, label_names=["labels"])
    output = ZOTrainer(model=model, args=args, **task.trainer_kwargs()).predict(rows)
    torch.testing.assert_close(torch.as_tensor(output.predictions), alone, atol=1e-5, rtol=1e-5)
    assert output.label_ids.tolist() == [1, 0, 0, 0, 1]


def test_ready_tasks_have_one_label_word_per_label_and_their_fields_in_the_template():
    for name, task in PROMPT_TASKS.items():
        assert len(task.label_words) >= 2, name
        for field in task.fields:
            assert "{" + field + "}" in task.template, name
