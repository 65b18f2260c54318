"""Attention sinks: how much each head attends to the first tokens, and what keeping them buys a
sliding window.

* `attention_sinks` follows Gu et al. (2024), "When Attention Sink Emerges in Language Models: An
  Empirical View": for head (l, h) and key k,
      alpha_k = 1 / |Q_k| * sum_{t in Q_k} A[t, k],   Q_k = the queries that can see key k
  (t >= k, inside the window, real tokens), averaged over sequences; their Sink metric is the share
  of heads with alpha_k > epsilon (0.3 in the paper), per layer and over the model (`sink_rate`).
  Sink tokens tend to carry small values (Gu et al. Sec. 7; Xiao et al. 2023), so the value norm
  ||v_k|| of each sink key is reported next to the mean norm of the other keys.
  Exact and O(pos) memory: one fused forward; per layer, each row's log-sum-exp and then only the
  columns k < n_sink of the pattern (`interp.models.stats`).
* `window_eval` is the StreamingLLM experiment (Xiao et al. 2023, "Efficient Streaming Language
  Models with Attention Sinks"): the loss with sliding-window attention, without and with the first
  n_sink tokens kept visible, evaluated through the KV cache (`model.new_kv_cache(..., n_sink=...)`,
  mask: j <= p and (p - j < window or j < n_sink)). Positions stay the original ones (our cache keeps
  keys after RoPE, so StreamingLLM's re-numbering of positions inside the cache is not reproduced).
"""

from __future__ import annotations

import contextlib
import math
from typing import Iterator, Sequence

import pandas as pd
import torch
from torch import Tensor

from interp.models import lm_loss

from ._common import kv_group, token_batch, valid_mask
from interp.models.stats import _layer_geometry, attention_logsumexp, attention_weights_at, for_each_layer_qk


def attention_sinks(
    model, tokens, n_sink: int = 1, epsilon: float = 0.3, *, attention_mask: Tensor | None = None
) -> pd.DataFrame:
    """Per head and sink key k < n_sink: Gu et al.'s alpha_k and the value norms.

    tokens [batch, pos]; `attention_mask` for right padding. Returns a DataFrame with one row per
    (layer, head, key): alpha, is_sink (alpha > epsilon), value_norm (||v_k||, mean over sequences),
    value_norm_others (mean ||v_j|| over the real keys j >= n_sink), value_norm_ratio, and the
    settings n_sink, epsilon, n_sequences, seq_len. `.attrs["sink_rate"]` is the Sink metric for key
    0 (share of all heads with alpha_0 > epsilon); `sink_rate(df)` gives it per layer and key."""
    if isinstance(n_sink, bool) or not isinstance(n_sink, int) or n_sink < 1:
        raise ValueError(f"n_sink must be an int >= 1 (how many first keys to examine), got {n_sink!r}")
    tokens = token_batch(model, tokens)
    batch, n = tokens.shape
    if n_sink >= n:
        raise ValueError(f"n_sink={n_sink} leaves no other keys in {n}-token sequences; use longer sequences")
    valid = valid_mask(tokens, attention_mask, right_padded_only=True)
    padding = None if bool(valid.all()) else valid
    group = kv_group(model)
    keys = torch.arange(n_sink, device=tokens.device)
    p = torch.arange(n, device=tokens.device)
    rows = []

    def fn(layer, q, k, v):
        geometry = _layer_geometry(model, layer)
        lse = attention_logsumexp(q, k, key_padding_mask=padding, **geometry)
        w = attention_weights_at(q, k, lse, keys, key_padding_mask=padding, **geometry)  # [b, h, pos, n_sink]
        rel = p[:, None] - keys[None, :]
        sees = rel >= 0
        if geometry["window"] is not None:
            sees = sees & (rel < geometry["window"])
        sees = sees[None] & valid[:, :, None] & valid[:, None, :n_sink]  # [b, pos, n_sink]
        counts = sees.sum(1)  # [b, n_sink]
        per_seq = (w * sees[:, None]).sum(2) / counts[:, None]  # [b, h, n_sink]
        has = (counts > 0)[:, None].expand_as(per_seq)
        alpha = torch.where(has, per_seq, 0.0).sum(0) / has.sum(0)  # [h, n_sink]
        norms = v.float().norm(dim=-1).repeat_interleave(group, dim=1)  # [b, h, pos]
        sink_norm = norms[:, :, :n_sink].mean(0)  # [h, n_sink]
        others = valid[:, None, n_sink:].float()
        other_norm = (norms[:, :, n_sink:] * others).sum((0, 2)) / others.sum((0, 2))  # [h]
        for h in range(model.cfg.n_heads):
            for key in range(n_sink):
                a, vn, vo = float(alpha[h, key]), float(sink_norm[h, key]), float(other_norm[h])
                rows.append(dict(layer=layer, head=h, key=key, alpha=a, is_sink=a > epsilon, value_norm=vn,
                                 value_norm_others=vo, value_norm_ratio=vn / vo if vo > 0 else math.nan))

    for_each_layer_qk(model, tokens, fn, attention_mask=attention_mask)
    frame = pd.DataFrame(rows)
    frame = frame.assign(n_sink=n_sink, epsilon=epsilon, n_sequences=batch, seq_len=n)
    frame.attrs["sink_rate"] = float(frame.loc[frame.key == 0, "is_sink"].mean())
    return frame


