"""MeZO's prompt-based classification: templates, label words, the collator, the label-word loss and scores."""

from .classification import PROMPT_LOSSES, PromptClassification
from .tasks import PROMPT_TASKS, PromptTask, template_fields

__all__ = ["PROMPT_LOSSES", "PROMPT_TASKS", "PromptClassification", "PromptTask", "template_fields"]
