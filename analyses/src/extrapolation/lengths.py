"""Head scores by context length: how sinks, previous-token, induction and attention distance change
as a model reads 1k, 4k, 8k, 32k tokens, without a pattern at any length.

`length_scores(model, tokens)` is one fused forward; each layer's q and k go through the streaming
statistics kernel (`interp.kernels.attention_stats`) as the layer is computed, and only per-query
numbers leave it. Per head, over every query of every sequence:

    sink             mean attention on token 0 (a sliding-window layer's queries past its window
                     cannot see it and count 0: the mass the head actually puts there)
    previous_token   TransformerLens `detect_head` scores (no exclusions, "mul"): the mean over
    duplicate_token  queries of the attention mass on the previous token, on earlier copies of the
    induction        query's token, on the tokens right after those copies
    distance         mean over queries of the query's expected distance sum_j P[p, j] (p - j)
    distance_p50/p90/p99   quantiles over queries of that expected distance: how far the head looks
    entropy          mean entropy of a query's attention (nats)

The queries scored are those in the second half of the sequence (positions L/2 .. L-1;
`from_fraction`, 0 for all of them as `detect_head` does), so that the number at each length
describes a model that has read about L tokens: a mean over every query would be dominated at
every length by the same early positions, where a query has few keys to choose from (query 0
puts all its attention on token 0).

`scores_by_length(model, tokens, lengths)` takes sequences of the longest length and scores their
first L tokens for each L (the same text at every length: what changes is only how much of it the
model has read), with a `length` column and `extrapolated` (L past the model's trained context).
`scores_at_lengths` gives the same rows from one forward over the longest length (attention is causal:
the first L tokens' queries attend there as they do alone), and the residual stream for a loss.
`role_changes` names the heads whose scores move most between the shortest and longest length;
`how_far` summarises the distance distribution per kind of layer (a sliding window of W tokens, or
global). `LengthStudy` (`interp lengths`; `study.run(LengthStudy(), model, out, LengthSettings(...))` from
Python) writes it all to a folder with a report.
"""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import pandas as pd
import torch
from torch import Tensor

from interp.kernels import attention_stats
from interp.models.placement.device import to_numpy
from interp.errors import as_user_errors
from interp.models.readouts.head_statistics import for_each_layer_qk, layer_scoring

from .._common import progress
from ..document import Section, head_name, png
from ..store import nonfinite_rows
from ..study import Measured, Study, StudySettings, Table

QUANTILES = (0.5, 0.9, 0.99)
FROM_FRACTION = 0.5  # score the queries in the second half of each length (see the module docstring)
MEANS = ("sink", "previous_token", "duplicate_token", "induction", "distance", "entropy")
METRICS = MEANS + tuple(f"distance_p{int(q * 100)}" for q in QUANTILES)
ROLES = ("sink", "previous_token", "duplicate_token", "induction")  # scores in [0, 1]: changes compared directly
_STAT = {"sink": "sink", "previous_token": "previous", "duplicate_token": "duplicate", "induction": "induction",
         "distance": "distance", "entropy": "entropy"}


def first_query(n: int, from_fraction: float) -> int:
    """The first query position scored at length n: floor(n * from_fraction), at most n - 1."""
    return min(n - 1, int(n * from_fraction))


def head_metrics(st, start: int = 0, end: int | None = None) -> Tensor:
    """[len(METRICS), head] from the per-query statistics `st` ([batch, head, query] each): every mean over
    (batch, queries start..end-1) and the quantiles over them of the expected distance, on the stats' device."""
    picked = slice(start, end)
    means = [getattr(st, _STAT[name])[:, :, picked].float().mean((0, 2)) for name in MEANS]
    dist = st.distance[:, :, picked].float().transpose(0, 1)
    dist = dist.reshape(dist.shape[0], -1)  # [head, batch * queries]
    return torch.cat([torch.stack(means), torch.quantile(dist, torch.tensor(QUANTILES, device=dist.device), dim=1)])


def metric_rows(values: Tensor) -> pd.DataFrame:
    """Long rows layer, head, metric, value of `values` [len(METRICS), layer, head]."""
    n_layers, n_heads = values.shape[1:]
    layer, head = np.meshgrid(np.arange(n_layers), np.arange(n_heads), indexing="ij")
    return pd.concat([pd.DataFrame({"layer": layer.ravel(), "head": head.ravel(), "metric": m,
                                    "value": to_numpy(values[i].reshape(-1))}) for i, m in enumerate(METRICS)],
                     ignore_index=True)


