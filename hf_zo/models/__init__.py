"""Model code that is not zeroth-order: pooled sentence-encoder classifiers, the norm-layer finder, and the embedded
causal LM."""

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
from .smollm2 import EMBEDDED_LLM_ID, EMBEDDED_LLM_INSTALL, embedded_llm_path

__all__ = [
    "EMBEDDED_LLM_ID",
    "EMBEDDED_LLM_INSTALL",
    "embedded_llm_path",
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
