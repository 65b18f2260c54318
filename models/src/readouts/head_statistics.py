"""Head statistics from a model without materialising any attention pattern.

`for_each_layer_qk` runs ONE forward on the fused attention path and, as each layer finishes,
hands that layer's queries and keys (after RoPE) and values to a callback, then drops them: the
peak memory is one layer's q/k/v plus whatever the callback keeps. On top of it:

* `model_attention_stats(model, tokens)`: `interp.kernels.attention_stats` for every layer (the fused
  route where it is exact: one fused attention call per block of queries plus a few gathers; the tiled
  kernels for soft-capped layers): {layer: AttentionStats [batch, head, pos]}.
* `kv_cache_attention_stats(model, cache)`: the same from a `KVCache` made with
  `capture_queries=True` (after a forward or a generation), without re-running the model.
* `attention_logsumexp` / `attention_weights_at`: exact single entries of the pattern (a column such
  as key 0, or the diagonal) from q, k and each row's log-sum-exp, in O(n) memory.

Masks follow `interp.kernels.attention.AttentionMask` and the kernel: key j is visible to the query
at p iff j <= p, p - j < window, and the key is real.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable

import torch
from torch import Tensor

import numpy as np
import pandas as pd

from interp.kernels import AttentionStats, Scoring, attention_stats
from interp.kernels.attention import soft_cap
from interp.kernels.visibility import visible

from ..placement import device_map as device_maps
from ..placement.device import to_numpy

LayerFn = Callable[[int, Tensor, Tensor, Tensor], None]


def layer_scoring(model, layer: int) -> Scoring:
    """Layer `layer`'s `Scoring` (`attn.scoring`, native or wrapped): what every statistics call of the
    layer takes."""
    return model.blocks[layer].attn.scoring


@torch.no_grad()
def for_each_layer_qk(model, tokens, fn: LayerFn, *, attention_mask: Tensor | None = None, layers=None):
    """One fused forward; call fn(layer, q [batch, head, pos, d_head], k, v [batch, kv_head, pos, d_head])
    as each requested layer is computed (q and k after RoPE), then release them.

    The forward stops after the last requested layer (no unembedding) and returns what it gives there:
    for a native model, the residual stream after that layer [batch, pos, d_model] (after the last
    layer: what `model(tokens, stop_at_layer=n_layers)` returns, for logits at a few positions). Hooks
    already on the model (e.g. ones that edit q or k) run first, so the callback sees what attention saw.
    On a model split over devices (`device_map`) the callback gets every layer's q, k, v on the first device
    (`model.device`, where the tokens are), so what it computes and keeps across layers is on one device.
    """
    tokens = model.prepare(tokens, padding=False).tokens
    layers = sorted(range(model.cfg.n_layers) if layers is None else set(layers))
    if not layers:
        return None
    rotary = model.rotary is not None
    split = device_maps.is_split(getattr(model, "device_map", None))
    held: dict[str, Tensor] = {}

    def keep(key: str):
        def hook(x: Tensor, hook) -> None:
            held[key] = x.transpose(1, 2)  # [batch, pos, head, d] -> [batch, head, pos, d]

        return hook

    def done(layer: int):
        def hook(x: Tensor, hook) -> None:
            q, k, v = held.pop("q"), held.pop("k"), held.pop("v")
            if split:  # a model split over devices (`device_map`): every layer's handed over on the first one
                q, k, v = device_maps.move((q, k, v), model.device)
            fn(layer, q, k, v)

        return hook

    hooks = []
    for l in layers:
        a = f"blocks.{l}.attn."
        hooks += [
            (a + ("hook_rot_q" if rotary else "hook_q"), keep("q")),
            (a + ("hook_rot_k" if rotary else "hook_k"), keep("k")),
            (a + "hook_v", keep("v")),
            (f"blocks.{l}.hook_attn_out", done(l)),
        ]
    return model.run_with_hooks(tokens, fwd_hooks=hooks, attention_mask=attention_mask, stop_at_layer=layers[-1] + 1)


def model_attention_stats(
    model, tokens, *, attention_mask: Tensor | None = None, layers=None, n_sink: int = 1, backend: str = "auto"
) -> dict[int, AttentionStats]:
    """Streaming statistics (sink, previous, duplicate, induction, entropy, max, distance) of every
    requested layer, float32 [batch, head, pos] each, from one fused forward. Memory O(layers * pos)
    for the results; no pattern is ever built.

    For long contexts where even the per-query results of all layers are too much, use
    `for_each_layer_qk` and reduce inside the callback (as `interp.analyses.detect_heads` does)."""
    batch = model.prepare(tokens, attention_mask, padding=False)
    tokens, padding = batch.tokens, None if attention_mask is None else batch.valid
    out: dict[int, AttentionStats] = {}

    def fn(layer, q, k, v):
        out[layer] = attention_stats(q, k, tokens, layer_scoring(model, layer), n_sink=n_sink, key_padding_mask=padding,
                                     backend=backend)

    for_each_layer_qk(model, tokens, fn, attention_mask=attention_mask, layers=layers)  # on the first device
    return out


def kv_cache_attention_stats(model, cache, *, layers=None, n_sink: int = 1, backend: str = "auto") -> dict[int, AttentionStats]:
    """Streaming statistics of every cached layer from a `KVCache` that kept the queries
    (`model.new_kv_cache(batch, max_len, capture_queries=True)`), after any number of forwards or a
    generation through it. Queries are all cached positions: float32 [batch, head, cache.length].

    The tokens are the cache's (`cache.tokens`); padding comes from `cache.valid()`. A cache made with
    n_sink > 0 (StreamingLLM masks) is refused: the kernel knows plain windows only."""
    if cache.queries is None:
        raise ValueError(
            "this KV cache did not keep the queries; make it with model.new_kv_cache(batch, max_len, capture_queries=True)"
        )
    if getattr(cache, "n_sink", 0) and any(b.attn.window is not None for b in model.blocks):
        raise ValueError("kv_cache_attention_stats cannot express the StreamingLLM sink mask of a cache with n_sink > 0")
    n = cache.length
    if n == 0:
        raise ValueError("the KV cache is empty: run the model through it first (model(tokens, kv_cache=cache))")
    valid = cache.valid()
    padding = None if bool(valid.all()) else valid
    tokens = cache.tokens[:, :n]
    layers = range(model.cfg.n_layers) if layers is None else layers
    return {
        l: attention_stats(cache.q(l), cache.k(l), tokens, layer_scoring(model, l), n_sink=n_sink,
                           key_padding_mask=padding, backend=backend)
        for l in layers
    }


# ---- exact single pattern entries in O(n) memory ------------------------------------------------


def _scores(q: Tensor, k: Tensor, p: Tensor, j: Tensor, scoring: Scoring, key_padding_mask) -> Tensor:
    """Masked float32 scores [batch, head, len(p), len(j)] for query positions p and key positions j
    (absolute positions; queries are the last n_q of the n_k keys), soft-capped before ALiBi and the
    mask as the model's (`scoring`, its scale resolved)."""
    batch, heads, n_q, d = q.shape
    kv_heads, n_k = k.shape[1], k.shape[2]
    group = heads // kv_heads
    qi = p - (n_k - n_q)
    qs = q[:, :, qi].float().view(batch, kv_heads, group * len(p), d)
    s = torch.matmul(qs, k[:, :, j].float().transpose(-1, -2)).view(batch, heads, len(p), len(j)) * scoring.scale
    if scoring.softcap is not None:
        s = soft_cap(s, scoring.softcap)
    rel = (p[:, None] - j[None, :]).float()
    if scoring.alibi_slopes is not None:
        s = s - scoring.alibi_slopes.float().view(1, heads, 1, 1) * rel.abs()
    ok = visible(rel, causal=scoring.causal, window=scoring.window)[None, None]
    if key_padding_mask is not None:
        ok = ok & key_padding_mask[:, None, None, j]
    return s.masked_fill(~ok, float("-inf"))


