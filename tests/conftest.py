"""Shared pytest fixtures: quiet, offline, deterministic."""

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
