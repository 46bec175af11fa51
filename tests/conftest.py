"""Shared pytest fixtures: quiet, offline, deterministic."""

import logging as std_logging
import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(autouse=True)
def _quiet_transformers():
    from transformers.utils import logging

    logging.set_verbosity_error()
    yield
    # A ZOTrainer gives the "hf_zo" logger its process log level (here: error); the next test starts unset again.
    std_logging.getLogger("hf_zo").setLevel(std_logging.NOTSET)
