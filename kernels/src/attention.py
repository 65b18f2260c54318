"""Attention backends: one signature, a registry, and what each backend can give.

    fused        torch SDPA (FlashAttention / memory-efficient / cuDNN on GPU, flash on CPU).
                 Gives the output only; never materialises the [q, k] pattern. Soft-capped scores
                 (Gemma 2), which SDPA cannot compute, run in bounded blocks of queries instead.
    instrumented explicit scores -> hook_attn_scores -> softmax -> hook_pattern -> z.
                 Gives scores and pattern to hooks, which may read or replace them.

Both take `q: [batch, head, q, d_head]`, `k, v: [batch, kv_head, k, d_head]` (GQA: head h reads kv
head h // (head // kv_head)), an `AttentionMask` and the layer's `Scoring` (`attn.scoring`: scale, window,
ALiBi slopes, soft cap, learned sink logits; `kernels.stats.scoring`), and return `z: [batch, head, q, d_head]`.
What is not the layer's scoring stays a keyword of its own: the score / pattern hooks (what a caller reads or
replaces, which only the instrumented backend takes) and `sink_limit` (where the StreamingLLM sink keys of
the mask stop: the layer's own window, which `Scoring.window` is not while an analysis narrows it).

How the causal mask aligns when queries are a suffix of the keys (decoding from a KV cache,
n_q = 2, n_k = 5, offset = n_k - n_q = 3): query i sits at absolute position offset + i.

            key  0 1 2 3 4
    query 0 (p=3) x x x x .
    query 1 (p=4) x x x x x

A key j is visible to the query at position p by the one rule in `kernels.visibility`: j <= p
(causal), p - j < window (sliding window, Hugging Face's convention) or j < n_sink (StreamingLLM's
attention sinks, Xiao et al. 2023, kept past the window), and the key is not padding.  A query that sees no key at all (a padding query under left padding) is given its own
key, so that no row is empty: its output is finite and meaningless, and analyses skip it.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Callable, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor

from .stats.scoring import Scoring
from .visibility import visible

TensorHook = Callable[[Tensor], Tensor]


@dataclass
class AttentionMask:
    """Which keys each query may see, shared by all layers of one forward pass.

    n_q, n_k     query and key counts; queries are the last n_q of the n_k positions.
    key_valid    bool [batch, n_k], True for real tokens, or None when nothing is padded.
    causal       False for bidirectional attention.
    n_sink       keys j < n_sink stay visible past a sliding window (StreamingLLM, Xiao et al.
                 2023); 0 (the default) keeps the plain window. A layer with a window of its own
                 (`sink_limit` below) keeps its sinks only inside that window: an analysis that
                 narrows a window never lets a layer see further than the model does.
    explicit     bool [batch or 1, head or 1, n_q, n_k]: which keys each query sees, given outright
                 (a KV cache whose heads hold different tokens, `models/src/kv/policy_cache.py`); the
                 window and sink arguments are then already in it. No ALiBi with it.

    Boolean masks and ALiBi biases are built lazily, once per (window, slopes), and reused by every
    layer of the forward pass.
    """

    n_q: int
    n_k: int
    key_valid: Tensor | None = None
    causal: bool = True
    n_sink: int = 0
    explicit: Tensor | None = None
    _cache: dict = field(default_factory=dict, repr=False)

    @property
    def offset(self) -> int:
        return self.n_k - self.n_q

    def is_plain(self, window: int | None) -> bool:
        """True when SDPA's own `is_causal` (or no mask at all) expresses the mask exactly."""
        if self.key_valid is not None or self.explicit is not None:
            return False
        if window is not None and window < self.n_k:
            return False
        return not self.causal or self.n_q == self.n_k or self.n_q == 1

    def pairs(self, q_pos: Tensor, k_pos: Tensor, window: int | None, sink_limit: int | None = None,
              slopes: Tensor | None = None, dtype: torch.dtype | None = None) -> Tensor:
        """The mask of queries at absolute positions `q_pos` against keys at `k_pos` (any subsets, on one
        device): bool [batch or 1, 1, len(q_pos), len(k_pos)], or with `slopes` (ALiBi) the float 0 / -inf
        mask plus -slope * |p - j| [batch or 1, head, ...] in `dtype`. `sink_limit`: the layer's own window
        (the model's, before any analysis narrowed it), which the sink keys may not reach past; None: sinks
        are kept at any distance. The whole mask (`visible`, `bias`) and the bands of a long windowed
        prefill (`_banded_attention`) are this on their pairs."""
        rel = q_pos[:, None] - k_pos[None, :]  # p - j
        sinks = (k_pos < self.n_sink)[None, :] if self.n_sink else None
        if sinks is not None and sink_limit is not None:
            sinks = sinks & (rel < sink_limit)
        ok = visible(rel, causal=self.causal, window=window, sink_key=sinks)[None, None]
        if self.key_valid is not None:
            ok = ok & self.key_valid[:, None, None, k_pos.to(self.key_valid.device)].to(k_pos.device)
            # A row with no visible key would give NaN; let it see its own position instead.
            ok = ok | ((rel == 0)[None, None] & ~ok.any(-1, keepdim=True))
        if slopes is None:
            return ok
        out = torch.zeros(ok.shape, dtype=dtype, device=k_pos.device).masked_fill(~ok, float("-inf"))
        return out - slopes.to(device=k_pos.device, dtype=dtype)[None, :, None, None] * rel.abs().to(dtype)

    def visible(self, window: int | None, device: torch.device, sink_limit: int | None = None) -> Tensor:  # noqa: F811
        """bool [batch or 1, 1, n_q, n_k]: True where the query may attend to the key (`pairs` on every pair)."""
        if self.explicit is not None:
            return self.explicit.to(device)
        key = ("visible", window, sink_limit, device)
        if key not in self._cache:
            self._cache[key] = self.pairs(torch.arange(self.offset, self.n_k, device=device),
                                          torch.arange(self.n_k, device=device), window, sink_limit)
        return self._cache[key]

    def bias(self, window: int | None, slopes: Tensor | None, dtype: torch.dtype, device,
             sink_limit: int | None = None) -> Tensor:
        """float [batch or 1, head or 1, n_q, n_k]: 0 / -inf mask plus the ALiBi bias -slope * (p - j)."""
        # Keyed by the slope values: every layer holds its own (equal) buffer, and one bias serves all.
        if self.explicit is not None and slopes is not None:
            raise ValueError("ALiBi biases need positions a mask given outright does not carry")
        key = ("bias", window, sink_limit, None if slopes is None else tuple(slopes.tolist()), dtype, device)
        if key not in self._cache:
            if slopes is None:
                ok = self.visible(window, device, sink_limit)
                self._cache[key] = torch.zeros(ok.shape, dtype=dtype, device=device).masked_fill(~ok, float("-inf"))
            else:
                self._cache[key] = self.pairs(torch.arange(self.offset, self.n_k, device=device),
                                              torch.arange(self.n_k, device=device), window, sink_limit, slopes, dtype)
        return self._cache[key]


