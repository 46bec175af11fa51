"""The offline demo (`python -m hf_zo.demo`): see `__main__.py`."""
