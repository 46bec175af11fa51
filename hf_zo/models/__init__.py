"""Model code that is not zeroth-order: pooled sentence-encoder classifiers, the norm-layer finder, the embedded
causal LM, and quantized bases through transformers' own quantization config (bitsandbytes)."""

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
from .quantized import (
    QUANTIZATION_INSTALL,
    SUPPORTED_QUANT_METHODS,
    base_quantization_config,
    from_pretrained_quantized,
    is_quantized,
    quant_method,
    quantization_config_from_record,
    quantization_record,
    release_loading_memory,
)
from .smollm2 import EMBEDDED_LLM_ID, EMBEDDED_LLM_INSTALL, embedded_llm_path

__all__ = [
    "EMBEDDED_LLM_ID",
    "EMBEDDED_LLM_INSTALL",
    "embedded_llm_path",
    "POOLING_MODES",
    "QUANTIZATION_INSTALL",
    "SUPPORTED_QUANT_METHODS",
    "PooledEncoderConfig",
    "PooledEncoderForSequenceClassification",
    "base_quantization_config",
    "from_pretrained_quantized",
    "is_norm_module",
    "is_quantized",
    "load_sequence_classifier",
    "norm_module_names",
    "pool",
    "pooling_mismatch",
    "quant_method",
    "quantization_config_from_record",
    "quantization_record",
    "read_pooling_config",
    "release_loading_memory",
]
