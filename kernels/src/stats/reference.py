"""The oracle of the streaming statistics: the whole pattern, materialised in float64, then summed.

Scores -> mask -> softmax over every (query, key) pair, and TransformerLens's detection patterns
(previous, duplicate, induction) written out as matrices: O(n^2) memory, for checking the streaming
kernels (the tests, `interp doctor`), never for analysis. Written independently of the kernels' masks
(no `visibility.visible`), so an error there cannot hide in both. It takes the layer's `Scoring` as the
routes do.
"""

from __future__ import annotations

import torch

from .scoring import Scoring
from .separable import SEPARABLE

__all__ = ["duplicate_detection_pattern", "induction_detection_pattern", "previous_detection_pattern",
           "reference_stats"]


def duplicate_detection_pattern(tokens: torch.Tensor) -> torch.Tensor:
    """TransformerLens ``get_duplicate_token_head_detection_pattern``, batched: [b, n, n]."""
    eq = (tokens[:, :, None] == tokens[:, None, :]).double()
    eq.diagonal(dim1=1, dim2=2).zero_()  # a token is not a duplicate of itself
    return torch.tril(eq)


def induction_detection_pattern(tokens: torch.Tensor) -> torch.Tensor:
    """TransformerLens ``get_induction_head_detection_pattern``, batched: [b, n, n]."""
    shifted = torch.roll(duplicate_detection_pattern(tokens), shifts=1, dims=-1)
    shifted[:, :, 0] = 0  # the roll wrapped the last column around
    return torch.tril(shifted)


def previous_detection_pattern(n: int) -> torch.Tensor:
    """TransformerLens ``get_previous_token_head_detection_pattern``: [n, n]."""
    pattern = torch.zeros(n, n, dtype=torch.float64)
    pattern[1:, :-1] = torch.eye(n - 1, dtype=torch.float64)
    return torch.tril(pattern)


def reference_stats(q, k, tokens=None, scoring: Scoring | None = None, *, n_sink=1, key_padding_mask=None,
                    **old) -> dict[str, torch.Tensor]:
    """Statistics from the materialised float64 pattern, on the host; [batch, heads, n_q] each, float64:
    the seven built-in ones and every added separable one (`kernels/src/stats/separable.py`). Arguments as
    :func:`interp.kernels.attention_stats` (the old geometry keywords fold into `scoring`)."""
    scoring = Scoring.of(scoring)
    q, k = q.detach().cpu(), k.detach().cpu()
    tokens = None if tokens is None else tokens.cpu()
    key_padding_mask = None if key_padding_mask is None else key_padding_mask.cpu()
    batch, heads, n_q, d = q.shape
    n_k = k.shape[2]
    pattern, delta = _pattern(q, k, scoring, key_padding_mask)
    rows = slice(n_k - n_q, n_k)  # detection patterns are [n_k, n_k]; take the query rows
    out = {
        "sink": pattern[..., :n_sink].sum(-1),
        "previous": (pattern * previous_detection_pattern(n_k)[rows]).sum(-1),
        "entropy": -torch.special.xlogy(pattern, pattern).sum(-1),
        "max": pattern.amax(-1),
        "distance": (pattern * delta).sum(-1),
    }
    if tokens is None:
        out["duplicate"] = out["induction"] = torch.full_like(out["sink"], float("nan"))
    else:
        out["duplicate"] = (pattern * duplicate_detection_pattern(tokens)[:, None, rows]).sum(-1)
        out["induction"] = (pattern * induction_detection_pattern(tokens)[:, None, rows]).sum(-1)
    for name, stat in SEPARABLE.items():  # sum_j P_ij f(j), the column written out
        if tokens is None and stat.needs_tokens:
            out[name] = torch.full_like(out["sink"], float("nan"))
            continue
        column = torch.as_tensor(stat.column(torch.arange(n_k), tokens), dtype=torch.float64)
        out[name] = (pattern * column.expand(batch, n_k)[:, None, None, :]).sum(-1)
    return out


def _pattern(q, k, scoring: Scoring, key_padding_mask) -> tuple[torch.Tensor, torch.Tensor]:
    """The float64 pattern [batch, heads, n_q, n_k] (NaN rows where a query sees no key) and p - j."""
    batch, heads, n_q, d = q.shape
    kv_heads, n_k = k.shape[1], k.shape[2]
    scale = d**-0.5 if scoring.scale is None else scoring.scale
    softcap = scoring.softcap
    k_full = k.double().repeat_interleave(heads // kv_heads, dim=1)
    scores = q.double() @ k_full.transpose(-1, -2) * scale  # [b, h, n_q, n_k]
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    pos = torch.arange(n_k - n_q, n_k)[:, None]
    key = torch.arange(n_k)[None, :]
    delta = (pos - key).double()  # p - j
    if scoring.alibi_slopes is not None:
        scores = scores - scoring.alibi_slopes.detach().cpu().double()[:, None, None] * delta.abs()
    visible = torch.ones(batch, 1, n_q, n_k, dtype=torch.bool)
    if scoring.causal:
        visible &= key <= pos
    if scoring.window is not None:
        visible &= (pos - key) < scoring.window
    if key_padding_mask is not None:
        visible &= key_padding_mask[:, None, None, :]
    scores = scores.masked_fill(~visible, float("-inf"))
    if scoring.sink_logits is None:
        return torch.softmax(scores, dim=-1), delta  # NaN rows if none
    # one more column per head in every softmax, dropped after: rows sum to < 1
    sinks = scoring.sink_logits.detach().cpu().double()[None, :, None, None].expand(batch, heads, n_q, 1)
    pattern = torch.softmax(torch.cat([scores, sinks], dim=-1), dim=-1)[..., :-1]
    return pattern.masked_fill(~visible.any(-1, keepdim=True), float("nan")), delta  # no key seen: NaN, as without
