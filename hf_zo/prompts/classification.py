"""MeZO's prompt-based classification with a causal LM: the task becomes a prompt, the LM scores the label words.

Each example is formatted with a template (``"{sentence} It was"``) and the LM's next-token distribution after the
prompt is read at the label words (``" terrible"``, ``" great"``). Training uses the cross-entropy over the label
words' logits (MeZO's ``train_as_classification``, the default) or the full-vocabulary LM loss on the correct word
(``loss="lm"``); evaluation predicts the most likely word.

Every label word is one token, so one forward scores them all: the collator pads on the left, so the prompt's last
token sits at the last position of every row, and asks the model for that position's logits only
(``logits_to_keep=1``), which spares the LM head's full-vocabulary product at every other position. The pieces plug
into the stock `Trainer` hooks, so `ZOTrainer` (and `Trainer`) run them unchanged::

    task = PromptClassification(tokenizer, template="{sentence} It was", label_words=[" terrible", " great"])
    trainer = ZOTrainer(
        model=model,
        args=args,
        train_dataset=task.tokenize(data["train"]),
        eval_dataset=task.tokenize(data["validation"]),
        compute_metrics=build_compute_metrics(["accuracy"]),
        **task.trainer_kwargs(),
    )
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
import torch.nn.functional as F

from .tasks import template_fields

__all__ = ["PROMPT_LOSSES", "PromptClassification"]

PROMPT_LOSSES = ("classification", "lm")
"""`classification`: cross-entropy over the label words' logits; `lm`: cross-entropy over the whole vocabulary."""


