"""One forward through the circuit graph's hook points (`_Pass`): every sender's value collected in the
graph's order, each receiver's input open to change. What the runner's patching and attribution and the QK
attribution (`qk`) both run on; a room of its own so that neither imports the other's internals. And what a
patched run changes each receiver's input by (`_Patching`), from the senders' differences (`Corrupted`: the
whole cache's; `LeanDifferences`: the lean cache's, written over in place)."""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch import Tensor

from .cut import cut_hook
from .graph import Graph


# ---- runs through the graph ----------------------------------------------------------------------
@contextlib.contextmanager
def graph_mode(model) -> Iterator[None]:
    """Each receiver reads its own copy of the stream (`hook_q_input` / k / v, `hook_mlp_in`) inside the
    block; the model's switches as they were afterwards."""
    flags = dict(model.runtime.hook_flags)
    try:
        if flags.get("use_attn_in"):
            model.set_use_attn_in(False)
        if flags.get("ungroup_grouped_query_attention"):  # a KV head's k and v inputs are one receiver here
            model.set_ungroup_grouped_query_attention(False)
        model.set_use_split_qkv_input(True)
        if model.cfg.d_mlp is not None:
            model.set_use_hook_mlp_in(True)
        yield
    finally:
        model.set_use_split_qkv_input(flags.get("use_split_qkv_input", False))
        if model.cfg.d_mlp is not None:
            model.set_use_hook_mlp_in(flags.get("use_hook_mlp_in", False))
        if flags.get("use_attn_in"):
            model.set_use_attn_in(True)
        if flags.get("ungroup_grouped_query_attention"):
            model.set_ungroup_grouped_query_attention(True)


class _Pass:
    """One forward through the graph's hook points: collects every sender's value (in order) and lets
    `receive(group, x)` change each receiver's input. Senders of layers below `start` (a run resumed
    from a cached stream) are given."""

    def __init__(self, model, graph: Graph, receive=None, given: list[Tensor] | None = None, start: int = 0,
                 embed=None, store: int | None = None, features: bool = True) -> None:
        """`store`: the number of senders, to write their values into one tensor as they come (`Stacked`:
        `values.stacked` [S, b, p, d]) rather than keep them apart and stack them after (twice the memory).
        `features`: SAE features' values made (`features.FeatureWriter`; a run that reads no sender's value, the
        attribution's forward, passes False: the features' [F, b, p, d] values are never made there)."""
        self.model, self.graph, self.receive, self.embed = model, graph, receive, embed
        self.features = features
        below = 0 if start == 0 else sum(1 for l in graph.sender_layer if l < start)  # embed's is -1
        self.values: Values | Stacked = Values(given[:below] if given is not None else ())
        if store is not None:
            self.values = Stacked(store)
        self.start = start
        self._results: dict[int, Tensor] = {}
        self._scale: dict[int, Tensor] = {}
        self._stacked: set[int] = set()  # layers whose `_results` are an SAE's stacked values, not heads' results

    def hooks(self) -> list:
        model, g = self.model, self.graph
        sandwich = model.cfg.sandwich_norms
        out = []
        if self.start == 0:
            out.append(("blocks.0.hook_resid_pre", self._embed))
        if g.cut is not None and g.cut.layer >= self.start:  # a residual SAE's cut (after the embeddings' hook, before
            out.append((g.cut.hook_name, cut_hook(self, g.cut)))  # the logits' at the last block's resid_post)
        for l in range(self.start, g.n_layers):
            for kind in ("q", "k", "v"):
                out.append((f"blocks.{l}.hook_{kind}_input", self._receiver(l, kind)))
            nodes = g.sae_at.get((l, "attn"))
            if nodes is None or nodes.site == "z":
                out.append((f"blocks.{l}.attn.hook_result" if nodes is None else f"blocks.{l}.attn.hook_z",
                            self._heads(l, sandwich) if nodes is None else self._features(nodes, sandwich)))
                if sandwich:
                    out.append((f"blocks.{l}.ln1_post.hook_scale", self._keep_scale(l)))
                    out.append((f"blocks.{l}.hook_attn_out", self._shares(l)))
            else:  # hook_attn_out: what enters the stream, after a sandwich norm
                out.append((f"blocks.{l}.hook_attn_out", self._features(nodes, False)))
            if g.has_mlp:
                out.append((f"blocks.{l}.hook_mlp_in", self._receiver(l, "mlp")))
                nodes = g.sae_at.get((l, "mlp"))
                out.append((f"blocks.{l}.hook_mlp_out", self._mlp if nodes is None else self._features(nodes, False)))
        out.append((f"blocks.{g.n_layers - 1}.hook_resid_post", self._receiver(g.n_layers, "logits")))
        return out

    def _embed(self, x, hook):
        if self.embed is not None:
            x = self.embed(x)
        self.values.append(x)
        return x

    def _mlp(self, x, hook):
        self.values.append(x)
        return x

    def _heads(self, l: int, sandwich: bool):
        def hook(x, hook):
            if sandwich:
                self._results[l] = x
            else:
                self.values.extend(x.unbind(2))
            return x
        return hook

    def _keep_scale(self, l: int):
        def hook(x, hook):
            self._scale[l] = x
            return x
        return hook

    def _shares(self, l: int):
        norm = self.model.blocks[l].ln1_post

        def hook(x, hook):
            # RMSNorm: out = w * (attn_out / scale), attn_out = sum_h result_h + b_O: head h's share
            # is w * result_h / scale (computed as the norm does, in float32, then cast back); an SAE's
            # senders' values come stacked [F + 1, b, p, d] (`_features`), each shared alike
            r, scale = self._results.pop(l, None), self._scale.pop(l)
            if r is None:  # the SAE's values were not made (`features` off)
                return x
            if l in self._stacked:
                self._stacked.discard(l)
                self.values.extend_block((norm.w * (r.float() / scale[None]).to(x.dtype)))
            else:
                self.values.extend((norm.w * (r.float() / scale[:, :, None]).to(x.dtype)).unbind(2))
            return x
        return hook

    def _features(self, nodes, sandwich: bool):
        """An SAE's hook point: its features' and error's values (`features.FeatureWriter`), appended in order, or
        under sandwich norms kept until the norm's scale is known (`_shares`)."""
        writer = nodes.writer(self.model) if self.features else None
        count = len(nodes.features) + 1
        needs = getattr(self.receive, "needs", None)

        def hook(x, hook):
            if writer is None:
                return x
            first = len(self.values)
            if needs is not None and not needs(first, first + count):  # a patching that reads none of them
                self.values.extend([None] * count)
                return x
            values = writer(x)  # [F + 1, b, p, d_model]
            if sandwich:
                self._results[nodes.layer] = values
                self._stacked.add(nodes.layer)
            else:
                self.values.extend_block(values)
            return x
        return hook

    def _receiver(self, l: int, kind: str):
        def hook(x, hook):
            return x if self.receive is None else self.receive((l, kind), x, self.values)
        return hook


