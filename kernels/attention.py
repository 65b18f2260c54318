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
from typing import Callable, Literal, Protocol

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
                 2023); 0 (the default) keeps the plain window.

    Boolean masks and ALiBi biases are built lazily, once per (window, slopes), and reused by every
    layer of the forward pass.
    """

    n_q: int
    n_k: int
    key_valid: Tensor | None = None
    causal: bool = True
    n_sink: int = 0
    _cache: dict = field(default_factory=dict, repr=False)

    @property
    def offset(self) -> int:
        return self.n_k - self.n_q

    def is_plain(self, window: int | None) -> bool:
        """True when SDPA's own `is_causal` (or no mask at all) expresses the mask exactly."""
        if self.key_valid is not None:
            return False
        if window is not None and window < self.n_k:
            return False
        return not self.causal or self.n_q == self.n_k or self.n_q == 1

    def visible(self, window: int | None, device: torch.device) -> Tensor:  # noqa: F811 (method)
        """bool [batch or 1, 1, n_q, n_k]: True where the query may attend to the key."""
        key = ("visible", window, device)
        if key not in self._cache:
            q_pos = torch.arange(self.offset, self.n_k, device=device)[:, None]
            k_pos = torch.arange(self.n_k, device=device)[None, :]
            rel = q_pos - k_pos  # p - j
            sinks = (k_pos < self.n_sink) if self.n_sink else None
            ok = visible(rel, causal=self.causal, window=window, sink_key=sinks)[None, None]
            if self.key_valid is not None:
                ok = ok & self.key_valid[:, None, None, :].to(device)
                # A row with no visible key would give NaN; let it see its own position instead.
                own = (rel == 0)[None, None]
                ok = ok | (own & ~ok.any(-1, keepdim=True))
            self._cache[key] = ok
        return self._cache[key]

    def bias(self, window: int | None, slopes: Tensor | None, dtype: torch.dtype, device) -> Tensor:
        """float [batch or 1, head or 1, n_q, n_k]: 0 / -inf mask plus the ALiBi bias -slope * (p - j)."""
        # Keyed by the slope values: every layer holds its own (equal) buffer, and one bias serves all.
        key = ("bias", window, None if slopes is None else tuple(slopes.tolist()), dtype, device)
        if key not in self._cache:
            ok = self.visible(window, device)
            out = torch.zeros(ok.shape, dtype=dtype, device=device).masked_fill(~ok, float("-inf"))
            if slopes is not None:
                q_pos = torch.arange(self.offset, self.n_k, device=device)[:, None]
                k_pos = torch.arange(self.n_k, device=device)[None, :]
                rel = (q_pos - k_pos).abs().to(dtype)
                out = out - slopes.to(device=device, dtype=dtype)[None, :, None, None] * rel
            self._cache[key] = out
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
    ) -> Tensor: ...


def _expand_kv(x: Tensor, n_heads: int) -> Tensor:
    """[batch, kv_head, k, d] -> [batch, head, k, d] by repeating each kv-head for its group."""
    groups = n_heads // x.shape[1]
    if groups == 1:
        return x
    b, kv, n, d = x.shape
    return x[:, :, None].expand(b, kv, groups, n, d).reshape(b, kv * groups, n, d)


def fused_attention(q, k, v, mask, *, scale, window=None, alibi_slopes=None, scores_hook=None, pattern_hook=None):
    """torch SDPA. Cannot hand scores or patterns to hooks: asking for them is an error."""
    if scores_hook is not None or pattern_hook is not None:
        raise RuntimeError(
            "the fused attention backend never materialises scores or patterns, so hook_attn_scores / "
            "hook_pattern cannot run; use model.attention('instrumented') or the default 'auto' backend"
        )
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
    if alibi_slopes is None:
        attn_mask = mask.visible(window, q.device)
    else:
        attn_mask = mask.bias(window, alibi_slopes, q.dtype, q.device)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, scale=scale, **gqa)


def instrumented_attention(q, k, v, mask, *, scale, window=None, alibi_slopes=None, scores_hook=None, pattern_hook=None):
    """Explicit attention. Scores handed to `scores_hook` are already masked (-inf where a key is not
    visible), as in TransformerLens, so cached scores are the same tensors TransformerLens shows.
    Softmax runs in float32 (scores and pattern are float32 for half-precision inputs)."""
    k, v = _expand_kv(k, q.shape[1]), _expand_kv(v, q.shape[1])
    scores = torch.matmul(q, k.transpose(-1, -2)).float() * scale
    if alibi_slopes is None and mask.is_plain(window) and not (mask.causal and mask.n_q > 1):
        pass  # nothing is masked (single decoding step without padding, or bidirectional)
    elif alibi_slopes is None:
        scores = scores.masked_fill(~mask.visible(window, q.device), float("-inf"))
    else:
        scores = scores + mask.bias(window, alibi_slopes, torch.float32, q.device)
    if scores_hook is not None:
        scores = scores_hook(scores)
    pattern = torch.softmax(scores, dim=-1)
    if pattern_hook is not None:
        pattern = pattern_hook(pattern)
    return torch.matmul(pattern.to(v.dtype), v)


@dataclass(frozen=True)
class AttentionBackend:
    """A registered backend and what it can give. The model chooses a layer's backend from these
    capabilities (`choose`), never from backend names: a layer whose scores or pattern are hooked
    needs one that `gives_pattern`; otherwise the fastest (the first registered) that can run it."""

    name: str
    fn: AttentionFn
    gives_pattern: bool  # hands scores and pattern to hooks (which may replace them)
    materialises: bool  # builds the [q, k] pattern (memory O(n^2) per head)
    windows: bool = True  # sliding windows
    sinks: bool = True  # StreamingLLM sink keys past a window
    alibi: bool = True
    devices: tuple[str, ...] = ("cpu", "cuda", "mps")

    def __call__(self, *args, **kwargs) -> Tensor:
        return self.fn(*args, **kwargs)


ATTENTION_BACKENDS: dict[str, AttentionBackend] = {  # in order of preference when nothing is hooked
    "fused": AttentionBackend("fused", fused_attention, gives_pattern=False, materialises=False),
    "instrumented": AttentionBackend("instrumented", instrumented_attention, gives_pattern=True, materialises=True),
}
BACKENDS = tuple(ATTENTION_BACKENDS)


def get_backend(name: str) -> AttentionBackend:
    try:
        return ATTENTION_BACKENDS[name]
    except KeyError:
        raise ValueError(f"unknown attention backend {name!r}; choose one of {sorted(ATTENTION_BACKENDS)}") from None


def choose(requested: str, *, needs_pattern: bool) -> AttentionBackend:
    """The backend a layer runs: `requested` ("auto" or a registered name); with "auto", the first
    registered backend that gives a pattern when one is needed, else the first of all."""
    if requested != "auto":
        return get_backend(requested)
    for backend in ATTENTION_BACKENDS.values():
        if backend.gives_pattern or not needs_pattern:
            return backend
    raise RuntimeError("no registered attention backend gives patterns")  # pragma: no cover