class PromptClassification:
    """Tokenizer, collator, loss and scores of prompt-based classification with a causal LM.

    Args:
        tokenizer (`PreTrainedTokenizerBase`): the LM's tokenizer.
        template (`str`): the prompt, formatted with each example's fields (``"{sentence} It was"``).
        label_words (`Sequence[str]`): the word of each label, in label order; each must be a single token.
        loss (`str`, defaults to `"classification"`): one of :data:`PROMPT_LOSSES`.
        max_length (`int`, defaults to 256): longer prompts keep their last tokens (a passage loses its beginning,
            the question after it stays).
        label_column (`str`, defaults to `"label"`): the column of integer labels that :meth:`tokenize` reads.

    Raises:
        ValueError: a label word that is not one token, two labels with the same token, or an unknown `loss`.
    """

    def __init__(
        self,
        tokenizer,
        template: str,
        label_words: Sequence[str],
        loss: str = "classification",
        max_length: int = 256,
        label_column: str = "label",
    ):
        if loss not in PROMPT_LOSSES:
            raise ValueError(f"loss={loss!r} is not one of {PROMPT_LOSSES}.")
        if max_length < 2:
            raise ValueError(f"max_length must be at least 2, got {max_length}.")
        if len(label_words) < 2:
            raise ValueError(f"Prompt classification needs at least two label words, got {list(label_words)}.")
        word_ids = [tokenizer(word, add_special_tokens=False)["input_ids"] for word in label_words]
        for word, ids in zip(label_words, word_ids):
            if len(ids) != 1:
                pieces = tokenizer.convert_ids_to_tokens(ids)
                raise ValueError(
                    f"The label word {word!r} is {len(ids)} tokens for this tokenizer ({pieces}); prompt "
                    "classification scores one token per label. Choose words that are one token each (often with a "
                    "leading space, as ' great'), or train the task as a causal LM on the answer text."
                )
        tokens = [ids[0] for ids in word_ids]
        if len(set(tokens)) != len(tokens):
            raise ValueError(f"Two label words share a token: {dict(zip(label_words, tokens))}.")
        if tokenizer.pad_token_id is None:
            raise ValueError("The tokenizer has no pad token; set tokenizer.pad_token = tokenizer.eos_token first.")
        self.tokenizer = tokenizer
        self.template = template
        self.fields = template_fields(template)
        self.label_words = tuple(label_words)
        self.label_word_ids = torch.tensor(tokens)
        self.loss = loss
        self.max_length = max_length
        self.label_column = label_column

    # ------------------------------------------------------------------ data

    def encode(self, example: Mapping) -> list[int]:
        """The token ids of `example`'s prompt, its last `max_length` tokens."""
        missing = [name for name in self.fields if name not in example]
        if missing:
            raise ValueError(
                f"The template {self.template!r} formats {missing}, which the example (columns {sorted(example)}) "
                "lacks: rename the columns, or write a template over the columns you have."
            )
        ids = self.tokenizer(self.template.format(**example), add_special_tokens=True)["input_ids"]
        return ids[-self.max_length :]

    def tokenize(self, dataset):
        """Map a `datasets.Dataset` (or `DatasetDict`) of examples to rows of prompt ``input_ids`` and ``labels``.

        Unlabelled examples (a test split with label -1, or no label column) keep ``labels = -1``, which only
        prediction may use.
        """
        columns = dataset.column_names
        columns = next(iter(columns.values())) if isinstance(columns, dict) else columns

        def row(example):
            return {"input_ids": self.encode(example), "labels": int(example.get(self.label_column, -1))}

        return dataset.map(row, remove_columns=columns)

    def __call__(self, rows: list[Mapping]) -> dict[str, torch.Tensor | int]:
        """Collate prompt rows: left-padded ids, their attention mask and positions, the labels, and
        ``logits_to_keep=1`` so the model computes the logits of the last position only."""
        ids = [list(r["input_ids"]) for r in rows]
        length = max(len(s) for s in ids)
        pad = self.tokenizer.pad_token_id
        input_ids = torch.tensor([[pad] * (length - len(s)) + s for s in ids])
        attention_mask = torch.tensor([[0] * (length - len(s)) + [1] * len(s) for s in ids])
        return {
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            # Left padding shifts the tokens; their positions count from each prompt's first token, as unpadded.
            "position_ids": (attention_mask.cumsum(-1) - 1).clamp(min=0),
            "labels": torch.tensor([int(r["labels"]) for r in rows]),
            "logits_to_keep": 1,
        }

    # ------------------------------------------------------------------ loss and scores

    def answer_logits(self, logits: torch.Tensor | tuple) -> torch.Tensor:
        """The next-token logits after each prompt, `(batch, vocab)`, from the model's (last-position) logits."""
        if isinstance(logits, (tuple, list)):
            logits = logits[0]
        return logits[:, -1].float()

    def compute_loss(self, outputs, labels: torch.Tensor, num_items_in_batch=None) -> torch.Tensor:
        """The loss of a batch (`Trainer`'s `compute_loss_func`): mean cross-entropy over the label words, or over
        the whole vocabulary with ``loss="lm"``."""
        logits = self.answer_logits(outputs["logits"] if isinstance(outputs, Mapping) else outputs[0])
        word_ids = self.label_word_ids.to(logits.device)
        labels = labels.to(logits.device)
        if self.loss == "classification":
            return F.cross_entropy(logits[:, word_ids], labels)
        return F.cross_entropy(logits, word_ids[labels])

    def scores(self, logits: torch.Tensor | tuple, labels: torch.Tensor | None = None) -> torch.Tensor:
        """Each label word's log-probability after the prompt, `(batch, num_labels)`: `Trainer`'s
        `preprocess_logits_for_metrics`, so predictions are these scores and accuracy is their argmax."""
        logits = self.answer_logits(logits)
        return torch.log_softmax(logits, dim=-1)[:, self.label_word_ids.to(logits.device)]

    def trainer_kwargs(self) -> dict:
        """The `Trainer` arguments that run this task: the collator, the loss and the scores."""
        return {
            "data_collator": self,
            "compute_loss_func": self.compute_loss,
            "preprocess_logits_for_metrics": self.scores,
        }

    @torch.no_grad()
    def predict_scores(self, model, dataset, batch_size: int = 32) -> torch.Tensor:
        """The label words' scores, `(len(dataset), num_labels)`, of `model` on tokenized rows, in order (a plain
        loop for scripts and callbacks; `Trainer.predict` gives the same). The batches run longest first, so that
        each pads little."""
        device = next(model.parameters()).device
        rows = [dataset[i] for i in range(len(dataset))]
        order = sorted(range(len(rows)), key=lambda i: len(rows[i]["input_ids"]), reverse=True)
        scores = torch.empty(len(rows), len(self.label_word_ids))
        was_training = model.training
        model.eval()
        for start in range(0, len(rows), batch_size):
            chunk = order[start : start + batch_size]
            batch = self([rows[i] for i in chunk])
            batch.pop("labels")
            batch = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
            scores[chunk] = self.scores(model(**batch).logits).cpu()
        model.train(was_training)
        return scores
