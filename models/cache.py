"""Caches: `ActivationCache` (what `run_with_cache` returns) and `KVCache` (generation and analysis).

`KVCache` holds, per layer, the keys (after RoPE) and values of every token seen so far, for the
kv-heads only (GQA/MQA), preallocated to `max_len`; optionally the queries too, so that analyses
can compute any head statistic or pattern slice after a fast fused forward or a generation
without re-running the model.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterator

import torch
from torch import Tensor

from .hooks import act_name

if TYPE_CHECKING:
    from torch import nn


class ActivationCache:
    """Activations by hook name, indexable the TransformerLens way.

    cache["blocks.0.attn.hook_pattern"], cache["pattern", 0], cache["resid_pre", -1],
    cache["normalized", 2, "ln1"], cache["embed"]. `.keys()`, `.items()`, `.to(device)`,
    `.remove_batch_dim()`, `stack_activation`, `stack_head_results`, `accumulated_resid`.
    """

    def __init__(self, cache_dict: dict[str, Tensor], model: "nn.Module | None" = None, has_batch_dim: bool = True) -> None:
        self.cache_dict = cache_dict
        self.model = model
        self.has_batch_dim = has_batch_dim

    # ---- mapping ------------------------------------------------------------------------------
    def _name(self, key) -> str:
        if isinstance(key, str):
            return key if key in self.cache_dict else act_name(key)
        if isinstance(key, tuple):
            name, layer, *sub = key
            if layer is not None and layer < 0:
                layer += self.model.cfg.n_layers if self.model is not None else 0
            return act_name(name, layer, sub[0] if sub else None)
        raise KeyError(f"cache keys are hook names or (name, layer[, sub]) tuples, got {key!r}")

    def __getitem__(self, key) -> Tensor:
        name = self._name(key)
        try:
            return self.cache_dict[name]
        except KeyError:
            raise KeyError(
                f"{name!r} is not in this cache ({len(self.cache_dict)} activations). Cache it with "
                f"run_with_cache(..., names_filter=...) naming it, or check the name against model.hook_dict"
            ) from None

    def __contains__(self, key) -> bool:
        try:
            return self._name(key) in self.cache_dict
        except KeyError:
            return False

    def __len__(self) -> int:
        return len(self.cache_dict)

    def __iter__(self) -> Iterator[str]:
        return iter(self.cache_dict)

    def keys(self):
        return self.cache_dict.keys()

    def values(self):
        return self.cache_dict.values()

    def items(self):
        return self.cache_dict.items()

    def __repr__(self) -> str:
        return f"ActivationCache({len(self)} activations: {list(self.cache_dict)[:4]}{' ...' if len(self) > 4 else ''})"

    # ---- moving -------------------------------------------------------------------------------
    def to(self, device, move_model: bool = False) -> "ActivationCache":
        if move_model and self.model is not None:
            self.model.to(device)
        return ActivationCache({k: v.to(device) for k, v in self.items()}, self.model, self.has_batch_dim)

    def cpu(self) -> "ActivationCache":
        return self.to("cpu")

    def remove_batch_dim(self) -> "ActivationCache":
        if not self.has_batch_dim:
            return self
        for k, v in self.items():
            if v.shape[0] != 1:
                raise ValueError(f"remove_batch_dim needs batch size 1; {k} has batch {v.shape[0]}")
        return ActivationCache({k: v[0] for k, v in self.items()}, self.model, has_batch_dim=False)

    # ---- stacking -----------------------------------------------------------------------------
    def stack_activation(self, name: str, layer: int = -1, sub: str | None = None) -> Tensor:
        """[n_layers (up to `layer`), ...]: one hook's activation stacked over layers."""
        n = self.model.cfg.n_layers if layer == -1 else layer
        return torch.stack([self[act_name(name, i, sub)] for i in range(n)])

    def stack_head_results(
        self, layer: int = -1, return_labels: bool = False, incl_remainder: bool = False, pos_slice=None, apply_ln: bool = False
    ):
        """[layers * heads, batch, pos, d_model]: each head's contribution to the residual stream.

        Uses hook_result when cached, otherwise computes z_h W_O[h] from hook_z."""
        model = self.model
        n_layers = model.cfg.n_layers if layer == -1 else layer
        parts, labels = [], []
        for l in range(n_layers):
            name = act_name("result", l)
            if name in self.cache_dict:
                res = self.cache_dict[name]
            else:
                z = self[act_name("z", l)]
                res = torch.einsum("...hd,hdm->...hm", z, model.blocks[l].attn.W_O.to(z.dtype))
            res = res if pos_slice is None else res[..., pos_slice, :, :]
            parts.append(res.movedim(-2, 0))
            labels += [f"L{l}H{h}" for h in range(res.shape[-2])]
        stack = torch.cat(parts, dim=0)
        if incl_remainder:
            resid = self[act_name("resid_post", n_layers - 1)] if n_layers > 0 else self["hook_embed"]
            resid = resid if pos_slice is None else resid[..., pos_slice, :]
            stack = torch.cat([stack, (resid - stack.sum(0))[None]], dim=0)
            labels.append("remainder")
        if apply_ln:
            stack = self.apply_ln_to_stack(stack, layer=-1, pos_slice=pos_slice)
        return (stack, labels) if return_labels else stack

    def accumulated_resid(self, layer: int | None = None, incl_mid: bool = False, apply_ln: bool = False, pos_slice=None, return_labels: bool = False):
        """[components, batch, pos, d_model]: the residual stream before each layer (and after the last)."""
        n = self.model.cfg.n_layers if layer is None or layer == -1 else layer
        parts, labels = [], []
        for l in range(n + 1):
            if l == self.model.cfg.n_layers:
                parts.append(self[act_name("resid_post", l - 1)])
                labels.append("final_post")
                break
            parts.append(self[act_name("resid_pre", l)])
            labels.append(f"{l}_pre")
            if incl_mid and l < n and act_name("resid_mid", l) in self.cache_dict:
                parts.append(self[act_name("resid_mid", l)])
                labels.append(f"{l}_mid")
        stack = torch.stack(parts if pos_slice is None else [p[..., pos_slice, :] for p in parts])
        if apply_ln:
            stack = self.apply_ln_to_stack(stack, layer=layer, pos_slice=pos_slice)
        return (stack, labels) if return_labels else stack

    def apply_ln_to_stack(self, stack: Tensor, layer: int | None = None, pos_slice=None, **_) -> Tensor:
        """Divide each component by the cached final-norm scale (the linear part of ln_final)."""
        scale = self["ln_final.hook_scale"]
        scale = scale if pos_slice is None else scale[..., pos_slice, :]
        return (stack - stack.mean(-1, keepdim=True) if self.model.cfg.normalization == "layernorm" else stack) / scale