def length_scores(model, tokens: Tensor, *, from_fraction: float = FROM_FRACTION, backend: str = "auto") -> pd.DataFrame:
    """Long rows layer, head, metric, value (`METRICS`) for every head on `tokens` [batch, pos] (equal
    lengths, no padding), over the queries at positions >= floor(pos * from_fraction) (0: all, as
    TransformerLens's `detect_head`): one fused forward, the streaming kernel per layer on those
    queries against every key, nothing n x n."""
    tokens = model.prepare(tokens, padding=False).tokens
    if not 0.0 <= from_fraction < 1.0:
        raise ValueError(f"from_fraction must be in [0, 1), got {from_fraction!r}")
    start = first_query(tokens.shape[1], from_fraction)
    cfg = model.cfg
    out = torch.empty(len(METRICS), cfg.n_layers, cfg.n_heads)

    def fn(layer, q, k, v):
        st = attention_stats(q[:, :, start:], k, tokens, layer_scoring(model, layer), n_sink=1, backend=backend)
        out[:, layer] = head_metrics(st).cpu()

    with torch.no_grad():
        for_each_layer_qk(model, tokens, fn)
    return metric_rows(out)


def scores_at_lengths(model, tokens: Tensor, lengths: Sequence[int], *, from_fraction: float = FROM_FRACTION,
                      backend: str = "auto", each_layer=None) -> tuple[pd.DataFrame, Tensor]:
    """`scores_by_length`'s rows from ONE forward over `tokens` [batch, max(lengths)]: attention is causal, so
    the queries of the first L tokens attend exactly as they do in a forward over those L tokens alone, and
    each layer's kernel call scores the queries from floor(min(L) * from_fraction) on, once, against every
    key; each length then reads its own queries [floor(L * from_fraction), L) out of those per-query
    statistics (not so where the rotary frequencies follow the call's length: dynamic NTK, LongRoPE past its
    original length; run those a length at a time). Returns (long rows length, layer, head, metric, value,
    extrapolated; the residual stream after the last layer, [batch, pos, d_model], for a loss at no second
    forward). `each_layer(layer, q, k)` is called with each layer's q [batch, head, pos, d_head] and k (after
    RoPE) as they are computed."""
    tokens = model.prepare(tokens, padding=False).tokens
    lengths = check_lengths(list(lengths), 10**12)
    if tokens.shape[1] != lengths[-1]:
        raise ValueError(f"the sequences hold {tokens.shape[1]} tokens; scores_at_lengths reads sequences of the "
                         f"longest length, {lengths[-1]}")
    if not 0.0 <= from_fraction < 1.0:
        raise ValueError(f"from_fraction must be in [0, 1), got {from_fraction!r}")
    cfg = model.cfg
    lo = min(first_query(n, from_fraction) for n in lengths)
    out = torch.empty(len(lengths), len(METRICS), cfg.n_layers, cfg.n_heads)

    def fn(layer, q, k, v):
        st = attention_stats(q[:, :, lo:], k, tokens, layer_scoring(model, layer), n_sink=1, backend=backend)
        for i, n in enumerate(lengths):
            out[i, :, layer] = head_metrics(st, first_query(n, from_fraction) - lo, n - lo).cpu()
        if each_layer is not None:
            each_layer(layer, q, k)

    with torch.no_grad():
        resid = for_each_layer_qk(model, tokens, fn)
    frames = []
    for i, n in enumerate(lengths):
        frame = metric_rows(out[i])
        bad = nonfinite_rows(frame)
        if bad:  # NaN is an error, never a finding
            raise ValueError(f"length {n}: non-finite scores at {', '.join(bad[:5])}")
        frames.append(frame.assign(length=n, extrapolated=n > cfg.n_ctx))
    return pd.concat(frames, ignore_index=True)[["length", "layer", "head", "metric", "value", "extrapolated"]], resid


def check_lengths(lengths: Sequence[int], n_ctx: int, *, extrapolate: bool = False, minimum: int = 2) -> list[int]:
    """Sorted distinct lengths, each >= `minimum`; past `n_ctx` only with `extrapolate` (one line otherwise)."""
    if not lengths:
        raise ValueError("--lengths: give at least one length, e.g. --lengths 1024,4096,8192")
    bad = [n for n in lengths if isinstance(n, bool) or not isinstance(n, int) or n < minimum]
    if bad:
        raise ValueError(f"--lengths {bad[0]!r}: every length must be a whole number of tokens >= {minimum}")
    past = [n for n in lengths if n > n_ctx]
    if past and not extrapolate:
        raise ValueError(f"--lengths {past[0]} is longer than the model's trained context (n_ctx={n_ctx:,}): pass "
                         "--extrapolate to run past it (those lengths are marked extrapolated), or drop it")
    return sorted(set(lengths))


