"""One forward through the circuit graph's hook points (`_Pass`): every sender's value collected in the
graph's order, each receiver's input open to change. What the runner's patching and attribution and the QK
attribution (`qk`) both run on; a room of its own so that neither imports the other's internals."""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch import Tensor

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
                 embed=None, store: int | None = None) -> None:
        """`store`: the number of senders, to write their values into one tensor as they come (`Stacked`:
        `values.stacked` [S, b, p, d]) rather than keep them apart and stack them after (twice the memory)."""
        self.model, self.graph, self.receive, self.embed = model, graph, receive, embed
        below = 0 if start == 0 else sum(1 for l in graph.sender_layer if l < start)  # embed's is -1
        self.values: list[Tensor] | Stacked = list(given[:below]) if given is not None else []
        if store is not None:
            self.values = Stacked(store)
        self.start = start
        self._results: dict[int, Tensor] = {}
        self._scale: dict[int, Tensor] = {}

    def hooks(self) -> list:
        model, g = self.model, self.graph
        sandwich = model.cfg.sandwich_norms
        out = []
        if self.start == 0:
            out.append(("blocks.0.hook_resid_pre", self._embed))
        for l in range(self.start, g.n_layers):
            for kind in ("q", "k", "v"):
                out.append((f"blocks.{l}.hook_{kind}_input", self._receiver(l, kind)))
            out.append((f"blocks.{l}.attn.hook_result", self._heads(l, sandwich)))
            if sandwich:
                out.append((f"blocks.{l}.ln1_post.hook_scale", self._keep_scale(l)))
                out.append((f"blocks.{l}.hook_attn_out", self._shares(l)))
            if g.has_mlp:
                out.append((f"blocks.{l}.hook_mlp_in", self._receiver(l, "mlp")))
                out.append((f"blocks.{l}.hook_mlp_out", self._mlp))
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
            # is w * result_h / scale (computed as the norm does, in float32, then cast back)
            r, scale = self._results.pop(l), self._scale.pop(l)
            self.values.extend((norm.w * (r.float() / scale[:, :, None]).to(x.dtype)).unbind(2))
            return x
        return hook

    def _receiver(self, l: int, kind: str):
        def hook(x, hook):
            return x if self.receive is None else self.receive((l, kind), x, self.values)
        return hook


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

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, i):
        return self._buffer[:self.count][i]

    @property
    def stacked(self) -> Tensor:
        if self.count != self.n:
            raise RuntimeError(f"{self.count} of {self.n} senders' values came")
        return self._buffer
