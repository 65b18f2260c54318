"""How one attention layer scores a (query, key) pair: the `Scoring` every statistics route, the
float64 oracle and `validate` take, built once per layer (`attn.scoring`, `models/src/native/attention_layer.py`).

    score(p, j) = cap(scale * q_p . k_j) - slope_h * |p - j|     over the keys j the query at p sees
    P(p, j)     = exp(score) / (exp(sink_h) + sum_j' exp(score(p, j')))

``cap(x) = softcap * tanh(x / softcap)`` (Gemma 2; none when `softcap` is None), ``slope_h`` the
head's ALiBi slope (none when `alibi_slopes` is None), ``sink_h`` gpt-oss's learned sink logit (the
term is absent when `sink_logits` is None). Key j is visible to the query at p iff
``(not causal or j <= p) and (window is None or p - j < window)`` (`kernels/src/visibility.py`), and
real (the padding is the caller's, not the layer's).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["Scoring"]


@dataclass(frozen=True, eq=False)
class Scoring:
    """One attention layer's scores and which keys its queries see (see the module docstring).

    Attributes:
        scale: the score scale; None: ``1 / sqrt(d)`` of the queries it is used with.
        window: sliding window (key j visible only if ``p - j < window``); None for none.
        alibi_slopes: float ``[heads]``; adds ``-slope[h] * |p - j|`` to every score. None for none.
        softcap: Gemma 2's soft cap of the scaled scores (before ALiBi and the mask); None for none.
        sink_logits: float ``[heads]``, learned sink logits (gpt-oss): each joins its head's softmax
            denominator and is no key. None for none.
        causal: key j is visible only to queries at ``p >= j``.
    """

    scale: float | None = None
    window: int | None = None
    alibi_slopes: Tensor | None = None
    softcap: float | None = None
    sink_logits: Tensor | None = None
    causal: bool = True

    @classmethod
    def of(cls, scoring: "Scoring | None" = None) -> "Scoring":
        """`scoring`, or the default (causal, scale 1/sqrt(d)) for None; anything else is a TypeError."""
        if scoring is None:
            return cls()
        if not isinstance(scoring, cls):
            raise TypeError(f"scoring must be a Scoring (interp.kernels.Scoring), got {type(scoring).__name__}")
        return scoring

    def checked(self, q: Tensor) -> "Scoring":
        """Checked against queries ``q [batch, heads, n_q, d]`` and made ready for the kernels: the scale
        resolved, the slopes and sink logits float32 on q's device. Errors name the offending value."""
        heads, d = q.shape[1], q.shape[-1]
        window, softcap = self.window, self.softcap
        if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
            raise ValueError(f"window must be None or an int >= 1, got {window!r}")
        if softcap is not None and (isinstance(softcap, bool) or not isinstance(softcap, (int, float))
                                    or not math.isfinite(softcap) or softcap <= 0):
            raise ValueError(f"softcap must be None or a finite number > 0, got {softcap!r}")
        return dataclasses.replace(
            self,
            scale=1.0 / math.sqrt(d) if self.scale is None else float(self.scale),
            softcap=None if softcap is None else float(softcap),
            alibi_slopes=_per_head("alibi_slopes", self.alibi_slopes, q),
            sink_logits=_per_head("sink_logits", self.sink_logits, q, finite=True),
            causal=bool(self.causal),
        )




def _per_head(name: str, value, q: Tensor, finite: bool = False) -> Tensor | None:
    """A float ``[heads]`` tensor as float32 on q's device (detached); None stays None."""
    if value is None:
        return None
    heads = q.shape[1]
    if not isinstance(value, Tensor) or tuple(value.shape) != (heads,):
        shape = list(value.shape) if isinstance(value, Tensor) else type(value).__name__
        raise ValueError(f"{name} must be a tensor [heads] = [{heads}] (q is {list(q.shape)}), got {shape}")
    if finite and not bool(torch.isfinite(value).all()):
        raise ValueError(f"{name} must be finite")
    return value.detach().to(device=q.device, dtype=torch.float32)
