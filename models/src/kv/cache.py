"""`KVCache` (generation and analysis): per layer, the keys (after RoPE) and values of every token seen
so far, for the kv-heads only (GQA/MQA), preallocated to `max_len`; optionally the queries too, so
that analyses can compute any head statistic or pattern slice after a fast fused forward or a
generation without re-running the model. Per-head policies and precisions:
`interp.models.kv.policy_cache.PolicyKVCache`.
"""

from __future__ import annotations

import torch
from torch import Tensor

from interp.kernels.stats import Scoring


class KVCache:
    """Preallocated keys and values of every layer, for the kv-heads only.

    keys, values : [n_layers, batch, kv_heads, max_len, d_head]   (keys after RoPE)
    queries      : [n_layers, batch, heads, max_len, d_head]      (only with capture_queries=True)
    key_valid    : [batch, max_len]  True where a real (non-padding) token was written
    length       : tokens written so far (shared by the batch; padding keeps rows aligned)
    n_sink       : keys j < n_sink stay visible past a sliding window in forwards through this
                   cache (StreamingLLM's attention sinks, Xiao et al. 2023); 0 for a plain window

    Memory: 2 * n_layers * kv_heads * d_head * max_len * batch * dtype_bytes (`allocated_nbytes`); what the
    tokens so far hold: `held_nbytes` (= `nbytes`), per token `bytes_per_token()`.
    """

    def __init__(
        self,
        n_layers: int,
        batch_size: int,
        max_len: int,
        n_kv_heads: int,
        d_head: int,
        *,
        n_heads: int | None = None,
        capture_queries: bool = False,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        n_sink: int = 0,
    ) -> None:
        if isinstance(n_sink, bool) or not isinstance(n_sink, int) or n_sink < 0:
            raise ValueError(f"n_sink must be an int >= 0 (keys kept visible past a sliding window), got {n_sink!r}")
        self.n_sink = n_sink
        shape = (n_layers, batch_size, n_kv_heads, max_len, d_head)
        self.dtype = dtype
        self._allocate(shape, dtype, device)
        self.queries = (
            torch.zeros((n_layers, batch_size, n_heads or n_kv_heads, max_len, d_head), dtype=dtype, device=device)
            if capture_queries
            else None
        )
        self.key_valid = torch.ones(batch_size, max_len, dtype=torch.bool, device=device)
        self.tokens = torch.zeros(batch_size, max_len, dtype=torch.long, device=device)
        self.n_seen = torch.zeros(batch_size, dtype=torch.long, device=device)  # real tokens per row
        self.length = 0
        self.batch_size, self.max_len = batch_size, max_len

    def _allocate(self, shape: tuple, dtype: torch.dtype, device) -> None:
        """Key and value storage; `PolicyKVCache` stores each head's policy instead."""
        self.keys = torch.zeros(shape, dtype=dtype, device=device)
        self.values = torch.zeros(shape, dtype=dtype, device=device)

    @property
    def held_nbytes(self) -> int:
        """Bytes of keys and values held for the tokens cached so far (queries, if captured: `query_nbytes`)."""
        n_layers, b, kv, _, d = self.keys.shape
        return 2 * n_layers * b * kv * self.length * d * self.keys.element_size()

    @property
    def allocated_nbytes(self) -> int:
        """Bytes the key and value storage occupies (preallocated for `max_len`)."""
        return self.keys.numel() * self.keys.element_size() * 2

    @property
    def nbytes(self) -> int:
        """`held_nbytes`: what is held for the tokens so far (the same on every cache class)."""
        return self.held_nbytes

    def bytes_per_token(self) -> float:
        """Held bytes per cached token of one sequence (all layers, keys and values)."""
        return self.held_nbytes / (max(self.length, 1) * self.batch_size)

    @property
    def query_nbytes(self) -> int:
        return 0 if self.queries is None else self.queries.numel() * self.queries.element_size()

    def __repr__(self) -> str:
        n_layers, b, kv, max_len, dh = self.keys.shape
        q = f", queries {self.query_nbytes / 2**20:.2f} MiB" if self.queries is not None else ""
        return (
            f"KVCache(layers={n_layers}, batch={b}, kv_heads={kv}, d_head={dh}, length={self.length}/{max_len}, "
            f"{self.keys.dtype}, {self.allocated_nbytes / 2**20:.2f} MiB{q})"
        )

    def reserve(self, n_new: int, batch: int) -> None:
        if batch != self.batch_size:
            raise ValueError(f"this KV cache was made for batch {self.batch_size}, got a batch of {batch}")
        if self.length + n_new > self.max_len:
            raise ValueError(
                f"the KV cache is full: it holds {self.max_len} tokens, has {self.length} and got {n_new} more; "
                f"make a larger one with model.new_kv_cache(batch_size, max_len={self.length + n_new})"
            )

    def append(self, layer: int, k: Tensor, v: Tensor, q: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """Write this call's k, v ([batch, kv_heads, n_new, d_head]) at `length`; return all keys/values so far."""
        start, end = self.length, self.length + k.shape[2]
        self.keys[layer, :, :, start:end] = k
        self.values[layer, :, :, start:end] = v
        if self.queries is not None and q is not None:
            self.queries[layer, :, :, start:end] = q
        return self.keys[layer, :, :, :end], self.values[layer, :, :, :end]

    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor, mask, run, *, scoring: Scoring,
               own_window: int | None = None, hooked: bool = False) -> Tensor:
        """One attention call through this cache: write this call's keys and values, then
        `run(q, keys, values, mask, scoring)` (the layer's backend) over everything cached, scored by the
        layer's `scoring` (`attn.scoring`). `own_window` (the layer's own window, however an analysis narrows
        `scoring.window`) and `hooked` (whether hooks read the pattern) serve caches that hold per-head
        policies (`interp.models.kv.policy_cache.PolicyKVCache`); this cache holds every token of every head
        and needs neither."""
        k, v = self.append(layer, k, v, q)
        return run(q, k, v, mask, scoring)

    def commit(self, tokens: Tensor | None, valid: Tensor) -> None:
        """Advance `length` past the tokens of one forward pass (called by the model at its end)."""
        n = valid.shape[1]
        self.key_valid[:, self.length : self.length + n] = valid
        if tokens is not None:
            self.tokens[:, self.length : self.length + n] = tokens
        self.n_seen += valid.long().sum(1)
        self.length += n

    # ---- reading back -------------------------------------------------------------------------
    def k(self, layer: int) -> Tensor:
        """[batch, kv_heads, length, d_head]"""
        return self.keys[layer, :, :, : self.length]

    def v(self, layer: int) -> Tensor:
        return self.values[layer, :, :, : self.length]

    def q(self, layer: int) -> Tensor:
        """[batch, heads, length, d_head]; needs capture_queries=True."""
        if self.queries is None:
            raise ValueError("this KV cache did not keep queries; make it with model.new_kv_cache(..., capture_queries=True)")
        return self.queries[layer, :, :, : self.length]

    def valid(self) -> Tensor:
        """[batch, length] bool: real tokens."""
        return self.key_valid[:, : self.length]

    def reset(self) -> None:
        self.length = 0
        self.n_seen.zero_()
        self.key_valid.fill_(True)
