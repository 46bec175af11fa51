"""Execution engines: how the two forward passes of a ZO estimate run.

- `sequential` (the default, no object needed): the whole model at ``theta + eps z``, then at ``theta - eps z``
  (`hf_zo.estimator.SPSAEstimator`); works for any model.
- `dual` (`DualEngine`): both passes in one sweep over the model's repeated blocks (ZO2's schedule), with optional
  offloaded blocks (`hf_zo.offload`).
"""

from .blocks import BlocksNotFoundError, find_blocks, offload_model
from .dual import DualEngine

ZO_ENGINES = ("sequential", "dual")
"""The engines selectable by name (`ZOConfig.zo_engine`)."""

__all__ = ["BlocksNotFoundError", "DualEngine", "ZO_ENGINES", "find_blocks", "offload_model"]
