"""Deprecated alias of :mod:`hf_zo.models.norm_layers`, where the norm-layer finder moved; removed in the next release.

Import :func:`~hf_zo.models.norm_module_names` and :func:`~hf_zo.models.is_norm_module` from `hf_zo.models`.
"""

import warnings

from .models.norm_layers import is_norm_module, norm_module_names

warnings.warn(
    "hf_zo.norm_tuning moved to hf_zo.models (hf_zo.models.norm_layers) and will be removed in the next release: "
    "from hf_zo.models import norm_module_names, is_norm_module",
    FutureWarning,
    stacklevel=2,
)

__all__ = ["is_norm_module", "norm_module_names"]