class Values(list):
    """Senders' values, a list; `blocks`: those made at once, first index -> [k, b, p, d] (an SAE's features and
    error, `extend_block`), whose k values the list holds as views: read at once where many are (`_Patching._fill`:
    one subtraction for an SAE's hundreds of features, not one each)."""

    def __init__(self, items=()) -> None:
        super().__init__(items)
        self.blocks: dict[int, Tensor] = {}

    def extend_block(self, stacked: Tensor) -> None:
        self.blocks[len(self)] = stacked
        self.extend(stacked.unbind(0))


class Stacked:
    """Senders' values written into one [S, b, p, d] tensor as they come (what `_Pass.values` holds when
    asked to store): `append`, `extend`, indexing and `len` as a list's; `stacked` once all S have come.
    `minus`: another run's values [S, b, p, d], each overwritten by this run's value less it as it comes."""

    def __init__(self, n: int, minus: Tensor | None = None) -> None:
        self.n, self.count, self.minus = n, 0, minus is not None
        self._buffer: Tensor | None = minus

    def append(self, x: Tensor) -> None:
        if self._buffer is None:
            self._buffer = x.new_empty((self.n,) + tuple(x.shape))
        if self.minus:
            torch.sub(x, self._buffer[self.count], out=self._buffer[self.count])
        else:
            self._buffer[self.count].copy_(x)
        self.count += 1

    def extend(self, xs) -> None:
        for x in xs:
            self.append(x)

    def extend_block(self, stacked: Tensor) -> None:
        """`extend` by the k values stacked [k, b, p, d], written at once."""
        if self._buffer is None or stacked.shape[0] == 0:
            return self.extend(stacked.unbind(0))
        at = self._buffer[self.count:self.count + stacked.shape[0]]
        if self.minus:
            torch.sub(stacked, at, out=at)
        else:
            at.copy_(stacked)
        self.count += stacked.shape[0]

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, i):
        return self._buffer[:self.count][i]

    @property
    def stacked(self) -> Tensor:
        if self.count != self.n:
            raise RuntimeError(f"{self.count} of {self.n} senders' values came")
        return self._buffer