def scores_by_length(model, tokens: Tensor, lengths: Sequence[int], *, from_fraction: float = FROM_FRACTION,
                     backend: str = "auto", progress_bar: bool | None = None, timings: dict | None = None) -> pd.DataFrame:
    """`length_scores` on the first L tokens of `tokens` [batch, >= max(lengths)] for each L: long rows
    length, layer, head, metric, value, extrapolated. `timings` (a dict) gets {L: seconds}."""
    lengths = check_lengths(list(lengths), 10**12)
    if tokens.shape[1] < lengths[-1]:
        raise ValueError(f"the sequences hold {tokens.shape[1]} tokens, fewer than the longest length {lengths[-1]}")
    frames = []
    for n in progress(lengths, total=len(lengths), desc="lengths", enabled=progress_bar):
        start = time.perf_counter()
        frame = length_scores(model, tokens[:, :n], from_fraction=from_fraction, backend=backend)
        if timings is not None:
            timings[n] = time.perf_counter() - start
        bad = nonfinite_rows(frame)
        if bad:  # NaN is an error, never a finding
            raise ValueError(f"length {n}: non-finite scores at {', '.join(bad[:5])}")
        frames.append(frame.assign(length=n, extrapolated=n > model.cfg.n_ctx))
    return pd.concat(frames, ignore_index=True)[["length", "layer", "head", "metric", "value", "extrapolated"]]


def wide(frame: pd.DataFrame, metric: str) -> pd.DataFrame:
    """[head name] x [length] table of one metric."""
    part = frame[frame["metric"] == metric]
    table = part.pivot_table(index=["layer", "head"], columns="length", values="value")
    table.index = [head_name(l, h) for l, h in table.index]
    return table


def role_changes(frame: pd.DataFrame, top: int = 10) -> pd.DataFrame:
    """The heads whose role scores (sink, previous-token, duplicate-token, induction) move most between
    the shortest and the longest length: head, the score that moved most, its value at both ends,
    the change, and the head's mean distance at both ends. Sorted by |change|."""
    lengths = sorted(frame["length"].unique())
    lo, hi = lengths[0], lengths[-1]
    rows = []
    dist = wide(frame, "distance")
    for metric in ROLES:
        w = wide(frame, metric)
        for name, values in w.iterrows():
            rows.append({"head": name, "score": metric, f"at {lo:,}": values[lo], f"at {hi:,}": values[hi],
                         "change": values[hi] - values[lo],
                         f"distance at {lo:,}": dist.loc[name, lo], f"distance at {hi:,}": dist.loc[name, hi]})
    table = pd.DataFrame(rows)
    if table.empty:
        return table
    table = table.loc[table["change"].abs().groupby(table["head"]).idxmax()]  # each head once, by its largest move
    return table.reindex(table["change"].abs().sort_values(ascending=False).index).head(top).reset_index(drop=True)


def layer_kinds(windows: Sequence[int | None]) -> dict[int, str]:
    """{layer: "global" or "window W"}."""
    return {l: "global" if w is None else f"window {w}" for l, w in enumerate(windows)}


def how_far(frame: pd.DataFrame, windows: Sequence[int | None]) -> pd.DataFrame:
    """Per kind of layer and length: the heads' mean distance and distance quantiles (the mean over
    the heads of that kind, and the largest p99 of any of them), and the mean sink mass."""
    kinds = layer_kinds(windows)
    f = frame.assign(kind=frame["layer"].map(kinds))
    piv = f.pivot_table(index=["kind", "length", "layer", "head"], columns="metric", values="value").reset_index()
    out = piv.groupby(["kind", "length"]).agg(
        heads=("head", "size"), sink=("sink", "mean"), distance=("distance", "mean"),
        p50=("distance_p50", "mean"), p90=("distance_p90", "mean"), p99=("distance_p99", "mean"),
        max_p99=("distance_p99", "max")).reset_index()
    return out.sort_values(["kind", "length"]).reset_index(drop=True)


# ---- figures -------------------------------------------------------------------------------------
PANELS = (("sink", "attention on token 0"), ("previous_token", "previous-token"), ("induction", "induction"),
          ("distance", "mean attention distance (tokens)"))


