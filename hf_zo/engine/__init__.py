"""Execution engines: how the two forward passes of a ZO estimate run.

- `sequential` (the default, no object needed): the whole model at ``theta + eps z``, then at ``theta - eps z``
  (`hf_zo.estimator.SPSAEstimator`); works for any model.
- `dual` (`DualEngine`): both passes in one sweep over the model's repeated blocks (ZO2's schedule), with optional
  offloaded blocks (`hf_zo.offload`).

With `sequential`, `FrozenPrefix` runs the frozen blocks before the first perturbed one once per micro-batch.
"""

from .blocks import BlocksNotFoundError, find_blocks, offload_model
from .dual import DualEngine
from .frozen_prefix import FrozenPrefix, frozen_prefix_blocks

ZO_ENGINES = ("sequential", "dual")
"""The engines selectable by name (`ZOConfig.zo_engine`)."""

__all__ = [
    "BlocksNotFoundError",
    "DualEngine",
    "FrozenPrefix",
    "ZO_ENGINES",
    "find_blocks",
    "frozen_prefix_blocks",
    "offload_model",
]
