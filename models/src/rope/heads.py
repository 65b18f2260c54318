"""RoPE scaling or an attention temperature on chosen heads only: the per-head repair of a model read past
its trained context (`interp extrapolate`). Two context managers; the model is itself again on exit, even
on an exception, and nothing in the model's code changes:

    with scaled_heads(model, {(12, 1), (20, 0)}, RopeScaling("yarn", 2.0, original_max_position=8192)):
        ...  # the query heads of KV heads 1 of layer 12 and 0 of layer 20 rotate with YaRN; the rest as loaded
    with logn_heads(model, [(12, 3), (20, 6)], n_ctx=8192):
        ...  # those query heads' logits multiplied by max(1, log(p + 1) / log(n_ctx)) at position p

`scaled_heads` scales a KV head with every query head that reads it: the scores of query head h are
R(theta' p) q_h . R(theta' j) k_g, so k_g must turn with the scaled frequencies too, and every query
head of group g reads that same k_g. It is a per-KV-head cos/sin table: `HeadRotary` (a `Rotary`
whose `per_layer` gives [batch, pos, kv_head, rotary_dim] tables where a layer has chosen heads, the
scaled table's rows (YaRN's attention factor included) for them and the model's own for the rest)
stands in for `model.rotary`, and those layers rotate q with each KV head's row repeated for its query
heads (`_grouped`). Chosen on every KV head it is the global scaling, number for number (the same
`Rotary.cos_sin` on the same positions; tests/analyses/extrapolation/test_extrapolate.py). On a model whose sliding layers
have a base of their own (Gemma 3) a scaling rescales the full layers' table only, as
`HookedTransformer.rescale_rope_` does, so it changes nothing on a local layer's heads.

`logn_heads` is a temperature per query head, LogN scaling (Chiang & Cholak 2022, "Overcoming a
theoretical limitation of self-attention"; Qwen's logn attention): the query at position p is
multiplied by max(1, log(p + 1) / log(n_ctx)) through a hook on `hook_rot_q`, so the model is unchanged
inside its trained context and its attention is sharpened past it, by the ratio that keeps the entropy
of a uniform attention where training left it. The positions are the forward's own (`HeadRotary`
records them), so it holds through a KV cache's decoding. On every head it is every score row p
multiplied by that factor (the test does it through `hook_attn_scores`).

Both run the full cache and plain forwards (the study's perplexity and passkey); a KV policy that
renumbers cached positions (StreamingLLM) reads `Rotary.cos_sin` of the model's own table.
"""

from __future__ import annotations

import contextlib
import math
from typing import Iterable, Iterator

import torch
from torch import Tensor

from ..config import RopeScaling
from interp.errors import BadValue, UserError
from ..positions import Rotary

Head = tuple[int, int]  # (layer, head): a query head, or a KV head where the name says so


class HeadRotary(Rotary):
    """The model's own rotary (`cfg`) with `scaled`'s tables on the KV heads `groups` ({layer: [kv_head,
    ...]}); records the positions of the last forward (`positions`) for `logn_heads`."""

    def __init__(self, cfg, scaled: Rotary | None = None, groups: dict[int, list[int]] | None = None) -> None:
        super().__init__(cfg)
        self.scaled = scaled
        self.groups = {l: sorted(set(g)) for l, g in (groups or {}).items() if g}
        self.positions: Tensor | None = None

    def per_layer(self, positions: Tensor, dtype: torch.dtype) -> list[tuple[Tensor, Tensor]]:
        self.positions = positions
        own = super().per_layer(positions, dtype)
        if not self.groups:
            return own
        scaled = self.scaled.per_layer(positions, dtype)
        out = []
        for layer, (cos, sin) in enumerate(own):
            kv = self.groups.get(layer)
            if kv is None:
                out.append((cos, sin))
                continue
            chosen = torch.zeros(self.cfg.kv_heads, dtype=torch.bool, device=cos.device)
            chosen[kv] = True
            chosen = chosen[None, None, :, None]  # [1, 1, kv_head, 1] against [batch, pos, 1, rotary_dim]
            out.append((torch.where(chosen, scaled[layer][0], cos), torch.where(chosen, scaled[layer][1], sin)))
        return out