def plot_by_length(frame: pd.DataFrame, named: Sequence[str], windows: Sequence[int | None]):
    """Four panels (sink, previous-token, induction, mean distance) against length: one grey line per
    head (dashed for sliding-window layers), the named heads in colour."""
    from matplotlib.figure import Figure

    kinds = layer_kinds(windows)
    fig = Figure(figsize=(12, 7.5))
    axes = fig.subplots(2, 2)
    colours = dict(zip(named, [f"C{i}" for i in range(10)]))
    for ax, (metric, title) in zip(axes.ravel(), PANELS):
        w = wide(frame, metric)
        if metric == "distance":  # a log axis; a head that attends to itself has distance 0
            w = w.clip(lower=0.5)
        for name, values in w.iterrows():
            layer = int(name[1:].split("H")[0])
            style = "--" if kinds[layer] != "global" else "-"
            if name in colours:
                ax.plot(w.columns, values.to_numpy(), style, color=colours[name], lw=2, label=name, marker="o", ms=3)
            else:
                ax.plot(w.columns, values.to_numpy(), style, color="0.75", lw=0.7)
        ax.set_xscale("log", base=2)
        ax.set_xticks(list(w.columns), [f"{n:,}" for n in w.columns], fontsize=8)
        ax.minorticks_off()
        if metric == "distance":
            ax.set_yscale("log")
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("context length (tokens)", fontsize=8)
    handles, labels = axes[0, 0].get_legend_handles_labels()
    if handles:
        fig.legend(handles, labels, loc="upper center", ncol=min(10, len(handles)), fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0, 1, 0.95))
    return fig


def plot_distance(frame: pd.DataFrame, windows: Sequence[int | None]):
    """At the longest length: every head's distance quantiles (p50 dot, p90 bar, p99 cap) by layer,
    global layers in red, sliding-window layers in blue with their window drawn."""
    from matplotlib.figure import Figure

    n = frame["length"].max()
    last = frame[frame["length"] == n].pivot_table(index=["layer", "head"], columns="metric", values="value")
    fig = Figure(figsize=(12, 4))
    ax = fig.subplots()
    n_heads = int(frame["head"].max()) + 1
    for (layer, head), row in last.iterrows():
        x = layer + (head + 0.5) / n_heads - 0.5
        colour = "C3" if windows[layer] is None else "C0"
        ax.plot([x, x], [max(row["distance_p50"], 0.5), max(row["distance_p99"], 0.5)], color=colour, lw=1, alpha=0.5)
        ax.plot([x], [max(row["distance_p90"], 0.5)], "_", color=colour, ms=6)
        ax.plot([x], [max(row["distance_p50"], 0.5)], "o", color=colour, ms=3)
    for w in sorted({w for w in windows if w is not None}):
        ax.axhline(w, color="C0", lw=0.6, ls=":")
    ax.axhline(n, color="0.4", lw=0.6, ls=":")
    ax.set_yscale("log")
    ax.set_xlabel("layer (heads side by side; red: global, blue: sliding window)")
    ax.set_ylabel("expected distance of a query (tokens)")
    ax.set_title(f"How far each head looks at {n:,} tokens: p50 (dot), p90 (tick), p99 (line end) over queries",
                 fontsize=10)
    ax.set_xticks(range(len(windows)))
    fig.tight_layout()
    return fig


# ---- the study -------------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True, eq=False)
class LengthSettings(StudySettings):
    """lengths: the context lengths, each scored on the first L tokens of the same sequences (`data`, at
    least the longest length); past the model's trained context only with `extrapolate` (marked)."""

    lengths: tuple[int, ...] = ()
    extrapolate: bool = False
    backend: str = "auto"
    from_fraction: float = FROM_FRACTION


@dataclass(frozen=True, kw_only=True, eq=False)
class LengthMeasured(Measured):
    """Beside the table: the lengths scored, the model's trained context and its layers' windows."""

    lengths: list[int]
    n_ctx: int
    windows: list[int | None]