class AttentionFn(Protocol):
    def __call__(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        mask: AttentionMask,
        scoring: Scoring,
        *,
        scores_hook: TensorHook | None = None,
        pattern_hook: TensorHook | None = None,
        sink_limit: int | None = None,
    ) -> Tensor: ...


def expand_kv(x: Tensor, n_heads: int) -> Tensor:
    """[batch, kv_head, k, d] -> [batch, head, k, d] by repeating each kv-head for its group."""
    groups = n_heads // x.shape[1]
    if groups == 1:
        return x
    b, kv, n, d = x.shape
    return x[:, :, None].expand(b, kv, groups, n, d).reshape(b, kv * groups, n, d)


def _resolved(scoring: Scoring, q: Tensor) -> Scoring:
    """`scoring` with its scale resolved against the queries q [.., d_head] (None: 1 / sqrt(d_head)). The
    causality a backend applies is the mask's (`AttentionMask.causal`), not `scoring.causal`. Anything but
    a Scoring is a TypeError (`Scoring.of`)."""
    scoring = Scoring.of(scoring)
    if scoring.scale is not None:
        return scoring
    return dataclasses.replace(scoring, scale=1.0 / math.sqrt(q.shape[-1]))


def fused_attention(q, k, v, mask, scoring: Scoring, *, scores_hook=None, pattern_hook=None, sink_limit=None):
    """torch SDPA. Cannot hand scores or patterns to hooks: asking for them is an error. Soft-capped
    scores (`scoring.softcap`), which SDPA cannot compute, run in blocks of queries (`_capped_attention`).
    Learned sink logits (`scoring.sink_logits` [head], gpt-oss) go in as one more key (`_attention_with_sink_key`)."""
    if scores_hook is not None or pattern_hook is not None:  # called directly, past `choose`
        raise RuntimeError(unavailable("fused", [_NO_PATTERN]))
    scoring = _resolved(scoring, q)
    scale, window, alibi_slopes = scoring.scale, scoring.window, scoring.alibi_slopes
    if scoring.softcap is not None:
        return _capped_attention(q, k, v, mask, scoring, sink_limit=sink_limit)
    gqa = {}
    if k.shape[1] != q.shape[1] and q.device.type == "cpu":
        # GQA on the CPU: SDPA reads each kv-head for its group itself, without the copy of the expanded
        # keys/values (2-3x faster attention when decoding from a KV cache). On CUDA the expansion stays:
        # not every fused kernel takes enable_gqa, and the fallback would materialise the pattern.
        gqa = {"enable_gqa": True}
    else:
        k, v = expand_kv(k, q.shape[1]), expand_kv(v, q.shape[1])
    if scoring.sink_logits is not None:
        return _attention_with_sink_key(q, k, v, mask, scoring, sink_limit=sink_limit, gqa=gqa)
    if alibi_slopes is None and mask.is_plain(window):
        causal = mask.causal and mask.n_q == mask.n_k and mask.n_q > 1
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale, **gqa)
    if banded(mask, window):
        return _banded_attention(q, k, v, mask, scoring, sink_limit=sink_limit, gqa=gqa)
    if alibi_slopes is None:
        attn_mask = mask.visible(window, q.device, sink_limit)
    else:
        attn_mask = mask.bias(window, alibi_slopes, q.dtype, q.device, sink_limit)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, scale=scale, **gqa)