def sink_rate(frame: pd.DataFrame, epsilon: float | None = None) -> pd.DataFrame:
    """Gu et al.'s Sink metric from an `attention_sinks` frame: the share of heads with alpha_k >
    epsilon (default: the frame's), per layer and key, plus rows with layer "all" for the model."""
    eps = frame["epsilon"].iloc[0] if epsilon is None else epsilon
    above = frame.assign(above=frame["alpha"] > eps)
    per_layer = above.groupby(["layer", "key"], as_index=False)["above"].mean()
    overall = above.groupby("key", as_index=False)["above"].mean().assign(layer="all")
    out = pd.concat([per_layer.astype({"layer": object}), overall], ignore_index=True)
    return out.rename(columns={"above": "sink_rate"}).assign(epsilon=eps)[["layer", "key", "sink_rate", "epsilon"]]


# ---- StreamingLLM: sliding windows with and without sinks ---------------------------------------


@contextlib.contextmanager
def sliding_window(model, window: int | None) -> Iterator[None]:
    """Give every attention layer the sliding window `window` (None: full attention) inside the block."""
    saved = [b.attn.window for b in model.blocks]
    try:
        for b in model.blocks:
            b.attn.window = window
        yield
    finally:
        for b, w in zip(model.blocks, saved):
            b.attn.window = w


@torch.no_grad()
def streaming_loss(
    model, tokens: Tensor, window: int | None, n_sink: int = 0, *, chunk_size: int | None = None,
    attention_mask: Tensor | None = None,
) -> Tensor:
    """Per-token next-token loss [batch, pos - 1] when every layer attends through a window of
    `window` keys plus the first `n_sink` keys, fed through a KV cache `chunk_size` tokens at a time
    (None: all at once; any chunking gives the same numbers, the mask being exact)."""
    batch, n = tokens.shape
    step = n if chunk_size is None else chunk_size
    cache = model.new_kv_cache(batch, n, n_sink=n_sink)
    with sliding_window(model, window):
        logits = [
            model(tokens[:, s : s + step], kv_cache=cache,
                  attention_mask=None if attention_mask is None else attention_mask[:, s : s + step])
            for s in range(0, n, step)
        ]
    valid = valid_mask(tokens, attention_mask)
    return lm_loss(torch.cat(logits, dim=1), tokens, valid, per_token=True)


def window_eval(
    model, tokens, window: int | Sequence[int], n_sink: int = 4, *, chunk_size: int | None = None,
    attention_mask: Tensor | None = None,
) -> pd.DataFrame:
    """StreamingLLM's comparison (Xiao et al. 2023, Table/Fig. 3): mean next-token loss with
    full attention, with a sliding window of `window` keys ("window"), and with the window plus the
    first `n_sink` tokens ("window+sink"). Several windows may be given.

    Returns rows: setting, window, n_sink, loss, perplexity, n_tokens, chunk_size."""
    tokens = token_batch(model, tokens)
    windows = [window] if isinstance(window, int) else list(window)
    if any(w < 1 for w in windows) or n_sink < 0:
        raise ValueError(f"windows must be >= 1 and n_sink >= 0, got window={window}, n_sink={n_sink}")
    valid = valid_mask(tokens, attention_mask)
    pairs = (valid[:, :-1] & valid[:, 1:]).sum()
    settings = [("full", None, 0)] + [(name, w, s) for w in windows for name, s in (("window", 0), ("window+sink", n_sink))]
    rows = []
    for name, w, s in settings:
        nll = streaming_loss(model, tokens, w, s, chunk_size=chunk_size, attention_mask=attention_mask)
        loss = float(nll.sum() / pairs)
        rows.append(dict(setting=name, window=w, n_sink=s, loss=loss, perplexity=math.exp(loss),
                         n_tokens=int(pairs), chunk_size=chunk_size))
    return pd.DataFrame(rows)