def _resolved(q: Tensor, scoring: Scoring | None) -> Scoring:
    """`scoring` (None: the default) with its scale resolved (1 / sqrt(d_head) by default)."""
    scoring = Scoring.of(scoring)
    return scoring if scoring.scale is not None else dataclasses.replace(scoring, scale=1.0 / math.sqrt(q.shape[-1]))


@torch.no_grad()
def attention_logsumexp(q: Tensor, k: Tensor, scoring: Scoring | None = None, *,
                        key_padding_mask: Tensor | None = None, budget: int = 1 << 22) -> Tensor:
    """log sum_j exp(score) per query, float32 [batch, head, n_q] (-inf for a query with no visible key).

    q [batch, head, n_q, d], k [batch, kv_head, n_k, d] (GQA: head h reads kv head h // group), with the
    queries the last n_q keys, scored as `scoring` says (the layer's `attn.scoring`).
    Query blocks are sized so that one block's scores hold about `budget` floats (under a window, a block of
    at most `window` queries reaches 2 x window keys): O(n) memory, one attention pass of compute. Learned
    sink logits (gpt-oss) are one more term in the sum (the model's softmax denominator)."""
    scoring = _resolved(q, scoring)
    batch, heads, n_q, d = q.shape
    n_k, window = k.shape[2], scoring.window
    offset = n_k - n_q
    span = n_k if window is None else min(n_k, 2 * window)  # keys a block of <= window queries reaches
    block = max(1, budget // max(1, batch * heads * span))
    if window is not None:
        block = min(block, window)
    out = torch.empty(batch, heads, n_q, dtype=torch.float32, device=q.device)
    for qs in range(0, n_q, block):
        p = torch.arange(offset + qs, offset + min(qs + block, n_q), device=q.device)
        lo = 0 if window is None else max(0, int(p[0]) - window + 1)
        j = torch.arange(lo, int(p[-1]) + 1 if scoring.causal else n_k, device=q.device)
        out[:, :, qs : qs + len(p)] = torch.logsumexp(_scores(q, k, p, j, scoring, key_padding_mask), dim=-1)
    if scoring.sink_logits is not None:  # learned sink logits (gpt-oss): one more term in every row's sum
        out = torch.logaddexp(out, scoring.sink_logits.float().to(out.device)[None, :, None])
    return out


@torch.no_grad()
def attention_weights_at(q: Tensor, k: Tensor, lse: Tensor, keys: Tensor | None = None,
                         scoring: Scoring | None = None, *, key_padding_mask: Tensor | None = None) -> Tensor:
    """Exact attention weights P[b, h, i, j] = exp(score - lse) at chosen keys, without the pattern.

    keys: long [m] absolute key positions -> [batch, head, n_q, m] (a few columns, e.g. the sink keys);
          None -> the diagonal P[b, h, i, p_i] (each query's weight on its own position), [batch, head, n_q].
    Entries a query cannot see are 0. `lse` comes from `attention_logsumexp` with the same `scoring` (whose
    sink logits it holds)."""
    scoring = _resolved(q, scoring)
    batch, heads, n_q, d = q.shape
    n_k = k.shape[2]
    p = torch.arange(n_k - n_q, n_k, device=q.device)
    if keys is not None:
        w = torch.exp(_scores(q, k, p, keys.to(q.device), scoring, key_padding_mask) - lse[..., None])
    else:
        group = heads // k.shape[1]
        k_own = k[:, :, p].float().repeat_interleave(group, dim=1)  # [batch, head, n_q, d]
        s = (q.float() * k_own).sum(-1) * scoring.scale  # ALiBi adds -slope * (p - p) = 0 here
        if scoring.softcap is not None:
            s = soft_cap(s, scoring.softcap)
        if key_padding_mask is not None:
            s = s.masked_fill(~key_padding_mask[:, None, p], float("-inf"))
        w = torch.exp(s - lse)
    return torch.nan_to_num(w, nan=0.0)  # -inf - -inf (no visible key) -> 0


@torch.no_grad()
def attention_rows(q: Tensor, k: Tensor, rows: Tensor, scoring: Scoring | None = None, *,
                   key_padding_mask: Tensor | None = None) -> Tensor:
    """Exact rows of the pattern, P[b, h, rows, :], float32 [batch, head, len(rows), n_k], without the rest.

    rows: long [m] absolute query positions (queries are the last n_q of the n_k keys, as `attention_logsumexp`'s).
    Each row's softmax over every key, as the model scores them (`scoring`: the layer's scale, soft cap, ALiBi,
    window and learned sink logits, whose weight is the row's missing mass); entries a query cannot see are 0.
    O(m x n_k) memory: a few rows of a long prompt's pattern (what a report shows), where the whole pattern would
    take GBs."""
    scoring = _resolved(q, scoring)
    rows = rows.to(q.device)
    s = _scores(q, k, rows, torch.arange(k.shape[2], device=q.device), scoring, key_padding_mask)
    lse = torch.logsumexp(s, dim=-1, keepdim=True)
    if scoring.sink_logits is not None:  # learned sink logits (gpt-oss): one more term in every row's sum
        lse = torch.logaddexp(lse, scoring.sink_logits.float().to(s.device)[None, :, None, None])
    return torch.nan_to_num(torch.exp(s - lse), nan=0.0)  # -inf - -inf (no visible key) -> 0


def stats_frame(stats: dict[int, AttentionStats], query_mask: Tensor | None = None) -> pd.DataFrame:
    """A tidy table of per-layer statistics: one row per (layer, batch, head, query), one column per
    statistic (sink, previous, duplicate, induction, entropy, max, distance). Rows of queries that
    `query_mask` ([batch, pos] bool) marks False, or that saw no key (NaN), are dropped."""
    frames = []
    for layer, st in stats.items():
        cols = st.to_dict()
        first = next(iter(cols.values()))
        b, h, n = first.shape
        bi, hi, qi = (a.reshape(-1) for a in np.meshgrid(np.arange(b), np.arange(h), np.arange(n), indexing="ij"))
        frame = pd.DataFrame({"layer": layer, "batch": bi, "head": hi, "query": qi})
        for name, value in cols.items():
            frame[name] = to_numpy(value.float().reshape(-1))
        if query_mask is not None:
            keep = to_numpy(query_mask[:, None, :].expand(b, h, n).reshape(-1))
            frame = frame[keep]
        frames.append(frame.dropna())
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()
