"""The offline demo (`python -m hf_zo.demo`, `make demo`): see `__main__.py`."""

from pathlib import Path

DATA_DIR = Path(__file__).parent / "data"
"""The demo's sentiment sentences: 320 for training, 160 held out."""
