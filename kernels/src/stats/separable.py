"""Separable statistics that anyone can add: the row's weighted sum of a function of the key alone.

A separable statistic is ``sum_j P_ij f(j)`` for a column ``f`` over the keys (DESIGN.md, "Streaming
attention statistics"): the pattern applied to one more value column. So a new one is a name and its
column, registered once::

    register(Separable("even_keys", lambda j, tokens: (j % 2 == 0).float()))

and every route that computes separable statistics computes it too: the fused route carries the column
in its value matrix ``[K | position | sink | f ...]``, the torch tiles accumulate ``P f`` in every tile,
and the float64 oracle (`kernels/src/stats/reference.py`) sums the materialised pattern times the column.
The Triton kernel has a fixed set of accumulators: it refuses an added statistic (``"auto"`` runs the
torch tiles instead). `tests/kernels/test_stat_plugin.py` adds one in the test file and holds it to the oracle.

A registered statistic is computed whenever it is named in ``attention_stats(..., stats=[...])`` (and by
default, with the seven built-in ones) and read back as ``stats.<name>`` or ``stats.to_dict()[name]``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

from .common import STAT_NAMES

__all__ = ["SEPARABLE", "Separable", "check_stats", "columns", "register", "unregister"]

Column = Callable[[Tensor, "Tensor | None"], Tensor]


@dataclass(frozen=True)
class Separable:
    """One separable statistic, ``sum_j P_ij column(j)``.

    Attributes:
        name: how it is asked for (``stats=[name]``) and read (``result.<name>``); not a built-in's name.
        column: ``(j long [m] key positions, tokens int [batch, n_k] or None) -> float`` broadcastable to
            ``[batch, m]`` (or ``[m]``): the value of each of the keys ``j``. It must not depend on the
            query (that is what makes it separable).
        needs_tokens: without tokens the statistic is NaN (as duplicate and induction are).
    """

    name: str
    column: Column
    needs_tokens: bool = False


#: The added separable statistics, by name, in the order they were registered.
SEPARABLE: dict[str, Separable] = {}


def register(stat: Separable) -> Separable:
    """Add `stat` (replacing one of the same name); returns it."""
    if stat.name in STAT_NAMES:
        raise ValueError(f"{stat.name!r} is a built-in statistic; give the added one another name")
    SEPARABLE[stat.name] = stat
    return stat


def unregister(name: str) -> None:
    """Remove an added statistic (tests)."""
    SEPARABLE.pop(name, None)


def check_stats(stats) -> tuple[str, ...]:
    """The statistics asked for: built-in ones in STAT_NAMES order, then added ones in the order named;
    None: the seven built-in ones and every added one."""
    if stats is None:
        return STAT_NAMES + tuple(SEPARABLE)
    names = (stats,) if isinstance(stats, str) else tuple(stats)
    known = STAT_NAMES + tuple(SEPARABLE)
    unknown = [n for n in names if n not in known]
    if unknown or not names:
        raise ValueError(f"stats must name some of {', '.join(known)}; got {list(names)!r}")
    return tuple(n for n in STAT_NAMES if n in names) + tuple(dict.fromkeys(n for n in names if n in SEPARABLE))


def added(wanted) -> tuple[str, ...]:
    """The added statistics among `wanted` (their rows follow the seven built-in ones in the kernels' output)."""
    return tuple(n for n in wanted if n not in STAT_NAMES)


def columns(names, j: Tensor, tokens: Tensor | None, batch: int) -> Tensor:
    """float32 ``[len(names), batch, len(j)]``: each named statistic's column at keys `j` (NaN without
    tokens where it needs them)."""
    out = torch.full((len(names), batch, len(j)), float("nan"), dtype=torch.float32, device=j.device)
    for i, name in enumerate(names):
        stat = SEPARABLE[name]
        if tokens is None and stat.needs_tokens:
            continue
        out[i] = torch.as_tensor(stat.column(j, tokens), dtype=torch.float32, device=j.device)
    return out
