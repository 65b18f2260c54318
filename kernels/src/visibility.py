"""The visibility rule, once: which keys a query may attend to.

Every path that masks attention uses `visible`: the fused mask and the instrumented path
(`kernels.attention.AttentionMask`), the streaming statistics' torch tiles (`kernels/src/stats/tiles.py`), the
statistics read back from a KV cache (`models.stats`). The Triton kernel (`kernels/src/stats/triton_kernel.py`)
cannot call torch and spells the same rule in its own language; its tests hold it to this one.

Positions are absolute: with a KV cache the queries are the last n_q of the n_k keys, so query i
sits at p = n_k - n_q + i. With delta = p - j, key j is visible to the query at p iff

    causal:   delta >= 0                      (no future keys)
    window:   delta < window                  (Hugging Face's convention: the query and window - 1
                                               keys before it; without causality, every later key too)
    sinks:    or j < n_sink (still causal)    (StreamingLLM's attention sinks, Xiao et al. 2023,
                                               kept visible past the window)

and the key is not padding (the caller ANDs its key mask: padding is per batch row, this rule is not).
"""

from __future__ import annotations

import torch
from torch import Tensor


def visible(delta: Tensor, *, causal: bool = True, window: int | None = None,
            sink_key: Tensor | None = None) -> Tensor:
    """bool, delta's shape: True where the key is visible.

    delta     p - j for every (query, key) pair considered (any shape; integer or exactly
              integer-valued float).
    sink_key  bool, broadcastable to delta: True for the first n_sink keys (j < n_sink), which a
              sliding window keeps visible; None for none. Without a window it changes nothing."""
    ok = delta >= 0 if causal else None
    if window is not None:
        inside = delta < window
        if sink_key is not None:
            inside = inside | sink_key
        ok = inside if ok is None else ok & inside
    if ok is None:
        return torch.ones_like(delta, dtype=torch.bool)  # bidirectional, no window: every key
    return ok
