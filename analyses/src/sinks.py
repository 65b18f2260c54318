"""Attention sinks: how much each head attends to the first tokens, and what keeping them buys a
sliding window.

* `attention_sinks` follows Gu et al. (2024), "When Attention Sink Emerges in Language Models: An
  Empirical View": for head (l, h) and key k,
      alpha_k = 1 / |Q_k| * sum_{t in Q_k} A[t, k],   Q_k = the queries that can see key k
  (t >= k, inside the window, real tokens), averaged over sequences; their Sink metric is the share
  of heads with alpha_k > epsilon (0.3 in the paper), per layer and over the model (`sink_rate`).
  Sink tokens tend to carry small values (Gu et al. Sec. 7; Xiao et al. 2023), so the value norm
  ||v_k|| of each sink key is reported next to the mean norm of the other keys.
  Exact and O(pos) memory: one fused forward; per layer, each query's weight on key 0 is the streaming
  statistics' `sink` (n_sink = 1: the pass the head detectors share, `interp.analyses.atlas.atlas_pass`), or for
  more keys each row's log-sum-exp and then only the columns k < n_sink of the pattern (`interp.models.readouts.head_statistics`).
* StreamingLLM (what keeping the sinks buys a sliding window) is in `analyses/src/streaming.py`.
"""

from __future__ import annotations

import math

import pandas as pd
import torch
from torch import Tensor

from ._common import kv_group, token_input, valid_mask
from .heads import layer_pass
from interp.models.readouts.head_statistics import attention_logsumexp, attention_weights_at, layer_scoring


def attention_sinks(
    model, tokens, n_sink: int = 1, epsilon: float = 0.3, *, attention_mask: Tensor | None = None
) -> pd.DataFrame:
    """Per head and sink key k < n_sink: Gu et al.'s alpha_k and the value norms.

    tokens [batch, pos]; `attention_mask` for right padding. Returns a DataFrame with one row per
    (layer, head, key): alpha, is_sink (alpha > epsilon), value_norm (||v_k||, mean over sequences),
    value_norm_others (mean ||v_j|| over the real keys j >= n_sink), value_norm_ratio, and the
    settings n_sink, epsilon, n_sequences, seq_len. `.attrs["sink_rate"]` is the Sink metric for key
    0 (share of all heads with alpha_0 > epsilon); `sink_rate(df)` gives it per layer and key."""
    stream = SinkStream(model, tokens, n_sink, epsilon, attention_mask=attention_mask)
    layer_pass(model, stream.tokens, [stream], valid=stream.valid, attention_mask=stream.attention_mask)
    return stream.frame()


class SinkStream:
    """`attention_sinks`, one layer at a time (`interp.analyses.heads.layer_pass`): with n_sink = 1, alpha_0
    is the mean over the queries that see key 0 of each query's weight on it, which is the layer's
    `attention_stats(n_sink=1).sink`; with more sink keys, each key's column of the pattern comes from
    the rows' logsumexp (`attention_weights_at`). So it shares the one streaming pass of the head
    detectors (`interp.analyses.atlas.atlas_pass`)."""

    wants_v = True

    def __init__(self, model, tokens, n_sink: int = 1, epsilon: float = 0.3, *, attention_mask: Tensor | None = None):
        if isinstance(n_sink, bool) or not isinstance(n_sink, int) or n_sink < 1:
            raise ValueError(f"n_sink must be an int >= 1 (how many first keys to examine), got {n_sink!r}")
        tokens, attention_mask = token_input(model, tokens, attention_mask)
        batch, n = tokens.shape
        if n_sink >= n:
            raise ValueError(f"n_sink={n_sink} leaves no other keys in {n}-token sequences; use longer sequences")
        self.model, self.tokens, self.attention_mask = model, tokens, attention_mask
        self.n_sink, self.epsilon = n_sink, epsilon
        self.valid = valid_mask(tokens, attention_mask, right_padded_only=True)
        self.stats = ("sink",) if n_sink == 1 else ()
        self.rows = []

    def layer(self, layer, q, k, v, st, padding) -> None:
        model, valid, n_sink = self.model, self.valid, self.n_sink
        n = self.tokens.shape[1]
        device = self.tokens.device
        scoring = layer_scoring(model, layer)
        keys = torch.arange(n_sink, device=device)
        p = torch.arange(n, device=device)
        if n_sink == 1:
            w = st.sink[..., None]  # [b, h, pos, 1]: each query's weight on key 0
        else:
            lse = attention_logsumexp(q, k, scoring, key_padding_mask=padding)
            w = attention_weights_at(q, k, lse, keys, scoring, key_padding_mask=padding)  # [b, h, pos, n_sink]
        rel = p[:, None] - keys[None, :]
        sees = rel >= 0
        if scoring.window is not None:
            sees = sees & (rel < scoring.window)
        sees = sees[None] & valid[:, :, None] & valid[:, None, :n_sink]  # [b, pos, n_sink]
        counts = sees.sum(1)  # [b, n_sink]
        per_seq = (torch.where(sees[:, None], w, 0.0)).sum(2) / counts[:, None]  # [b, h, n_sink]
        has = (counts > 0)[:, None].expand_as(per_seq)
        alpha = torch.where(has, per_seq, 0.0).sum(0) / has.sum(0)  # [h, n_sink]
        norms = v.float().norm(dim=-1).repeat_interleave(kv_group(model), dim=1)  # [b, h, pos]
        sink_norm = norms[:, :, :n_sink].mean(0)  # [h, n_sink]
        others = valid[:, None, n_sink:].float()
        other_norm = (norms[:, :, n_sink:] * others).sum((0, 2)) / others.sum((0, 2))  # [h]
        alpha, sink_norm, other_norm = alpha.tolist(), sink_norm.tolist(), other_norm.tolist()
        for h in range(model.cfg.n_heads):
            for key in range(n_sink):
                a, vn, vo = alpha[h][key], sink_norm[h][key], other_norm[h]
                self.rows.append(dict(layer=layer, head=h, key=key, alpha=a, is_sink=a > self.epsilon, value_norm=vn,
                                      value_norm_others=vo, value_norm_ratio=vn / vo if vo > 0 else math.nan))

    def frame(self) -> pd.DataFrame:
        batch, n = self.tokens.shape
        frame = pd.DataFrame(self.rows)
        frame = frame.assign(n_sink=self.n_sink, epsilon=self.epsilon, n_sequences=batch, seq_len=n)
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