# ---- patched runs -------------------------------------------------------------------------------------------
ROWS = 16  # buffered differences a receiver reads at once (a view where they are consecutive, else a copy of them)


def _groups(rows: list[int], most: int, split: int) -> list[list[int]]:
    """Ascending indices in groups of at most `most`, none holding indices on both sides of `split`."""
    out: list[list[int]] = []
    for r in rows:
        if out and len(out[-1]) < most and (out[-1][0] < split) == (r < split):
            out[-1].append(r)
        else:
            out.append([r])
    return out


class _Patching:
    """receive(): input_r - sum_s mask[s, r] (value_s now - value_s corrupted). A few senders are stacked.
    Past that the differences are read from a buffer, each written once as its sender computes it, with
    their running sum: a receiver reads every sender computed before it (but a parallel block's MLP), so
    its change is also that sum less sum_s (1 - mask[s, r]) times the differences, and whichever of the
    two forms has fewer senders is used (a circuit's complement: few kept edges, one product). The buffer is
    read `ROWS` senders at a time: a receiver that reads most of 300 senders never copies them all (at 4,096
    tokens such a copy was as large as the buffer itself)."""

    STACK = 16  # senders up to which a receiver's change is stacked rather than read from the buffer

    def __init__(self, g: Graph, mask: Tensor, source) -> None:
        """`source`: each sender's value now less its corrupted value (`Corrupted`, `LeanDifferences`), and
        the buffer that holds them (`source.buffer`); senders below `source.below` are in it already, negated
        (the lean cache's corrupted - clean)."""
        self.g, self.mask, self.source = g, mask, source
        self.below = getattr(source, "below", 0)
        self.diff: Tensor | None = None
        self.total: Tensor | None = None  # sum of the differences written so far
        self.filled = 0

    def needs(self, start: int, end: int) -> bool:
        """Whether any receiver reads a change of senders start..end (`_Pass` makes no value it would not read: an
        SAE's features patched nowhere; `_fill` takes their difference as 0, in the running sum and in the kept
        senders' alike, so it cancels)."""
        return bool(self.mask[start:end].any())

    def __call__(self, group, x, values):
        rs = self.g.groups[group]
        n = len(values)
        sub = self.mask[:n, rs]
        senders = sub.any(1).nonzero().flatten()
        if senders.numel() == 0:
            return x
        if senders.numel() <= self.STACK and not self.source.lean:
            picked = senders.tolist()
            diff = torch.stack([self.source.difference(s, values, x.dtype) for s in picked])  # [k, b, p, d]
            change = self._product(sub[picked], diff, x)
        else:
            self._fill(values, x)
            allowed = self.g.allowed[:n, rs]
            change = self._buffered(sub, (1 - sub) * allowed, bool(allowed.all()), senders, x)
        return self._applied(x, change)

    def _buffered(self, sub: Tensor, kept: Tensor, reads_all: bool, senders: Tensor, x: Tensor) -> Tensor:
        """The change from the buffer of differences: the patched senders' (`sub`), or, for a receiver that reads
        every earlier sender (`reads_all`), the running sum less the kept ones', whichever has fewer senders."""
        rows = kept.flatten(1).any(1).nonzero().flatten()
        if reads_all and rows.numel() < senders.numel():
            return self.total[None] - self._rows(kept, rows, x)
        return self._rows(sub, senders, x)

    def _rows(self, w: Tensor, rows: Tensor, x: Tensor) -> Tensor:
        """sum over the senders `rows` (ascending) of w[s] times the buffered difference of s, `ROWS` senders at
        a time (`_product`; consecutive ones as a view of the buffer); those below `below` are held negated, so
        their part is negated back (exactly: a float's sign is one bit)."""
        out = None
        for group in _groups(rows.tolist(), ROWS, self.below):
            s, e = group[0], group[-1] + 1
            if e - s == len(group):
                part = self._product(w[s:e], self.diff[s:e], x)
            else:
                at = torch.tensor(group)
                part = self._product(w[at], self.diff.index_select(0, at.to(self.diff.device)), x)
            if s < self.below:
                part = part.neg_()
            out = part if out is None else out.add_(part)
        return out if out is not None else self._product(w[:0], self.diff[:0], x)

    @staticmethod
    def _applied(x: Tensor, change: Tensor) -> Tensor:
        """x less the change ([n_receivers, b, p, d]), per head ([b, p, n, d]) or for the one receiver."""
        if x.dim() == 4:
            return x - change.permute(1, 2, 0, 3)
        return x - change[0]

    def _fill(self, values, x) -> None:
        if self.diff is None:
            shape = (x.shape[0], x.shape[1], x.shape[-1])  # every receiver reads the stream [b, p, d_model]
            self.diff = self.source.buffer(len(self.g.senders), shape, x.dtype, x.device)
            self.total = torch.zeros(shape, dtype=x.dtype, device=x.device)
        blocks = getattr(values, "blocks", {})
        s = self.filled
        while s < len(values):
            block = blocks.get(s)
            if block is not None and not self.source.lean and s + block.shape[0] <= len(values):
                e = s + block.shape[0]  # an SAE's values, made at once: one subtraction and one sum
                self.source.difference_block(s, block, x.dtype, out=self.diff[s:e])
                self.total += self.diff[s:e].sum(0)
                s = e
                continue
            self._fill_one(s, values, x.dtype)
            s += 1
        self.filled = len(values)

    def _fill_one(self, s: int, values, dtype) -> None:
        """Sender s's difference into the buffer and the running sum."""
        if s < self.below:  # held as corrupted - clean: the difference is its negation
            self.total -= self.diff[s]
        elif values[s] is None:  # a value no receiver reads the change of (`needs`): 0 in every sum
            self.diff[s].zero_()
        else:
            self.source.difference(s, values, dtype, out=self.diff[s])
            self.total += self.diff[s]
        if self.source.lean:  # read from the buffer from now on: the value is not held twice
            values[s] = None
            self.source.release(s)

    @staticmethod
    def _product(w: Tensor, diff: Tensor, x: Tensor) -> Tensor:
        """sum_k w[k, r] diff[k] for each receiver r: [n_receivers, b, p, d]."""
        w = w.to(device=x.device, dtype=x.dtype)
        if w.shape[0] == 0:
            return torch.zeros((w.shape[1],) + diff.shape[1:], dtype=x.dtype, device=x.device)
        return (w.T @ diff.flatten(1)).view(w.shape[1], *diff.shape[1:])


