"""Ready prompt-classification tasks: MeZO's templates and label words for GLUE/SuperGLUE tasks."""

from __future__ import annotations

import string
from dataclasses import dataclass

__all__ = ["PROMPT_TASKS", "PromptTask", "template_fields"]


@dataclass(frozen=True)
class PromptTask:
    """A classification task asked as a prompt: where it lives on the Hub, its fields, and its MeZO prompt.

    Attributes:
        hub (`tuple[str, str]`): `(dataset, config)` for `datasets.load_dataset`.
        fields (`tuple[str, ...]`): the input text fields (one sentence, or a pair).
        label_words (`tuple[str, ...]`): the word of each label, in label order; the LM scores them after the prompt.
        template (`str`): the prompt, formatted with the fields; the label word follows it.
        metrics (`tuple[str, ...]`): metrics reported at evaluation.
    """

    hub: tuple[str, str]
    fields: tuple[str, ...]
    label_words: tuple[str, ...]
    template: str
    metrics: tuple[str, ...] = ("accuracy",)


PROMPT_TASKS: dict[str, PromptTask] = {
    "sst2": PromptTask(("nyu-mll/glue", "sst2"), ("sentence",), (" terrible", " great"), "{sentence} It was"),
    "rte": PromptTask(
        ("aps/super_glue", "rte"),
        ("premise", "hypothesis"),
        (" Yes", " No"),
        '{premise}\nDoes this mean that "{hypothesis}" is true? Yes or No?\n',
    ),
    "boolq": PromptTask(
        ("aps/super_glue", "boolq"), ("passage", "question"), (" No", " Yes"), "{passage} {question}?"
    ),
    "cb": PromptTask(
        ("aps/super_glue", "cb"),
        ("premise", "hypothesis"),
        (" Yes", " No", " Maybe"),
        '{premise}\nQuestion: "{hypothesis}" True, False or Neither?\n',
        ("accuracy", "f1"),
    ),
}
"""MeZO's prompts (Malladi et al., 2023, Table 13) by task name."""


def template_fields(template: str) -> list[str]:
    """The field names a template formats, in order and without repeats (``"{a} and {b}"`` -> ``["a", "b"]``)."""
    return list(dict.fromkeys(name for _, name, _, _ in string.Formatter().parse(template) if name))
