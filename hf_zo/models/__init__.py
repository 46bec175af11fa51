"""Model code that is not zeroth-order: pooled sentence-encoder classifiers and the norm-layer finder."""

from .norm_layers import is_norm_module, norm_module_names
from .pooled_classifier import (
    POOLING_MODES,
    PooledEncoderConfig,
    PooledEncoderForSequenceClassification,
    load_sequence_classifier,
    pool,
    pooling_mismatch,
    read_pooling_config,
)

__all__ = [
    "POOLING_MODES",
    "PooledEncoderConfig",
    "PooledEncoderForSequenceClassification",
    "is_norm_module",
    "load_sequence_classifier",
    "norm_module_names",
    "pool",
    "pooling_mismatch",
    "read_pooling_config",
]
