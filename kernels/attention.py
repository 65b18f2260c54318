"""Attention backends: one signature, a registry, and what each backend can give.

    fused        torch SDPA (FlashAttention / memory-efficient / cuDNN on GPU, flash on CPU).
                 Gives the output only; never materialises the [q, k] pattern.
    instrumented explicit scores -> hook_attn_scores -> softmax -> hook_pattern -> z.
                 Gives scores and pattern to hooks, which may read or replace them.

Both take `q: [batch, head, q, d_head]`, `k, v: [batch, kv_head, k, d_head]` (GQA: head h reads kv
head h // (head // kv_head)) and an `AttentionMask`, and return `z: [batch, head, q, d_head]`.

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

from dataclasses import dataclass, field
from typing import Callable, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor

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
                 (a KV cache whose heads hold different tokens, `models.kv_cache_policy`); the
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
        *,
        scale: float,
        window: int | None = None,
        alibi_slopes: Tensor | None = None,
        scores_hook: TensorHook | None = None,
        pattern_hook: TensorHook | None = None,
        sink_limit: int | None = None,
    ) -> Tensor: ...


def _expand_kv(x: Tensor, n_heads: int) -> Tensor:
    """[batch, kv_head, k, d] -> [batch, head, k, d] by repeating each kv-head for its group."""
    groups = n_heads // x.shape[1]
    if groups == 1:
        return x
    b, kv, n, d = x.shape
    return x[:, :, None].expand(b, kv, groups, n, d).reshape(b, kv * groups, n, d)


def fused_attention(q, k, v, mask, *, scale, window=None, alibi_slopes=None, scores_hook=None, pattern_hook=None,
                    sink_limit=None):
    """torch SDPA. Cannot hand scores or patterns to hooks: asking for them is an error."""
    if scores_hook is not None or pattern_hook is not None:  # called directly, past `choose`
        raise RuntimeError(unavailable("fused", [_NO_PATTERN]))
    gqa = {}
    if k.shape[1] != q.shape[1] and q.device.type == "cpu":
        # GQA on the CPU: SDPA reads each kv-head for its group itself, without the copy of the expanded
        # keys/values (2-3x faster attention when decoding from a KV cache). On CUDA the expansion stays:
        # not every fused kernel takes enable_gqa, and the fallback would materialise the pattern.
        gqa = {"enable_gqa": True}
    else:
        k, v = _expand_kv(k, q.shape[1]), _expand_kv(v, q.shape[1])
    if alibi_slopes is None and mask.is_plain(window):
        causal = mask.causal and mask.n_q == mask.n_k and mask.n_q > 1
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale, **gqa)
    if banded(mask, window):
        return _banded_attention(q, k, v, mask, scale=scale, window=window, alibi_slopes=alibi_slopes,
                                 sink_limit=sink_limit, gqa=gqa)
    if alibi_slopes is None:
        attn_mask = mask.visible(window, q.device, sink_limit)
    else:
        attn_mask = mask.bias(window, alibi_slopes, q.dtype, q.device, sink_limit)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, scale=scale, **gqa)


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


def _banded_attention(q, k, v, mask: AttentionMask, *, scale, window, alibi_slopes, sink_limit, gqa):
    """SDPA band by band: queries [s, e) see keys [p0 - window + 1, p1) (their window) plus the
    StreamingLLM sink keys before it; the band's mask is `AttentionMask.pairs` on those pairs, so
    the output equals the whole-mask call's (same keys, same softmax) up to float round-off."""
    band = max(window, BAND_MIN)
    device, off = q.device, mask.offset
    out = torch.empty_like(q)
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
        out[:, :, s:e] = F.scaled_dot_product_attention(q[:, :, s:e], ks, vs, attn_mask=attn_mask, scale=scale, **gqa)
    return out


def instrumented_attention(q, k, v, mask, *, scale, window=None, alibi_slopes=None, scores_hook=None,
                           pattern_hook=None, sink_limit=None):
    """Explicit attention. Scores handed to `scores_hook` are already masked (-inf where a key is not
    visible), as in TransformerLens, so cached scores are the same tensors TransformerLens shows.
    Softmax runs in float32 (scores and pattern are float32 for half-precision inputs)."""
    k, v = _expand_kv(k, q.shape[1]), _expand_kv(v, q.shape[1])
    scores = torch.matmul(q, k.transpose(-1, -2)).float() * scale
    if alibi_slopes is None and mask.is_plain(window) and not (mask.causal and mask.n_q > 1):
        pass  # nothing is masked (single decoding step without padding, or bidirectional)
    elif alibi_slopes is None:
        scores = scores.masked_fill(~mask.visible(window, q.device, sink_limit), float("-inf"))
    else:
        scores = scores + mask.bias(window, alibi_slopes, torch.float32, q.device, sink_limit)
    if scores_hook is not None:
        scores = scores_hook(scores)
    pattern = torch.softmax(scores, dim=-1)
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
    "fused": AttentionBackend("fused", fused_attention, gives_pattern=False, materialises=False),
    "instrumented": AttentionBackend("instrumented", instrumented_attention, gives_pattern=True, materialises=True),
}
BACKEND_CHOICES = ("auto", *ATTENTION_BACKENDS)  # what a layer may be set to


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
