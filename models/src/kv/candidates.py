"""What a subset KV-cache policy chooses among (`Candidates`: one layer's KV heads after an attention call), what it
keeps (`Selection`), and the shared keep/evict step (`keep_top`). `interp.models.kv.policies` re-exports them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import torch
from torch import Tensor

from interp.errors import BadValue


class Selection(NamedTuple):
    """Which entries a head keeps: `index` [b, g, c] into the entries (slot order), and `kept` [b, g, c]
    (False: the place is padding, its slot becomes -1); None when every chosen entry is kept."""

    index: Tensor
    kept: Tensor | None = None


@dataclass
class Candidates:
    """What a subset policy chooses among: one layer's KV heads that share it, after an attention call (the
    entries held before the call, then the call's own).

    keys, values  [b, g, m, d]  the entries held before the call, then the call's own
    slots         [b, g, m]     each entry's cache slot (its token's index); -1 for padding
    queries       [b, g * n_rep, n, d]  the call's queries (None where the policy does not read them)
    visible       [b, g, n, m]  which entries each of the call's queries saw, or a function (a, b) -> its rows
                  [b, g, b - a, m] for query rows a..b-1 (a whole prompt absorbed at once: [n, n] would be
                  8 GiB of positions at 32k tokens, so the rows are made as `attention` reads them)
    start, n      the call's first slot and its number of tokens
    state         the policy's own values for these heads, kept across calls (SnapKV's "done")
    entries       per-entry values [b, g, m] kept beside each entry (H2O's scores): gathered with the
                  entries that stay; earlier ones are padded with zeros for the call's new entries
    layer, heads  the layer and its KV heads [g] these entries belong to (random's seed per head)
    """

    keys: Tensor
    values: Tensor
    slots: Tensor
    queries: Tensor | None
    visible: "Tensor | Callable[[int, int], Tensor] | None"
    scale: float
    start: int
    n: int
    n_rep: int
    state: dict = field(default_factory=dict)
    entries: dict = field(default_factory=dict)
    layer: int = 0
    heads: Tensor | None = None

    @property
    def last(self) -> int:
        """The slot of the call's last token."""
        return self.start + self.n - 1

    @property
    def valid(self) -> Tensor:
        return self.slots >= 0

    def recent(self, w: int) -> Tensor:
        """bool [b, g, m]: real entries among the last `w` slots."""
        return self.valid & (self.slots > self.last - w)

    def entry(self, name: str) -> Tensor | None:
        """A per-entry value kept from earlier calls, with zeros for this call's entries ([b, g, m]); None at first."""
        old = self.entries.get(name)
        if old is None:
            return None
        return torch.cat([old, old.new_zeros(*old.shape[:2], self.slots.shape[-1] - old.shape[-1])], dim=2)

    def attention(self, last: int | None = None) -> Tensor:
        """float32 [b, g, m]: the attention each entry receives from the call's queries (the `last` ones, or all),
        softmax over what each saw, summed over those queries and the KV head's query heads."""
        if self.queries is None:
            raise BadValue("this policy reads the queries' attention, but the call gave none (a prefill absorbed "
                           "from a cache made without capture_queries=True)")
        first = 0 if last is None else max(0, self.queries.shape[2] - last)
        q = self.queries[:, :, first:]
        b, hq, nq, _ = q.shape
        g, m = self.keys.shape[1], self.keys.shape[2]
        K = self.keys.repeat_interleave(self.n_rep, dim=1)
        total = torch.zeros(b, g, m, device=q.device)
        step = max(1, (1 << 22) // max(1, b * hq * m))  # scores of at most 4M floats at a time
        for a in range(0, nq, step):
            rows = (self.visible(first + a, first + min(a + step, nq)) if callable(self.visible)
                    else self.visible[:, :, first + a : first + a + step])
            hidden = ~rows.repeat_interleave(self.n_rep, dim=1) if rows.shape[1] > 1 else ~rows
            s = torch.matmul(q[:, :, a : a + step], K.transpose(-1, -2)).float().mul_(self.scale)
            s.masked_fill_(hidden, float("-inf"))
            total += torch.softmax(s, dim=-1).sum(2).view(b, g, self.n_rep, m).sum(2)
        return total


def keep_top(priority: Tensor, cap: int) -> Selection:
    """The shared keep/evict step: per head, the `cap` entries of highest priority, in slot order; an entry of
    priority -inf is never kept (where fewer than `cap` are eligible, the rest of the places are padding)."""
    c = min(cap, priority.shape[-1])
    index = priority.topk(c, dim=-1).indices.sort(dim=-1).values
    kept = priority.gather(-1, index) > float("-inf")
    return Selection(index, None if bool(kept.all()) else kept)
