"""The oracle of the streaming statistics: the whole pattern, materialised in float64, then summed.

Scores -> mask -> softmax over every (query, key) pair, and TransformerLens's detection patterns
(previous, duplicate, induction) written out as matrices: O(n^2) memory, for checking the streaming
kernels (the tests, `interp doctor`), never for analysis. Written independently of the kernels' masks
(no `visibility.visible`), so an error there cannot hide in both.
"""

from __future__ import annotations

import torch

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


def reference_stats(
    q, k, tokens=None, *, n_sink=1, causal=True, window=None, scale=None,
    key_padding_mask=None, alibi_slopes=None, softcap=None, sink_logits=None,
) -> dict[str, torch.Tensor]:
    """Statistics from the materialised float64 pattern, on the host; [batch, heads, n_q] each, float64.
    Arguments as :func:`interp.kernels.attention_stats`."""
    q, k = q.detach().cpu(), k.detach().cpu()
    tokens = None if tokens is None else tokens.cpu()
    key_padding_mask = None if key_padding_mask is None else key_padding_mask.cpu()
    alibi_slopes = None if alibi_slopes is None else alibi_slopes.cpu()
    batch, heads, n_q, d = q.shape
    kv_heads, n_k = k.shape[1], k.shape[2]
    scale = d**-0.5 if scale is None else scale
    k_full = k.double().repeat_interleave(heads // kv_heads, dim=1)
    scores = q.double() @ k_full.transpose(-1, -2) * scale  # [b, h, n_q, n_k]
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    pos = torch.arange(n_k - n_q, n_k)[:, None]
    key = torch.arange(n_k)[None, :]
    delta = (pos - key).double()  # p - j
    if alibi_slopes is not None:
        scores = scores - alibi_slopes.double()[:, None, None] * delta.abs()
    visible = torch.ones(batch, 1, n_q, n_k, dtype=torch.bool)
    if causal:
        visible &= key <= pos
    if window is not None:
        visible &= (pos - key) < window
    if key_padding_mask is not None:
        visible &= key_padding_mask[:, None, None, :]
    scores = scores.masked_fill(~visible, float("-inf"))
    if sink_logits is None:
        pattern = torch.softmax(scores, dim=-1)  # NaN rows if none
    else:  # one more column per head in every softmax, dropped after: rows sum to < 1
        sinks = sink_logits.detach().cpu().double()[None, :, None, None].expand(batch, heads, n_q, 1)
        pattern = torch.softmax(torch.cat([scores, sinks], dim=-1), dim=-1)[..., :-1]
        pattern = pattern.masked_fill(~visible.any(-1, keepdim=True), float("nan"))  # no key seen: NaN, as without

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
    return out