class Corrupted:
    """A patching's source (`_Patching`): value now - the cached corrupted value of each sender, in a buffer
    of its own."""

    lean = False
    below = 0

    def __init__(self, corrupted: Tensor) -> None:
        self.corrupted = corrupted

    def buffer(self, n: int, shape: tuple, dtype, device) -> Tensor:
        return torch.empty((n,) + tuple(shape), dtype=dtype, device=device)

    def difference(self, s: int, values, dtype, out: Tensor | None = None) -> Tensor:
        return torch.sub(values[s], self.corrupted[s].to(dtype), out=out)

    def difference_block(self, s: int, block: Tensor, dtype, out: Tensor) -> Tensor:
        """Senders s .. s + k's differences at once, their values now `block` [k, b, p, d]."""
        return torch.sub(block, self.corrupted[s:s + block.shape[0]].to(dtype), out=out)


class LeanDifferences:
    """A patching's source on a lean cache (`Runner.lean`): the cache of each sender's corrupted - clean value
    is the buffer itself. Below the resumed run's first block each value now is the clean one, so its
    difference is the cached corrupted - clean negated (`_Patching` reads it so, bit for bit clean -
    corrupted); from there on, the value now less the corrupted value formed again block by block (`extend`),
    written over the cached one (the runner forms those again when it next needs them, `Runner._chunk`).
    So a patched run holds no second copy of the senders' differences. Read once each (then `release`d)."""

    lean = True

    def __init__(self, cached: Tensor, below: int) -> None:
        self.cached, self.below, self.formed = cached, below, []

    def buffer(self, n: int, shape: tuple, dtype, device) -> Tensor:
        if self.cached.dtype != dtype or tuple(self.cached.shape) != (n,) + tuple(shape):
            raise RuntimeError(f"the lean cache {tuple(self.cached.shape)} {self.cached.dtype} cannot hold "
                               f"{n} x {tuple(shape)} {dtype}")
        return self.cached

    def extend(self, values) -> None:
        self.formed.extend(values)

    def difference(self, s: int, values, dtype, out: Tensor | None = None) -> Tensor:
        if s < self.below:
            return torch.neg(self.cached[s].to(dtype), out=out)
        return torch.sub(values[s], self.formed[s - self.below].to(dtype), out=out)

    def release(self, s: int) -> None:
        if s >= self.below:
            self.formed[s - self.below] = None
