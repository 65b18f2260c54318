"""What the two streaming-statistics kernels share: the statistics' names and order, the base-2
constant of their exponentials, the validation of their arguments and the result type.

`kernels/stats.py` (the torch tiles, and the entry point `attention_stats`) and
`kernels/stats_triton.py` (the GPU kernel) both import this module and never each other at import
time: the entry point imports the Triton kernel only when asked for it (Triton is optional).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

import torch
from torch import Tensor

__all__ = ["AttentionStats", "LOG2E", "STAT_NAMES", "validate"]

#: Order of the statistics in :class:`AttentionStats` and in the stacked kernel output.
STAT_NAMES = ("sink", "previous", "duplicate", "induction", "entropy", "max", "distance")

LOG2E = 1.4426950408889634  # scores are kept in base 2: exp(x) = exp2(x * log2 e)


# --------------------------------------------------------------------------------------------
# Result type
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True, eq=False, repr=False)
class AttentionStats:
    """Per-query attention statistics, each a float32 tensor ``[batch, heads, n_q]``.

    All are means under the query's attention weights ``P[b, h, i, :]`` (so in ``[0, 1]``,
    except ``entropy`` in nats, ``max`` in ``(0, 1]`` and ``distance`` in positions):

    Attributes:
        sink: mass on the first ``n_sink`` keys.
        previous: mass on key ``p - 1`` (the previous token).
        duplicate: mass on earlier keys holding the query's token. NaN when no tokens given.
        induction: mass on keys right after an earlier occurrence of the query's token
            (``tok[j - 1] == tok[p]``, ``1 <= j <= p``). NaN when no tokens given.
        entropy: ``-sum_j P log P`` in nats, computed as ``lse - sum_j P s`` in the form
            ``log l - sum_j P (s - m)`` (centred on the running max, so large scores lose no
            precision).
        max: the largest attention weight.
        distance: mean of ``p - j`` (negative weight on future keys when not causal).

    A query that sees no key at all (a left-padding position under a causal mask) has NaN in
    every statistic; :meth:`mean` skips NaNs.
    """

    sink: Tensor
    previous: Tensor
    duplicate: Tensor
    induction: Tensor
    entropy: Tensor
    max: Tensor
    distance: Tensor

    @classmethod
    def from_stacked(cls, stacked: Tensor) -> "AttentionStats":
        """Build from a ``[len(STAT_NAMES), batch, heads, n_q]`` tensor (the kernels' output)."""
        return cls(**dict(zip(STAT_NAMES, stacked.unbind(0))))

    @property
    def shape(self) -> torch.Size:
        """``[batch, heads, n_q]``, shared by every statistic."""
        return self.sink.shape

    def to_dict(self) -> dict[str, Tensor]:
        """``{name: [batch, heads, n_q] tensor}`` in :data:`STAT_NAMES` order."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def stack(self) -> Tensor:
        """All statistics as one ``[len(STAT_NAMES), batch, heads, n_q]`` tensor."""
        return torch.stack([getattr(self, name) for name in STAT_NAMES])

    def mean(self, query_mask: Tensor | None = None, *, reduce_batch: bool = False) -> dict[str, Tensor]:
        """Per-head means over valid queries, NaN-aware.

        Args:
            query_mask: optional bool ``[batch, n_q]`` or ``[n_q]``; True keeps the query (e.g.
                real tokens, or positions in the second half of a repeated sequence).
                Queries with a NaN statistic (no visible key; no tokens) are always skipped.
            reduce_batch: False gives ``[batch, heads]`` per statistic; True pools the valid
                queries of every sequence and gives ``[heads]`` (a mean over queries, not a
                mean of per-sequence means).

        Returns:
            ``{name: tensor}``; a head with no valid query gets NaN.
        """
        batch, heads, n_q = self.shape
        keep = torch.ones(batch, n_q, dtype=torch.bool, device=self.sink.device)
        if query_mask is not None:
            query_mask = torch.as_tensor(query_mask, device=keep.device)
            if query_mask.dtype != torch.bool or query_mask.shape not in ((batch, n_q), (n_q,)):
                raise ValueError(
                    f"query_mask must be bool [batch, n_q] = [{batch}, {n_q}] or [n_q]; "
                    f"got {query_mask.dtype} {tuple(query_mask.shape)}"
                )
            keep = keep & query_mask
        keep = keep[:, None, :]  # [batch, 1, n_q]
        dims = (0, 2) if reduce_batch else (2,)
        means = {}
        for name, value in self.to_dict().items():
            valid = keep & ~value.isnan()
            total = torch.where(valid, value, 0.0).sum(dims)
            means[name] = total / valid.sum(dims)  # 0 / 0 -> NaN for a head with no valid query
        return means

    def __repr__(self) -> str:
        batch, heads, n_q = self.shape
        means = self.mean(reduce_batch=True)
        shown = min(heads, 8)
        n_nan = int(self.entropy.isnan().sum())
        lines = [
            f"AttentionStats(batch={batch}, heads={heads}, n_q={n_q}, float32 [batch, heads, n_q];",
            f"  queries with no visible key (NaN): {n_nan} of {batch * n_q * heads} (query, head)",
            "  mean over valid queries, per head:",
            "  " + " " * 10 + "".join(f"{'h' + str(h):>8}" for h in range(shown))
            + (" ..." if heads > shown else ""),
        ]
        for name, value in means.items():
            cells = "".join(f"{v:8.3f}" for v in value[:shown].tolist())
            lines.append(f"  {name:<10}{cells}" + (" ..." if heads > shown else ""))
        return "\n".join(lines) + ")"


def validate(q, k, tokens, n_sink, window, scale, key_padding_mask, alibi_slopes, softcap=None) -> dict:
    """Check shapes and dtypes; return the normalised keyword arguments of the kernels."""
    if not (isinstance(q, Tensor) and isinstance(k, Tensor)):
        raise TypeError(f"q and k must be tensors, got {type(q).__name__} and {type(k).__name__}")
    if q.ndim != 4 or k.ndim != 4:
        raise ValueError(
            f"q must be [batch, heads, n_q, d] and k [batch, kv_heads, n_k, d]; "
            f"got q {tuple(q.shape)} and k {tuple(k.shape)}"
        )
    if not (q.is_floating_point() and k.is_floating_point()):
        raise TypeError(f"q and k must be floating point, got {q.dtype} and {k.dtype}")
    if q.device != k.device:
        raise ValueError(f"q and k are on different devices: {q.device} and {k.device}")
    batch, heads, n_q, d = q.shape
    batch_k, kv_heads, n_k, d_k = k.shape
    if batch != batch_k or d != d_k:
        raise ValueError(
            f"q [batch, heads, n_q, d] = {list(q.shape)} and k [batch, kv_heads, n_k, d] = "
            f"{list(k.shape)} must agree on batch and d"
        )
    if kv_heads == 0 or heads % kv_heads:
        raise ValueError(
            f"heads ({heads}, q {list(q.shape)}) must be a multiple of kv_heads "
            f"({kv_heads}, k {list(k.shape)})"
        )
    if n_q > n_k:
        raise ValueError(
            f"queries must be a suffix of the keys (n_q <= n_k); got q {list(q.shape)} "
            f"with n_q={n_q} and k {list(k.shape)} with n_k={n_k}"
        )
    if tokens is not None:
        if not isinstance(tokens, Tensor):
            raise TypeError(f"tokens must be an int tensor [batch, n_k], got {type(tokens).__name__}")
        if tokens.is_floating_point() or tokens.is_complex() or tokens.dtype == torch.bool:
            raise TypeError(f"tokens must be an integer tensor, got dtype {tokens.dtype}")
        if tuple(tokens.shape) != (batch, n_k):
            raise ValueError(
                f"tokens must be [batch, n_k] = [{batch}, {n_k}] (one id per key; k is "
                f"{list(k.shape)}), got {list(tokens.shape)}"
            )
        tokens = tokens.to(q.device)
    if key_padding_mask is not None:
        if not isinstance(key_padding_mask, Tensor) or key_padding_mask.dtype != torch.bool:
            raise TypeError("key_padding_mask must be a bool tensor [batch, n_k] (True = real token)")
        if tuple(key_padding_mask.shape) != (batch, n_k):
            raise ValueError(
                f"key_padding_mask must be [batch, n_k] = [{batch}, {n_k}] (k is {list(k.shape)}), "
                f"got {list(key_padding_mask.shape)}"
            )
        key_padding_mask = key_padding_mask.to(q.device)
    if alibi_slopes is not None:
        if not isinstance(alibi_slopes, Tensor) or tuple(alibi_slopes.shape) != (heads,):
            shape = list(alibi_slopes.shape) if isinstance(alibi_slopes, Tensor) else type(alibi_slopes).__name__
            raise ValueError(f"alibi_slopes must be a tensor [heads] = [{heads}] (q is {list(q.shape)}), got {shape}")
        alibi_slopes = alibi_slopes.to(device=q.device, dtype=torch.float32)
    if isinstance(n_sink, bool) or not isinstance(n_sink, int) or n_sink < 0:
        raise ValueError(f"n_sink must be an int >= 0, got {n_sink!r}")
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise ValueError(f"window must be None or an int >= 1, got {window!r}")
    if softcap is not None and (isinstance(softcap, bool) or not isinstance(softcap, (int, float))
                                or not math.isfinite(softcap) or softcap <= 0):
        raise ValueError(f"softcap must be None or a finite number > 0, got {softcap!r}")
    return dict(
        tokens=tokens,
        n_sink=n_sink,
        window=window,
        scale=1.0 / math.sqrt(d) if scale is None else float(scale),
        key_padding_mask=key_padding_mask,
        alibi_slopes=alibi_slopes,
        softcap=None if softcap is None else float(softcap),
    )