def _with_sink_key(q: Tensor, k: Tensor, v: Tensor, sink_logits: Tensor, scale: float) -> tuple[Tensor, Tensor, Tensor]:
    """q, k, v with the learned sink logits as one more key in front (key 0) whose score is each head's
    sink logit and whose value is 0: softmax then gives P_ij = exp(s_ij) / (exp(sink_h) + sum_j exp(s_ij)),
    and the sink adds nothing to the output. q and k gain columns (to a multiple of 8, as fused kernels
    like): q's first new one holds sink_h / scale, key 0's holds 1 and the real keys' hold 0, so key 0
    scores sink_h and every real key scores q . k exactly as before (the rest are zeros).

    q [batch, head, n_q, d], k / v [batch, kv_head, n_k, d] -> q [.., n_q, d'], k [.., n_k + 1, d'], v [.., n_k + 1, d]."""
    (b, h, n_q, d), (kv, n_k) = q.shape, k.shape[1:3]
    width = (d + 8) // 8 * 8
    q_ = q.new_zeros(b, h, n_q, width)
    q_[..., :d] = q
    q_[..., d] = (sink_logits.float() / scale).to(q.dtype)[None, :, None]
    k_ = k.new_zeros(b, kv, n_k + 1, width)
    k_[:, :, 1:, :d] = k
    k_[:, :, 0, d] = 1
    return q_, k_, torch.cat([v.new_zeros(b, kv, 1, v.shape[-1]), v], dim=2)