def _grouped(rotate, group: int):
    """`rotate` for tables with one row per KV head: q (group x as many heads) takes each row `group` times."""

    def turn(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        if x.shape[2] != cos.shape[2]:
            cos, sin = cos.repeat_interleave(group, dim=2), sin.repeat_interleave(group, dim=2)
        return rotate(x, cos, sin)

    return turn


def _check(model, heads: Iterable[Head], n: int, what: str) -> list[Head]:
    if not getattr(model, "native", True):
        raise UserError("per-head RoPE scaling and temperatures are interp's own transformer's; this model is wrapped")
    if model.rotary is None:
        raise BadValue(f"per-head RoPE scaling needs rotary positions; this model's are {model.cfg.positional or 'none'}")
    if isinstance(model.rotary, HeadRotary):
        raise BadValue("the model already runs per-head RoPE (scaled_heads / logn_heads): leave that block first")
    out = sorted({(int(l), int(h)) for l, h in heads})
    for l, h in out:
        if not (0 <= l < model.cfg.n_layers and 0 <= h < n):
            raise BadValue(f"{what} ({l}, {h}) is not in this model ({model.cfg.n_layers} layers, {n} per layer)")
    return out


@contextlib.contextmanager
def _swapped(model, rotary: HeadRotary, rotations: dict[int, object]) -> Iterator[HeadRotary]:
    saved_rotary, saved = model.rotary, {l: model.blocks[l].attn.rotate for l in rotations}
    try:
        model.rotary = rotary.to(saved_rotary.inv_freq.device)
        for l, rotate in rotations.items():
            model.blocks[l].attn.rotate = rotate
        yield model.rotary
    finally:
        model.rotary = saved_rotary
        for l, rotate in saved.items():
            model.blocks[l].attn.rotate = rotate


@contextlib.contextmanager
def scaled_heads(model, kv_heads: Iterable[Head], scaling: RopeScaling | None) -> Iterator[HeadRotary]:
    """Inside the block the KV heads `kv_heads` ((layer, kv_head) pairs; with every query head that reads
    them) rotate with `scaling` (None: plain RoPE) in place of the model's own; the others as loaded."""
    kv_heads = _check(model, kv_heads, model.cfg.kv_heads, "KV head")
    groups: dict[int, list[int]] = {}
    for l, g in kv_heads:
        groups.setdefault(l, []).append(g)
    cfg = model.cfg
    scaled = Rotary(cfg.replace(rope_scaling=scaling)).to(model.rotary.inv_freq.device)
    group = cfg.n_heads // cfg.kv_heads
    rotations = {l: _grouped(model.blocks[l].attn.rotate, group) for l in groups}
    with _swapped(model, HeadRotary(cfg, scaled, groups), rotations) as rotary:
        yield rotary


@contextlib.contextmanager
def logn_heads(model, heads: Iterable[Head], n_ctx: int | None = None) -> Iterator[HeadRotary]:
    """Inside the block the query heads `heads` ((layer, head) pairs) have their logits at position p
    multiplied by max(1, log(p + 1) / log(n_ctx)) (default n_ctx: the model's trained context)."""
    heads = _check(model, heads, model.cfg.n_heads, "head")
    n_ctx = model.cfg.n_ctx if n_ctx is None else int(n_ctx)
    if n_ctx < 2:
        raise BadValue(f"logn_heads: n_ctx must be at least 2, got {n_ctx}")
    per_layer: dict[int, list[int]] = {}
    for l, h in heads:
        per_layer.setdefault(l, []).append(h)
    rotary = HeadRotary(model.cfg)
    log_n = math.log(n_ctx)

    def hook_for(chosen: list[int]):
        index = torch.tensor(chosen)

        def hook(q: Tensor, hook) -> Tensor:  # q: [batch, pos, head, d_head]
            tau = ((rotary.positions.to(torch.float32) + 1).log() / log_n).clamp(min=1.0).to(q.dtype)
            q = q.clone()
            idx = index.to(q.device)
            q[:, :, idx] = q[:, :, idx] * tau[:, :, None, None]
            return q

        return hook

    with _swapped(model, rotary, {}), model.hooks([(f"blocks.{l}.attn.hook_rot_q", hook_for(h))
                                                   for l, h in per_layer.items()]):
        yield rotary


__all__ = ["HeadRotary", "logn_heads", "scaled_heads"]
