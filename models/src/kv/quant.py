"""Deprecated: `QuantizedKVCache` (a cache of quantized keys and values) is now a spelling of
`interp.models.kv.policy_cache.PolicyKVCache`: a precision ("int8", "fp8", "int4", "fp16", "bf16", "fp32") is the policy
`Dense(name)`, and `model.new_kv_cache(precision=...)` makes a `PolicyKVCache`. Kept for one release.
"""

from __future__ import annotations

import warnings

from .policy_cache import PolicyKVCache


class QuantizedKVCache(PolicyKVCache):
    """Deprecated spelling of `PolicyKVCache(..., policy=precision, default=default)`."""

    def __init__(self, *args, precision="int8", default: str = "fp32", **kwargs) -> None:
        warnings.warn("QuantizedKVCache is PolicyKVCache(policy=precision): use model.new_kv_cache(precision=...) "
                      "or policy=...", DeprecationWarning, stacklevel=2)
        super().__init__(*args, policy=precision, default=default, **kwargs)