class KVCache:
    """Preallocated keys and values of every layer, for the kv-heads only.

    keys, values : [n_layers, batch, kv_heads, max_len, d_head]   (keys after RoPE)
    queries      : [n_layers, batch, heads, max_len, d_head]      (only with capture_queries=True)
    key_valid    : [batch, max_len]  True where a real (non-padding) token was written
    length       : tokens written so far (shared by the batch; padding keeps rows aligned)
    n_sink       : keys j < n_sink stay visible past a sliding window in forwards through this
                   cache (StreamingLLM's attention sinks, Xiao et al. 2023); 0 for a plain window

    Memory: 2 * n_layers * kv_heads * d_head * max_len * batch * dtype_bytes (`nbytes`).
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
        """Key and value storage; `QuantizedKVCache` stores codes and scales instead."""
        self.keys = torch.zeros(shape, dtype=dtype, device=device)
        self.values = torch.zeros(shape, dtype=dtype, device=device)

    @property
    def nbytes(self) -> int:
        """Bytes held by keys and values (queries, if captured, are `query_nbytes`)."""
        return self.keys.numel() * self.keys.element_size() * 2

    @property
    def query_nbytes(self) -> int:
        return 0 if self.queries is None else self.queries.numel() * self.queries.element_size()

    def __repr__(self) -> str:
        n_layers, b, kv, max_len, dh = self.keys.shape
        q = f", queries {self.query_nbytes / 2**20:.2f} MiB" if self.queries is not None else ""
        return (
            f"KVCache(layers={n_layers}, batch={b}, kv_heads={kv}, d_head={dh}, length={self.length}/{max_len}, "
            f"{self.keys.dtype}, {self.nbytes / 2**20:.2f} MiB{q})"
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


# ---- TransformerLens interop (its package is imported only when called) ----------------------
def _tl():
    try:
        import transformer_lens
    except ImportError as e:  # pragma: no cover - exercised only without the extra installed
        raise ImportError(
            "this needs TransformerLens: pip install 'interp[tl]' (or transformer-lens>=3)"
        ) from e
    return transformer_lens


def to_tl_cache(cache, model: "nn.Module | None" = None):
    """Our `ActivationCache` (or a plain {hook name: tensor} dict) as TransformerLens's `ActivationCache`.

    The tensors are shared, not copied; the dict is (TransformerLens's `remove_batch_dim` edits its
    dict in place, which must not reach ours). `model` defaults to the cache's model."""
    TLCache = _tl().ActivationCache
    if isinstance(cache, TLCache):
        return cache
    if isinstance(cache, ActivationCache):
        return TLCache(dict(cache.cache_dict), model if model is not None else cache.model, has_batch_dim=cache.has_batch_dim)
    if isinstance(cache, dict):
        if model is None:
            raise ValueError("a plain dict of activations needs the model it came from: to_tl_cache(cache, model)")
        return TLCache(dict(cache), model)
    raise TypeError(f"expected an interp.ActivationCache or a dict of activations, got {type(cache).__name__}")
