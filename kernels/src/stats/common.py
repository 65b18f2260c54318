"""What the statistics routes share: the statistics' names and order, the base-2 constants of their
exponentials, the validation of their arguments and the result type.

The routes (`kernels/src/stats/fused.py`, `kernels/src/stats/tiles.py`, `kernels/src/stats/triton_kernel.py`) import
this module (and share pieces one way: the fused route's row-max pass reads the tiles' masked scores, the
Triton kernel the fused route's pairwise masses); the entry point (`kernels/src/stats/__init__.py`) imports
the Triton kernel only when asked for it (Triton is optional).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from .scoring import Scoring

__all__ = ["AttentionStats", "LN2", "LOG2E", "STAT_NAMES", "validate"]

#: Order of the statistics in :class:`AttentionStats` and in the stacked kernel output.
STAT_NAMES = ("sink", "previous", "duplicate", "induction", "entropy", "max", "distance")

LOG2E = 1.4426950408889634  # scores are kept in base 2: exp(x) = exp2(x * log2 e)
LN2 = 0.6931471805599453  # and back: ln x = log2 x * ln 2


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

        added: the added separable statistics that were asked for (`kernels/src/stats/separable.py`),
            by name; each is also an attribute (``stats.<name>``).

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
    added: dict[str, Tensor] = field(default_factory=dict)

    @classmethod
    def from_stacked(cls, stacked: Tensor, added: tuple[str, ...] = ()) -> "AttentionStats":
        """Build from a ``[len(STAT_NAMES) + len(added), batch, heads, n_q]`` tensor (the kernels' output:
        the built-in statistics, then the `added` ones in that order)."""
        rows = stacked.unbind(0)
        return cls(**dict(zip(STAT_NAMES, rows)), added=dict(zip(added, rows[len(STAT_NAMES):])))

    def __getattr__(self, name: str) -> Tensor:
        added = self.__dict__.get("added") or {}
        if name in added:
            return added[name]
        raise AttributeError(f"{type(self).__name__} has no statistic {name!r}")

    @property
    def shape(self) -> torch.Size:
        """``[batch, heads, n_q]``, shared by every statistic."""
        return self.sink.shape

    def to_dict(self) -> dict[str, Tensor]:
        """``{name: [batch, heads, n_q] tensor}`` in :data:`STAT_NAMES` order, then the added ones."""
        return {**{name: getattr(self, name) for name in STAT_NAMES}, **self.added}

    def stack(self) -> Tensor:
        """All statistics as one ``[len(STAT_NAMES) + len(added), batch, heads, n_q]`` tensor."""
        return torch.stack(list(self.to_dict().values()))

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


def validate(q, k, tokens, scoring: Scoring | None = None, *, n_sink: int = 1,
             key_padding_mask: Tensor | None = None) -> dict:
    """Check shapes and dtypes; return the routes' normalised keyword arguments: ``tokens``, ``n_sink``,
    ``key_padding_mask`` (on q's device) and ``scoring`` (:meth:`Scoring.checked`)."""
    scoring = Scoring.of(scoring)
    _check_qk(q, k)
    batch, n_k = q.shape[0], k.shape[2]
    tokens = _per_key("tokens", tokens, batch, n_k, k, q.device, "an integer",
                      lambda t: not (t.is_floating_point or t.is_complex or t == torch.bool))
    key_padding_mask = _per_key("key_padding_mask", key_padding_mask, batch, n_k, k, q.device,
                                "a bool", lambda t: t == torch.bool)
    if isinstance(n_sink, bool) or not isinstance(n_sink, int) or n_sink < 0:
        raise ValueError(f"n_sink must be an int >= 0, got {n_sink!r}")
    return dict(tokens=tokens, n_sink=n_sink, key_padding_mask=key_padding_mask,
                scoring=scoring.checked(q))


def _check_qk(q, k) -> None:
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


def _per_key(name, value, batch, n_k, k, device, kind, dtype_ok) -> Tensor | None:
    """One value per key ``[batch, n_k]`` (the tokens, the padding), checked and moved to `device`."""
    if value is None:
        return None
    if not isinstance(value, Tensor) or not dtype_ok(value.dtype):
        got = f"dtype {value.dtype}" if isinstance(value, Tensor) else type(value).__name__
        raise TypeError(f"{name} must be {kind} tensor [batch, n_k], got {got}")
    if tuple(value.shape) != (batch, n_k):
        raise ValueError(f"{name} must be [batch, n_k] = [{batch}, {n_k}] (one per key; k is {list(k.shape)}), "
                         f"got {list(value.shape)}")
    return value.to(device)
