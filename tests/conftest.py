"""Shared pytest fixtures: quiet, offline, deterministic."""

import gc
import logging as std_logging
import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def pytest_collection_finish(session):
    """Exempt what the test modules imported (torch, transformers, peft, ...) from garbage collection.

    `Trainer.train()` starts with Accelerate's `free_memory()`, a full `gc.collect()` that walks every live Python
    object. After the imports those are some 400k objects that live until exit anyway; freezing them keeps each
    of the suite's hundreds of `train()` calls from walking them again. Objects the tests create are collected as
    usual.
    """
    gc.collect()
    gc.freeze()


@pytest.fixture(autouse=True)
def _quiet_transformers():
    from transformers.utils import logging

    logging.set_verbosity_error()
    yield
    # A ZOTrainer gives the "hf_zo" logger its process log level (here: error); the next test starts unset again.
    std_logging.getLogger("hf_zo").setLevel(std_logging.NOTSET)