def _with_sink_column(attn_mask: Tensor) -> Tensor:
    """A mask [.., n_q, n_k] with the sink key's column in front: visible (True, or a 0 bias) to every query."""
    first = attn_mask[..., :1]
    first = torch.ones_like(first) if attn_mask.dtype == torch.bool else torch.zeros_like(first)
    return torch.cat([first, attn_mask], dim=-1)


def _attention_with_sink_key(q, k, v, mask: AttentionMask, scoring: Scoring, *, sink_limit, gqa):
    """SDPA with the learned sink logits as key 0 (`_with_sink_key`), which every query sees: a column in
    front of the mask (and of each band's mask in a long windowed prefill). The plain causal call gets one
    query in front too, whose output is dropped: SDPA's own top-left causal mask then shows query i the sink
    key and keys <= i, so still no mask is built. `scoring`: its scale resolved (`_resolved`)."""
    scale, window, alibi_slopes = scoring.scale, scoring.window, scoring.alibi_slopes
    q, k, v = _with_sink_key(q, k, v, scoring.sink_logits, scale)
    if alibi_slopes is None and mask.is_plain(window):
        if not (mask.causal and mask.n_q == mask.n_k and mask.n_q > 1):  # every key is visible
            return F.scaled_dot_product_attention(q, k, v, scale=scale, **gqa)
        q = torch.cat([torch.zeros_like(q[:, :, :1]), q], dim=2)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, **gqa)[:, :, 1:]
    if banded(mask, window):
        return _banded_attention(q, k[:, :, 1:], v[:, :, 1:], mask, scoring, sink_limit=sink_limit, gqa=gqa,
                                 sink_key=(k[:, :, :1], v[:, :, :1]))
    if alibi_slopes is None:
        attn_mask = mask.visible(window, q.device, sink_limit)
    else:
        attn_mask = mask.bias(window, alibi_slopes, q.dtype, q.device, sink_limit)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=_with_sink_column(attn_mask), scale=scale, **gqa)


# A causal sliding window over many queries runs in bands of queries (`_banded_attention`): each
# band of BAND queries reads only the keys its window reaches, so a windowed layer costs O(n * window)
# time and memory instead of the [n, n] mask (1 GiB of bool at 32k tokens, and SDPA's work on every
# masked-out key). Below BAND_FROM queries the single masked call is as fast.
BAND_MIN, BAND_FROM = 256, 1024


def banded(mask: AttentionMask, window: int | None) -> bool:
    """True when `fused_attention` runs this call in bands: causal, a window shorter than the keys,
    many queries, and no mask given outright (a per-head cache's visibility)."""
    return (window is not None and window < mask.n_k and mask.causal and mask.explicit is None
            and mask.n_q >= max(BAND_FROM, 2 * window))