class LengthStudy(Study):
    """`interp lengths`: every head's scores at each length (`scores_by_length`), the heads whose role
    changes most, how far each kind of layer looks."""

    name = "lengths"
    title = "Head scores by context length"
    tables = (Table("lengths", ("length", "layer", "head", "metric", "value", "extrapolated"), csv=True),)

    def check(self, cfg, s: LengthSettings):
        lengths = check_lengths(list(s.lengths), cfg.n_ctx, extrapolate=s.extrapolate)
        s.placement.check_fits(cfg, s.data.rows, lengths[-1], what="--lengths")
        if s.data.spec is None or s.data.spec.kind not in ("text", "corpus"):
            kind = s.data.spec.kind if s.data.spec is not None else "file"
            raise ValueError(f"--lengths needs text or the zoo corpus (scores on the same text at every length); "
                             f"--data {kind} is not that")
        data = s.data.at_length(lengths[-1])
        data.check()
        return dataclasses.replace(s, lengths=tuple(lengths), data=data), []

    def measure(self, model, s: LengthSettings, stage):
        lengths = check_lengths(list(s.lengths), model.cfg.n_ctx, extrapolate=s.extrapolate)
        tokens = s.data.tokens(model)
        with as_user_errors(ValueError):  # NaN scores (`scores_by_length`): one line, never a finding
            frames = [stage(f"{n} tokens", lambda n=n: scores_by_length(model, tokens, [n], from_fraction=s.from_fraction,
                                                                        backend=s.backend, progress_bar=False))
                      for n in lengths]
        return LengthMeasured(tables={"lengths": pd.concat(frames, ignore_index=True)}, lengths=lengths,
                              n_ctx=model.cfg.n_ctx, windows=list(model.cfg.windows()))

    def record(self, s: LengthSettings, m: LengthMeasured) -> dict:
        lengths, n_ctx = m.lengths, m.n_ctx
        return {"lengths": lengths, "n_sequences": s.data.rows, "n_ctx": n_ctx, "queries_from_fraction": s.from_fraction,
                "extrapolated": [n for n in lengths if n > n_ctx], "layer_windows": m.windows,
                "metrics": list(METRICS)}

    def sections(self, s: LengthSettings, m: LengthMeasured, record) -> list[Section]:
        return report_sections(m["lengths"], record)


def report_sections(frame: pd.DataFrame, settings: dict) -> list[Section]:
    """The report of `LengthStudy` from its table and settings.json."""
    lengths = settings["lengths"]
    windows = settings["layer_windows"]
    changes = role_changes(frame) if len(lengths) > 1 else pd.DataFrame()
    named = list(changes["head"].head(6)) if not changes.empty else []
    past = settings.get("extrapolated") or []
    summary = Section("summary", "Summary").add(
        f"Every head's scores at {', '.join(f'{n:,}' for n in lengths)} tokens: the first L tokens of the same "
        f"{settings['n_sequences']} sequence(s) at each length ({settings['data_description']}), scored over the queries "
        f"at positions {settings['queries_from_fraction']:g} L .. L - 1 (so each number describes a model that has read "
        "about L tokens). One fused forward per "
        "length; the streaming statistics kernel scores each layer as it is computed, so no n x n pattern exists at "
        "any length.",
        (f"EXTRAPOLATED: {', '.join(f'{n:,}' for n in past)} tokens are past the model's trained context "
         f"({settings['n_ctx']:,} tokens); those columns describe the model used beyond what it was trained on."
         if past else None))
    if named:
        top = changes.iloc[0]
        summary.add(f"The head whose role changes most: {top['head']}, whose {top['score'].replace('_', '-')} score "
                    f"goes from {top.iloc[2]:.3f} at {lengths[0]:,} tokens to {top.iloc[3]:.3f} at {lengths[-1]:,}.")
    sections = [summary]
    by_length = Section("by-length", "Scores against context length")
    if len(lengths) > 1:
        by_length.add("Each line is one head (dashed: a sliding-window layer); the heads whose role scores move most are "
                      "in colour. Scores are means over the queries in the scored part of the first L tokens.",
                      png(plot_by_length(frame, named, windows), "by_length.png"))
        by_length.add(f"The heads whose role moves most between {lengths[0]:,} and {lengths[-1]:,} tokens (each head by "
                      "its largest change among sink, previous-token, duplicate-token and induction):",
                      changes.round(4))
    for metric in ("sink", "previous_token", "induction", "distance"):
        w = wide(frame, metric)
        top = w[w.columns[-1]].sort_values(ascending=False).head(8)
        table = w.loc[top.index].reset_index().rename(columns={"index": "head"})
        table.columns = [str(c) if not isinstance(c, (int, np.integer)) else f"{int(c):,}" for c in table.columns]
        by_length.add(f"The 8 heads highest in {metric.replace('_', '-')} at {lengths[-1]:,} tokens, at every length:",
                      table.round(4))
    sections.append(by_length)
    far = Section("how-far", "How far heads look")
    table = how_far(frame, windows)
    far.add("Per kind of layer and length: the mean over its heads of the mean attention distance and of the distance "
            "quantiles over queries (p50, p90, p99 of a query's expected distance), the largest p99 of any head, and the "
            "mean attention on token 0." + (" A sliding-window layer cannot look past its window; what the global "
                                             "layers do with the rest of the context is the question."
                                             if any(w is not None for w in windows) else ""),
            table.round(4), png(plot_distance(frame, windows), "distance.png"))
    sections.append(far)
    sections.append(Section("settings", "Settings").add("```\n" + json.dumps(settings, indent=2) + "\n```"))
    return sections
