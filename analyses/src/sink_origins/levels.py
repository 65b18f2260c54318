"""Sink levels (`interp sinks`): every position that draws a sink's mass in some layer, not only the first token,
the layer it forms at, the component whose removal removes it, and its mass by layer. Secondary sinks (arXiv
2512.22213, ICLR 2026): middle-layer MLPs make weaker sinks at tokens other than the first (often delimiters).

Shapes: layer, batch (sequences), head (query heads), pos (positions), d_model. A^{l,h} is head h of layer l's
pattern [batch, query, key].

Definitions:
* Key mass: alpha^{l,h}(b, k) = the mean over Q_k of A^{l,h}[b, t, k], Q_k = the queries t that see key k and are at
  least `gap` (4) tokens past it (t - k >= gap, inside a sliding window): a query right after a key (a
  previous-token head, the key's own row) does not make it a sink. A key is examined when it has at least
  max(gap, pos // 4) such queries (under a sliding window too short for that, window - gap); the last keys of
  a sequence, with too few queries past them, are not.
* A position (b, k) is a sink at layer l when max_h alpha^{l,h}(b, k) >= epsilon (Gu et al.'s 0.3): some head of
  l puts at least epsilon of its attention on it, averaged over the queries past it. Its level: the first layer
  where it is one.
* Sites: sink positions grouped by what they hold. Position 0 of every sequence is the site `first` (the first
  token is a sink by its place, whatever it holds); every other sink position joins the site of its token id.
  A site's positions are those of its kind that are a sink at some layer; its mass at layer l is the mean over
  them of max_h alpha^{l,h}; its level the first layer where that mass reaches epsilon (where it never does, its
  positions being sinks in different layers: the lower median of their levels); its head the head of the level
  layer with the largest mean alpha over them; its share, its sink positions over the examined positions
  holding its token (position 0 for `first`).
* What makes a site: the output of each attention layer and each MLP before the level (`hook_attn_out`,
  `hook_mlp_out` of layers < level), zeroed at the site's positions only, one at a time, one forward each that
  stops after the level's attention. The component whose removal lowers the site's mass at its level most makes
  it; it removes the sink when that mass falls below epsilon. A site at level 0 is made by the embedding.

Cost: one fused forward for every layer's masses (every key's alpha from each row's log-sum-exp and a block of
key columns of the pattern at a time, `attention_weights_at`: no n x n pattern is built), then at most
2 x level forwards for each traced site (the strongest `max_sites`), each stopping at the level.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pandas as pd
import torch
from torch import Tensor

from interp.models.readouts.head_statistics import (attention_logsumexp, attention_weights_at, for_each_layer_qk,
                                                    layer_scoring)

GAP = 4  # a key's mass is averaged over the queries at least this many tokens past it
MAX_SITES = 6  # the sites whose makers are traced by ablation (the strongest by peak mass; `first` always)
BUDGET = 1 << 22  # floats of one block of pattern columns [batch, head, pos, keys]
LEVEL_COLUMNS = ("site", "token", "token_id", "kind", "level", "head", "mass_at_level", "peak_mass", "peak_layer",
                 "n_positions", "share", "median_position", "traced", "component", "mass_without", "removes")
LAYER_COLUMNS = ("site", "layer", "mass", "mean_mass", "sink_heads")
ABLATION_COLUMNS = ("site", "level", "component", "layer", "mass", "mass_without", "change")


# ---- the masses -------------------------------------------------------------------------------------------------
def min_queries(n: int, gap: int = GAP, window: int | None = None) -> int:
    """The queries past the gap a key needs to be examined, in `n`-token sequences: max(gap, n // 4), or under a
    sliding window that lets no key have as many, the most it allows (window - gap; none when that is < 1)."""
    most = n - gap if window is None else min(n, window) - gap
    return max(1, min(max(gap, n // 4), most))


def key_masses(q: Tensor, k: Tensor, scoring, *, gap: int = GAP) -> tuple[Tensor, Tensor]:
    """(alpha float32 [batch, head, pos]: every key's mass as the module docstring defines it, 0 where not examined;
    examined bool [pos]). q [batch, head, pos, d_head], k [batch, kv, pos, d_head] as attention scores them
    (after RoPE and QK-norm); `scoring`: the layer's (`layer_scoring`). Exact, in blocks of key columns."""
    b, h, n, _ = q.shape
    p = torch.arange(n, device=q.device)
    lse = attention_logsumexp(q, k, scoring)  # [b, h, pos]
    alpha = torch.zeros(b, h, n, dtype=torch.float32, device=q.device)
    counts = torch.zeros(n, dtype=torch.long, device=q.device)
    block = max(1, BUDGET // max(1, b * h * n))
    for lo in range(0, n, block):
        j = torch.arange(lo, min(lo + block, n), device=q.device)
        rel = p[:, None] - j[None, :]  # [pos, m]
        use = rel >= gap
        if scoring.window is not None:
            use &= rel < scoring.window
        w = attention_weights_at(q, k, lse, j, scoring)  # [b, h, pos, m]: 0 where unseen
        counts[j] = use.sum(0)
        alpha[..., j] = (w * use).sum(2) / use.sum(0).clamp(min=1)
    examined = counts >= min_queries(n, gap, scoring.window)
    return alpha * examined, examined


@torch.no_grad()
def masses_pass(model, tokens: Tensor, *, gap: int = GAP, layers=None, hooks=()) -> tuple[Tensor, Tensor]:
    """One fused forward (with the forward `hooks`, stopping after the last of `layers`): (alpha float32 [layer,
    batch, head, pos] of `key_masses` for each of `layers` (default all) in order, examined bool [pos]).
    A non-finite mass is an error (the model's activations overflowed), never a finding."""
    out: dict[int, Tensor] = {}
    examined = []

    def fn(layer, q, k, v):
        out[layer], seen = key_masses(q, k, layer_scoring(model, layer), gap=gap)
        examined.append(seen)

    with model.hooks(fwd_hooks=list(hooks)):
        for_each_layer_qk(model, tokens, fn, layers=layers)
    alpha = torch.stack([out[l] for l in sorted(out)])
    if not bool(torch.isfinite(alpha).all()):
        raise ValueError("the attention masses came out NaN or infinite: the model's activations overflow on this "
                         "text (try --dtype float32)")
    return alpha, examined[0]


# ---- the sites ----------------------------------------------------------------------------------------------------
@dataclass
class Site:
    """One sink site: `name` ("first" or "token:<id>"), token id (for first: its token where every sequence starts
    with the same one, else -1), `positions` bool [batch, pos] (its
    sink positions), `level`, `mass` float32 [layer] (mean over its positions of the largest head's alpha), `heads`
    float32 [layer, head] (mean alpha per head), `share` and `median_position`."""

    name: str
    token_id: int
    positions: Tensor
    level: int
    mass: Tensor
    heads: Tensor
    share: float
    median_position: int

    @property
    def head(self) -> int:
        return int(self.heads[self.level].argmax())


def position_levels(alpha: Tensor, epsilon: float) -> Tensor:
    """long [batch, pos]: the first layer at which each position is a sink (max over heads >= epsilon); -1 never.
    alpha [layer, batch, head, pos]."""
    sink = alpha.max(2).values >= epsilon  # [layer, batch, pos]
    first = sink.float().argmax(0)
    return torch.where(sink.any(0), first, -1)


def site_level(mass: Tensor, levels: Tensor, epsilon: float) -> int:
    """A site's level: the first layer where its mass [layer] reaches epsilon; where it never does (its positions
    are sinks in different layers), the lower median of its positions' levels [n_positions]."""
    above = (mass >= epsilon).nonzero()
    if len(above):
        return int(above[0])
    lv = levels.sort().values
    return int(lv[(len(lv) - 1) // 2])


def find_sites(alpha: Tensor, examined: Tensor, tokens: Tensor, epsilon: float) -> list[Site]:
    """The sink sites of the masses alpha [layer, batch, head, pos] (examined [pos], tokens [batch, pos]): `first`
    (where position 0 is a sink at some layer) then one per token id, strongest peak mass first."""
    levels = position_levels(alpha, epsilon)  # [batch, pos]
    is_sink = levels >= 0
    at0 = torch.zeros_like(is_sink)
    at0[:, 0] = True
    same = bool((tokens[:, 0] == tokens[0, 0]).all())  # a BOS: `first` names its token
    groups = [("first", int(tokens[0, 0]) if same else -1, is_sink & at0, at0 & examined[None])]
    later = is_sink & ~at0
    for t in torch.unique(tokens[later]).tolist():
        held = (tokens == t) & ~at0 & examined[None]
        groups.append((f"token:{t}", int(t), later & (tokens == t), held))
    sites = []
    for name, tid, where, held in groups:
        if not bool(where.any()):
            continue
        mass = alpha.max(2).values[:, where].mean(1)  # [layer]
        per_head = alpha.permute(0, 2, 1, 3)[:, :, where]  # [layer, head, n_positions]
        pos = where.nonzero()[:, 1].float()
        sites.append(Site(name, tid, where, site_level(mass, levels[where], epsilon), mass, per_head.mean(2),
                          int(where.sum()) / max(1, int(held.sum())), int(pos.median())))
    first = [s for s in sites if s.name == "first"]
    rest = sorted((s for s in sites if s.name != "first"), key=lambda s: -float(s.mass.max()))
    return first + rest


# ---- what makes each site -----------------------------------------------------------------------------------------
def components(model, level: int) -> list[tuple[str, int]]:
    """(kind, layer) of the components before `level`: "attn" and "mlp" (where the model has MLPs) of each layer."""
    kinds = ("attn",) if model.cfg.d_mlp is None else ("attn", "mlp")
    return [(c, l) for l in range(level) for c in kinds]


def _zero_at(mask: Tensor):
    def hook(x, hook):  # x [batch, pos, d_model]; mask [batch, pos]
        return x.masked_fill(mask.to(x.device)[..., None], 0.0)
    return hook


def site_mass(alpha: Tensor, site: Site) -> float:
    """The site's mass in one layer's alpha [batch, head, pos]: the mean over its positions of the largest head's."""
    return float(alpha.max(1).values[site.positions].mean())


def trace(model, tokens: Tensor, site: Site, *, gap: int = GAP) -> list[dict]:
    """One row per component before the site's level: its output zeroed at the site's positions, the site's mass at
    the level (one forward each, stopping there)."""
    rows, before = [], float(site.mass[site.level])
    for kind, l in components(model, site.level):
        hook = (f"blocks.{l}.hook_{kind}_out", _zero_at(site.positions))
        alpha, _ = masses_pass(model, tokens, gap=gap, layers=[site.level], hooks=[hook])
        after = site_mass(alpha[0], site)
        rows.append(dict(site=site.name, level=site.level, component=f"{kind} {l}", layer=l, mass=before,
                         mass_without=after, change=after - before))
    return rows


# ---- the tables -----------------------------------------------------------------------------------------------------
def sink_levels(model, tokens: Tensor, epsilon: float, delimiters: set[int], *, max_sites: int = MAX_SITES,
                gap: int = GAP, text=str, progress=lambda xs, **kw: xs) -> dict[str, pd.DataFrame]:
    """The three tables of the sink levels of `model` on tokens [batch, pos]: sink_levels (one row per site),
    sink_level_layers (one per site and layer) and sink_level_ablations (one per traced site and component).
    `text(id)` names a token; `delimiters`: the delimiter ids (the kind column)."""
    alpha, examined = masses_pass(model, tokens, gap=gap)
    sites = find_sites(alpha, examined, tokens, epsilon)
    rows, layers, ablations = [], [], []
    traced = sites[:max_sites]
    for site in progress(traced, desc="sink levels"):
        found = trace(model, tokens, site, gap=gap)
        ablations += found
        rows.append(_site_row(site, epsilon, found, text, delimiters))
    rows += [_site_row(s, epsilon, None, text, delimiters) for s in sites[max_sites:]]
    for s in sites:
        for l in range(alpha.shape[0]):
            layers.append(dict(site=s.name, layer=l, mass=float(s.mass[l]), mean_mass=float(s.heads[l].mean()),
                               sink_heads=int((s.heads[l] >= epsilon).sum())))
    return {"sink_levels": pd.DataFrame(rows, columns=list(LEVEL_COLUMNS)),
            "sink_level_layers": pd.DataFrame(layers, columns=list(LAYER_COLUMNS)),
            "sink_level_ablations": pd.DataFrame(ablations, columns=list(ABLATION_COLUMNS))}


def _site_row(site: Site, epsilon: float, found: list[dict] | None, text, delimiters) -> dict:
    kind = "first" if site.name == "first" else "delimiter" if site.token_id in delimiters else "token"
    row = dict(site=site.name, token="" if site.token_id < 0 else text(site.token_id), token_id=site.token_id,
               kind=kind, level=site.level, head=site.head, mass_at_level=float(site.mass[site.level]),
               peak_mass=float(site.mass.max()), peak_layer=int(site.mass.argmax()),
               n_positions=int(site.positions.sum()), share=site.share, median_position=site.median_position,
               traced=found is not None, component="", mass_without=math.nan, removes=False)
    if found is None:
        return row
    if not found:  # level 0: nothing before it but the embedding
        return row | dict(component="embedding")
    best = min(found, key=lambda r: r["mass_without"])
    return row | dict(component=best["component"], mass_without=best["mass_without"],
                      removes=best["mass_without"] < epsilon)


def n_levels(frame: pd.DataFrame) -> int:
    """The sink levels of a sink_levels table: its distinct levels."""
    return int(frame["level"].nunique())