def _banded_attention(q, k, v, mask: AttentionMask, scoring: Scoring, *, sink_limit, gqa, sink_key=None):
    """SDPA band by band: queries [s, e) see keys [p0 - window + 1, p1) (their window) plus the
    StreamingLLM sink keys before it; the band's mask is `AttentionMask.pairs` on those pairs, so
    the output equals the whole-mask call's (same keys, same softmax) up to float round-off.
    `scoring`: its scale resolved (`_resolved`); its sink logits, if any, are already `sink_key`: (key, value)
    [batch, kv_head, 1, ..] of the learned sink logits (`_with_sink_key`), put in front of every band's keys
    and seen by every query."""
    scale, window, alibi_slopes = scoring.scale, scoring.window, scoring.alibi_slopes
    band = max(window, BAND_MIN)
    device, off = q.device, mask.offset
    out = q.new_empty(*q.shape[:-1], v.shape[-1])
    for s in range(0, mask.n_q, band):
        e = min(mask.n_q, s + band)
        lo, hi = max(0, off + s - window + 1), off + e  # the keys any query of the band can reach
        k_pos = torch.arange(lo, hi, device=device)
        ks, vs = k[:, :, lo:hi], v[:, :, lo:hi]
        n_sink = min(mask.n_sink, lo)
        if n_sink:  # sink keys left of the band's reach, kept visible past the window
            k_pos = torch.cat([torch.arange(n_sink, device=device), k_pos])
            ks, vs = torch.cat([k[:, :, :n_sink], ks], 2), torch.cat([v[:, :, :n_sink], vs], 2)
        attn_mask = mask.pairs(torch.arange(off + s, off + e, device=device), k_pos, window, sink_limit,
                               alibi_slopes, q.dtype)
        if sink_key is not None:
            ks, vs = torch.cat([sink_key[0], ks], 2), torch.cat([sink_key[1], vs], 2)
            attn_mask = _with_sink_column(attn_mask)
        out[:, :, s:e] = F.scaled_dot_product_attention(q[:, :, s:e], ks, vs, attn_mask=attn_mask, scale=scale, **gqa)
    return out


def soft_cap(x: Tensor, cap: float) -> Tensor:
    """cap * tanh(x / cap) (Gemma 2's soft-capping), computed as Hugging Face's: divide, tanh, multiply."""
    return torch.tanh(x / cap) * cap


# A soft-capped layer cannot run through SDPA, whose scores are q k^T * scale and nothing else.
# `_capped_attention` runs it in blocks of queries instead: each block's scores against the keys it can
# reach (causal: up to its last query; a window: from its first query's window, plus the sink keys),
# capped, masked, softmaxed and applied to v, then dropped. A block holds at most CAP_TILE floats of
# scores (and at most CAP_BLOCK queries; at least one), so memory is bounded by the tile, never the
# layer's [q, k] pattern (which one block covers only when it is that small).
CAP_TILE, CAP_BLOCK = 1 << 22, 256


def with_sink_column(scores: Tensor, sink_logits: Tensor) -> Tensor:
    """scores [batch, head, query, key] with each head's learned sink logit (gpt-oss, `sink_logits` [head]) as
    one more key column, [batch, head, query, key + 1]: a softmax over it gives the sink its share of each row."""
    column = sink_logits.to(scores.dtype)[None, :, None, None].expand(*scores.shape[:-1], 1)
    return torch.cat([scores, column], dim=-1)


