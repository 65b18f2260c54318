"""Boundary protection for subset KV-cache policies: `Protect` (the setting, `+protect(4,9)` / `+protect(10%)`)
and `protect_boundaries` (the priorities it raises). `interp.models.kv.policies` re-exports them."""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
from torch import Tensor

from interp.errors import BadValue

from .candidates import Candidates

_INF = float("inf")


@dataclass(frozen=True)
class Protect:
    """Boundary protection ("Protection is (nearly) all you need", arXiv 2605.18053): the first `first` and the
    last `last` tokens (by slot = position) are never evicted, or `fraction` of the policy's budget split
    between them: t = round(fraction x budget) entries (at least 1), the first max(1, t // 3) and the last
    the rest (h2o(132)+protect(10%): 13 entries, the first 4 and the last 9). Protected entries count inside
    the budget: the policy holds as many entries (and bytes) as without. Written `+protect(first,last)` or
    `+protect(10%)` (or `+protect(0.1)`) after an eviction policy: `h2o(132)+protect(4,9)`."""

    first: int | None = None
    last: int | None = None
    fraction: float | None = None

    def __post_init__(self) -> None:
        if self.fraction is not None:
            if self.first is not None or self.last is not None:
                raise BadValue("protect takes two counts, protect(first,last), or one fraction, protect(10%): not both")
            if not 0 < self.fraction < 1:  # nan fails too
                raise BadValue(f"protect({self.fraction:g}): a fraction of the budget must be between 0 and 1 "
                               "(exclusive), e.g. protect(10%) or protect(0.1); or give counts, protect(4,9)")
            return
        for what, n in (("first", self.first), ("last", self.last)):
            if not isinstance(n, int) or isinstance(n, bool) or n < 0:
                raise BadValue(f"protect: the count of {what} tokens must be a whole number >= 0, got {n!r}; "
                               "e.g. protect(4,9) or protect(10%)")

    @property
    def spelled(self) -> str:
        if self.fraction is not None:
            return f"protect({round(self.fraction * 100, 6):g}%)"
        return f"protect({self.first},{self.last})"

    def counts(self, budget: int) -> tuple[int, int]:
        """(first, last): the tokens protected at each end for a policy of `budget` entries per head."""
        if self.fraction is None:
            return self.first, self.last
        t = max(1, round(self.fraction * budget))
        first = max(1, t // 3)
        return first, t - first

    @classmethod
    def parse(cls, text: str, spec: str) -> "Protect":
        """From "protect(4,9)", "protect(10%)" or "protect(0.1)" (`spec`: the whole policy name, for errors)."""
        m = re.fullmatch(r"\s*protect\s*\(([^()]*)\)\s*", text.lower())
        if not m:
            raise BadValue(f"KV-cache policy {spec!r}: after '+' write protect(first,last) or protect(10%), "
                           "e.g. h2o(132)+protect(4,9)")
        args = [a.strip() for a in m.group(1).split(",")]
        usage = (f"KV-cache policy {spec!r}: write protect(first,last) with two whole numbers, or protect(10%) / "
                 "protect(0.1) with one fraction of the budget")
        if len(args) == 2:
            if not all(re.fullmatch(r"[+-]?[0-9]+", a) for a in args):
                raise BadValue(usage)
            first, last = (int(a) for a in args)
            if min(first, last) < 0:
                raise BadValue(f"KV-cache policy {spec!r}: a protected count cannot be negative; write "
                               "protect(first,last) with whole numbers >= 0, e.g. protect(4,9)")
            return cls(first, last)
        a = args[0] if len(args) == 1 else ""
        try:
            fraction = float(a[:-1]) / 100 if a.endswith("%") else float(a)
        except ValueError:
            raise BadValue(usage) from None
        return cls(fraction=fraction)


def protect_boundaries(prio: Tensor, view: Candidates, first: int, last: int) -> Tensor:
    """`prio` [b, g, m] with the held entries at slots < `first` and the last `last` slots of the call raised
    to +inf, and the policy's own +inf lowered to the largest finite float: protected entries are kept before
    anything the policy itself always keeps (H2O's recent window), so `keep_top` never drops one."""
    guard = view.valid & ((view.slots < first) | view.recent(last))
    prio = torch.where(prio == _INF, torch.finfo(prio.dtype).max, prio)
    return torch.where(guard, _INF, prio)