def _capped_attention(q, k, v, mask: AttentionMask, scoring: Scoring, *, sink_limit):
    """The instrumented path's numbers (scores in float32, capped, masked as `AttentionMask.pairs`,
    float32 softmax, learned sink logits as one more column, uncapped), one block of queries at a time.
    `scoring`: its scale resolved (`_resolved`)."""
    scale, window, alibi_slopes = scoring.scale, scoring.window, scoring.alibi_slopes
    softcap, sink_logits = scoring.softcap, scoring.sink_logits
    if mask.explicit is not None and alibi_slopes is not None:
        raise ValueError("ALiBi biases need positions a mask given outright does not carry")
    batch, heads, n_q, _ = q.shape
    k, v = expand_kv(k, heads), expand_kv(v, heads)
    device, off, n_k = q.device, mask.offset, mask.n_k
    n_sink = mask.n_sink if window is not None else 0
    span = n_k if window is None or not mask.causal else min(n_k, CAP_BLOCK + window + n_sink)
    block = max(1, min(CAP_BLOCK, CAP_TILE // max(1, batch * heads * span)))
    out = torch.empty(*q.shape[:-1], v.shape[-1], dtype=q.dtype, device=device)
    for s in range(0, n_q, block):
        e = min(n_q, s + block)
        if mask.explicit is not None:  # which keys each query sees, given outright: every key
            ks, vs = k, v
            ok = mask.explicit[:, :, s:e].to(device)
        else:
            lo = 0 if window is None else max(0, off + s - window + 1)
            hi = off + e if mask.causal else n_k
            k_pos = torch.arange(lo, hi, device=device)
            ks, vs = k[:, :, lo:hi], v[:, :, lo:hi]
            sinks = min(n_sink, lo)
            if sinks:  # StreamingLLM's sink keys left of the block's reach
                k_pos = torch.cat([torch.arange(sinks, device=device), k_pos])
                ks, vs = torch.cat([k[:, :, :sinks], ks], 2), torch.cat([v[:, :, :sinks], vs], 2)
            ok = mask.pairs(torch.arange(off + s, off + e, device=device), k_pos, window, sink_limit,
                            alibi_slopes, torch.float32)
        scores = soft_cap(torch.matmul(q[:, :, s:e], ks.transpose(-1, -2)).float() * scale, softcap)
        scores = scores.masked_fill(~ok, float("-inf")) if ok.dtype == torch.bool else scores + ok
        if sink_logits is None:
            weights = torch.softmax(scores, dim=-1)
        else:
            weights = torch.softmax(with_sink_column(scores, sink_logits), dim=-1)[..., :-1]
        out[:, :, s:e] = torch.matmul(weights.to(vs.dtype), vs)
    return out


def instrumented_attention(q, k, v, mask, scoring: Scoring, *, scores_hook=None, pattern_hook=None, sink_limit=None):
    """Explicit attention. Scores handed to `scores_hook` are already masked (-inf where a key is not
    visible), as in TransformerLens, so cached scores are the same tensors TransformerLens shows; with
    `scoring.softcap` they are the capped scores, as TransformerLens hands them (its Gemma 2 caps, then masks,
    then calls hook_attn_scores). Softmax runs in float32 (scores and pattern are float32 for
    half-precision inputs). Learned sink logits (`scoring.sink_logits` [head]) join each row's softmax as one
    more column after `scores_hook` and leave before `pattern_hook`, as Hugging Face's eager gpt-oss and
    TransformerLens's bridge show them: the pattern's rows then sum to less than 1."""
    scoring = _resolved(scoring, q)
    scale, window, alibi_slopes = scoring.scale, scoring.window, scoring.alibi_slopes
    softcap, sink_logits = scoring.softcap, scoring.sink_logits
    k, v = expand_kv(k, q.shape[1]), expand_kv(v, q.shape[1])
    scores = torch.matmul(q, k.transpose(-1, -2)).float() * scale
    if softcap is not None:
        scores = soft_cap(scores, softcap)
    if alibi_slopes is None and mask.is_plain(window) and not (mask.causal and mask.n_q > 1):
        pass  # nothing is masked (single decoding step without padding, or bidirectional)
    elif alibi_slopes is None:
        scores = scores.masked_fill(~mask.visible(window, q.device, sink_limit), float("-inf"))
    else:
        scores = scores + mask.bias(window, alibi_slopes, torch.float32, q.device, sink_limit)
    if scores_hook is not None:
        scores = scores_hook(scores)
    if sink_logits is None:
        pattern = torch.softmax(scores, dim=-1)
    else:
        pattern = torch.softmax(with_sink_column(scores, sink_logits), dim=-1)[..., :-1]
    if pattern_hook is not None:
        pattern = pattern_hook(pattern)
    return torch.matmul(pattern.to(v.dtype), v)


@dataclass(frozen=True)
class Needs:
    """What one attention call asks of a backend; `choose` matches it against capabilities."""

    pattern: bool = False  # scores / pattern handed to hooks (hook_attn_scores, hook_pattern)
    window: bool = False  # a sliding window
    sinks: bool = False  # StreamingLLM sink keys kept past the window
    alibi: bool = False
    softcap: bool = False  # soft-capped scores (Gemma 2)
    sink_logits: bool = False  # learned sink logits in the softmax denominator (gpt-oss)
    device: str = "cpu"


@dataclass(frozen=True)
class AttentionBackend:
    """A registered backend and what it can do. The model chooses a layer's backend from these
    capabilities (`choose`), never from backend names: a layer whose scores or pattern are hooked
    needs one that `gives_pattern`, a windowed layer one with `windows`, and so on; otherwise the
    fastest (the first registered) that can run it."""

    name: str
    fn: AttentionFn
    gives_pattern: bool  # hands scores and pattern to hooks (which may replace them)
    materialises: bool  # builds the [q, k] pattern (memory O(n^2) per head): reported, never required
    windows: bool = True  # sliding windows
    sinks: bool = True  # StreamingLLM sink keys past a window
    alibi: bool = True
    softcap: bool = False  # soft-capped scores (`Scoring.softcap`); a backend says it can
    sink_logits: bool = False  # learned sink logits (`Scoring.sink_logits`); a backend says it can
    devices: tuple[str, ...] = ("cpu", "cuda", "mps")

    def __call__(self, *args, **kwargs) -> Tensor:
        return self.fn(*args, **kwargs)

    def cannot(self, needs: Needs) -> list[str]:
        """What of `needs` this backend cannot do, in words (empty: it can run the call)."""
        missing = []
        if needs.pattern and not self.gives_pattern:
            missing.append(_NO_PATTERN)
        if needs.window and not self.windows:
            missing.append("a sliding window")
        if needs.sinks and not self.sinks:
            missing.append("sink keys past a window")
        if needs.alibi and not self.alibi:
            missing.append("ALiBi biases")
        if needs.softcap and not self.softcap:
            missing.append("soft-capped attention scores")
        if needs.sink_logits and not self.sink_logits:
            missing.append("learned sink logits")
        if needs.device not in self.devices:
            missing.append(f"the {needs.device} device")
        return missing


_NO_PATTERN = "scores or patterns for hook_attn_scores / hook_pattern (it never materialises them)"


def unavailable(name: str, missing: list[str], where: str = "") -> str:
    """The one message for a backend asked for something it cannot do (a forced fused layer whose
    pattern is hooked, ...), with the way out."""
    return (f"{where + ' is forced to' if where else 'asked for'} the {name} attention backend, which cannot give "
            f"{' and '.join(missing)}; use model.attention('auto') (the default: chosen by capability) or "
            "model.attention('instrumented')")


ATTENTION_BACKENDS: dict[str, AttentionBackend] = {  # in order of preference when nothing is hooked
    "fused": AttentionBackend("fused", fused_attention, gives_pattern=False, materialises=False, softcap=True,
                              sink_logits=True),
    "instrumented": AttentionBackend("instrumented", instrumented_attention, gives_pattern=True, materialises=True,
                                     softcap=True, sink_logits=True),
}
BACKEND_CHOICES = ("auto", *ATTENTION_BACKENDS)  # what a layer may be set to
BackendChoice = str  # "auto" or a name registered in ATTENTION_BACKENDS (BACKEND_CHOICES)


def get_backend(name: str) -> AttentionBackend:
    try:
        return ATTENTION_BACKENDS[name]
    except KeyError:
        raise ValueError(f"unknown attention backend {name!r}; choose one of {sorted(ATTENTION_BACKENDS)}") from None


def choose(requested: str, needs: Needs, where: str = "") -> AttentionBackend:
    """The backend a call runs: with "auto", the first registered backend whose capabilities cover
    `needs`; with a registered name, that backend, or an error naming what it cannot do (`where`,
    e.g. "layer 3", says who asked)."""
    if requested != "auto":
        backend = get_backend(requested)
        missing = backend.cannot(needs)
        if missing:
            raise RuntimeError(unavailable(backend.name, missing, where))
        return backend
    for backend in ATTENTION_BACKENDS.values():
        if not backend.cannot(needs):
            return backend
    raise RuntimeError(f"no registered attention backend can run {needs}")  # pragma: no cover
