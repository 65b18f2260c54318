"""Every figure the analyses draw, in one place.

Part 1 takes an analyzer's DataFrame (layer x head heatmaps, curves, composition matrices); part 2
takes a sweep's tidy results table (run, checkpoint, step, analysis, layer, head, metric, value),
already restricted to one run, and returns a Figure or None when there is nothing to draw.

Figures are built with `matplotlib.figure.Figure`, not pyplot: nothing global, nothing shown or
saved (`fig.savefig(path)`), no display needed; in a notebook a figure as a cell's value shows as a
PNG (see `NotebookFigure`). matplotlib is imported on first use, so `import interp.analyses` stays fast.
"""

from __future__ import annotations

import functools
import io
import math
from typing import Sequence

import numpy as np
import pandas as pd

_VALUE_COLUMNS = ("score", "delta", "importance", "alpha", "attribution", "sink_rate")
_FACET_COLUMNS = ("kind", "method", "key")


@functools.cache
def _notebook_figure() -> type:
    """`NotebookFigure`: `matplotlib.figure.Figure` plus `_repr_png_`, made on first use (importing
    matplotlib takes a second or more, so `import interp.analyses` does not).

    IPython renders a Figure made without pyplot as text ("<Figure size 1260x340 with 6 Axes>")
    unless `%matplotlib inline` registered a PNG formatter for Figure; with `_repr_png_` the
    analyzers' figures show as images in any notebook, whatever MPLBACKEND says (Agg included)."""
    from matplotlib.figure import Figure

    class NotebookFigure(Figure):
        def _repr_png_(self) -> bytes:
            buf = io.BytesIO()
            self.savefig(buf, format="png", bbox_inches="tight")
            return buf.getvalue()

    NotebookFigure.__module__, NotebookFigure.__qualname__ = __name__, "NotebookFigure"  # pickle finds it
    return NotebookFigure


def __getattr__(name: str):  # `interp.analyses.plots.NotebookFigure`, built lazily (PEP 562)
    if name == "NotebookFigure":
        return _notebook_figure()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _figure(n_panels: int, width: float = 4.2, height: float = 3.4, ncols: int | None = None):
    """A `NotebookFigure` (a matplotlib Figure, not pyplot: no global state, no display needed;
    a notebook shows it as PNG)."""
    ncols = ncols or min(n_panels, 3)
    nrows = math.ceil(n_panels / ncols)
    fig = _notebook_figure()(figsize=(width * ncols, height * nrows))
    axes = fig.subplots(nrows, ncols, squeeze=False)
    for ax in axes.flat[n_panels:]:
        ax.set_visible(False)
    return fig, list(axes.flat[:n_panels])


def text_colour(rgba) -> str:
    """Black or white, whichever reads on a cell of colour `rgba` (relative luminance, ITU-R BT.709)."""
    r, g, b = rgba[:3]
    return "black" if 0.2126 * r + 0.7152 * g + 0.0722 * b > 0.45 else "white"


def plot_head_scores(
    df: pd.DataFrame, value: str | None = None, *, facet: str | None = None, title: str | None = None,
    cmap: str = "viridis", vmin: float | None = None, vmax: float | None = None, annotate: bool | None = None,
):
    """Heatmap(s) of `value` over layers (rows) x heads (columns), one panel per distinct `facet`.

    value: default the first of score / delta / importance / alpha / attribution in the frame.
    facet: default the first of kind / method / key with several values (one panel otherwise).
    Several rows for the same (facet, layer, head) are averaged. annotate: write the numbers
    (default when the grid is small)."""
    if not {"layer", "head"} <= set(df.columns):
        raise ValueError(f"plot_head_scores needs 'layer' and 'head' columns; this frame has {list(df.columns)}")
    value = value or next((c for c in _VALUE_COLUMNS if c in df.columns), None)
    if value is None or value not in df.columns:
        raise ValueError(f"name the column to plot with value=...; columns: {list(df.columns)}")
    if facet is None:
        facet = next((c for c in _FACET_COLUMNS if c in df.columns and df[c].nunique() > 1), None)
    groups = [(None, df)] if facet is None else list(df.groupby(facet, sort=False))
    fig, axes = _figure(len(groups))
    diverging = vmin is None and vmax is None and (df[value] < 0).any() and (df[value] > 0).any()
    if diverging:
        bound = float(df[value].abs().max())
        vmin, vmax, cmap = -bound, bound, "RdBu_r" if cmap == "viridis" else cmap
    for ax, (name, part) in zip(axes, groups):
        grid = part.pivot_table(index="layer", columns="head", values=value, aggfunc="mean")
        im = ax.imshow(grid.to_numpy(), cmap=cmap, vmin=vmin, vmax=vmax, aspect="auto")
        ax.set_xticks(range(grid.shape[1]), [str(h) for h in grid.columns])
        every = max(1, -(-grid.shape[0] // 16))  # at most ~16 layer labels, so 30 layers stay legible
        ax.set_yticks(range(0, grid.shape[0], every), [str(l) for l in grid.index[::every]])
        ax.set_xlabel("head")
        ax.set_ylabel("layer")
        label = name if isinstance(name, str) else f"{facet} {name}"  # a bare number ("0: alpha") says nothing
        ax.set_title(value if name is None else f"{label}: {value}")
        if annotate or (annotate is None and grid.size <= 64):
            arr = grid.to_numpy()
            for i in range(arr.shape[0]):
                for j in range(arr.shape[1]):
                    if arr[i, j] == arr[i, j]:  # not NaN
                        ax.text(j, i, f"{arr[i, j]:.2f}", ha="center", va="center", fontsize=7,
                                color=text_colour(im.cmap(im.norm(arr[i, j]))))
        fig.colorbar(im, ax=ax, shrink=0.8).set_label(value)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return fig


def plot_curve(
    df: pd.DataFrame, x: str | None = None, y: str | Sequence[str] = "loss", *, hue: str | None = None,
    title: str | None = None, logy: bool = False,
):
    """Line plot of y (one or several columns, one panel each) against x, one line per `hue` value.

    Defaults fit the analyzers: pruning curves (x="fraction_pruned"), window_eval (x="window",
    hue="setting"; a setting without x, such as full attention, is drawn as a horizontal line)."""
    if x is None:
        x = next((c for c in ("fraction_pruned", "window", "step") if c in df.columns), None)
        if x is None:
            raise ValueError(f"name the x column with x=...; columns: {list(df.columns)}")
    if hue is None and "setting" in df.columns:
        hue = "setting"
    ys = [y] if isinstance(y, str) else list(y)
    fig, axes = _figure(len(ys), width=5.0, ncols=len(ys))
    groups = [(None, df)] if hue is None else list(df.groupby(hue, sort=False, dropna=False))
    for ax, col in zip(axes, ys):
        for name, part in groups:
            part = part.sort_values(x)
            if part[x].isna().all():
                ax.axhline(float(part[col].mean()), linestyle="--", color="gray", label=str(name))
            else:
                ax.plot(part[x], part[col], marker="o", markersize=3, label=None if name is None else str(name))
        ax.set_xlabel(x)
        ax.set_ylabel(col)
        if logy:
            ax.set_yscale("log")
        if hue is not None:
            ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return fig


def plot_composition(df: pd.DataFrame, kind: str = "q", *, value: str = "score", title: str | None = None):
    """Heatmap of one composition kind: earlier heads (rows) x later heads (columns), "L{l}H{h}"."""
    part = df[df["kind"] == kind]
    if part.empty:
        raise ValueError(f"no rows of kind {kind!r}; kinds in this frame: {sorted(df['kind'].unique())}")
    rows = part.assign(a=part.layer_a * 10_000 + part.head_a, b=part.layer_b * 10_000 + part.head_b)
    grid = rows.pivot_table(index="a", columns="b", values=value, aggfunc="mean")
    label = lambda k: f"L{k // 10_000}H{k % 10_000}"
    fig, (ax,) = _figure(1, width=max(4.0, 0.25 * grid.shape[1] + 2), height=max(3.4, 0.25 * grid.shape[0] + 1.5))
    im = ax.imshow(grid.to_numpy(), cmap="viridis", aspect="auto")
    ax.set_xticks(range(grid.shape[1]), [label(k) for k in grid.columns], rotation=90, fontsize=7)
    ax.set_yticks(range(grid.shape[0]), [label(k) for k in grid.index], fontsize=7)
    ax.set_xlabel("later head (reads)")
    ax.set_ylabel("earlier head (writes)")
    ax.set_title(title or f"{kind.upper()}-composition ({value})")
    fig.colorbar(im, ax=ax, shrink=0.8)
    fig.tight_layout()
    return fig


# ==== part 2: figures of a sweep's results table ==========================================
def _grid(table: pd.DataFrame, metric: str) -> np.ndarray:
    part = table[(table["metric"] == metric) & table["layer"].notna()]
    return part.pivot_table(index="layer", columns="head", values="value", aggfunc="mean").to_numpy()


def head_heatmaps(table: pd.DataFrame, metrics: list[str], title: str, labels: dict | None = None):
    """Layers x heads heatmaps of `metrics` at one checkpoint (the analyzers' plot_head_scores);
    `labels` maps a metric to its panel title (default: the metric's name)."""
    labels = labels or {}
    part = table[table["metric"].isin(metrics) & table["layer"].notna()]
    if part.empty:
        return None
    present = [m for m in metrics if m in set(part["metric"])]
    kind = pd.Categorical(part["metric"].astype(str).map(lambda m: labels.get(m, m)),
                          [labels.get(m, m) for m in present])
    frame = pd.DataFrame({"layer": part["layer"].astype(int), "head": part["head"].astype(int), "kind": kind,
                          "score": part["value"]})
    return plot_head_scores(frame.sort_values("kind"), "score", facet="kind", title=title)


def small_multiples(table: pd.DataFrame, metric: str, max_panels: int = 24):
    """One layers x heads heatmap of `metric` per checkpoint, one shared colour scale."""
    part = table[(table["metric"] == metric) & table["layer"].notna()]
    ckpts = part.drop_duplicates("checkpoint")[["checkpoint", "step"]]
    if len(ckpts) < 2:
        return None
    if len(ckpts) > max_panels:  # evenly spaced, first and last kept
        keep = np.unique(np.linspace(0, len(ckpts) - 1, max_panels).round().astype(int))
        ckpts = ckpts.iloc[keep]
    ncols = min(6, len(ckpts))
    nrows = math.ceil(len(ckpts) / ncols)
    fig = _notebook_figure()(figsize=(1.9 * ncols + 0.8, 1.7 * nrows + 0.6), layout="constrained")
    axes = fig.subplots(nrows, ncols, squeeze=False)
    vmax = max(float(part["value"].max()), 1e-9)
    im = None
    for ax, (ckpt, step) in zip(axes.flat, ckpts.itertuples(index=False)):
        im = ax.imshow(_grid(part[part["checkpoint"] == ckpt], metric), vmin=0, vmax=vmax, cmap="viridis", aspect="auto")
        ax.set_title(f"step {step}" if pd.notna(step) else str(ckpt), fontsize=8)
        ax.set_xticks([])
        ax.set_yticks(range(int(part["layer"].max()) + 1))
        ax.tick_params(labelsize=7)
    for ax in axes.flat[len(ckpts):]:
        ax.set_visible(False)
    fig.suptitle(f"{metric} per head (rows: layers, columns: heads) across checkpoints", fontsize=10)
    fig.colorbar(im, ax=axes.ravel().tolist(), shrink=0.8)
    return fig


def best_head_curves(table: pd.DataFrame, metrics: list[str], phase: dict | None, icl: pd.DataFrame | None,
                     log_steps: bool = False):
    """Score vs step of the best head (at the last checkpoint) per metric; the phase change shaded;
    the ICL score on a second axis below. The step axis is linear (a phase change late in training
    stays wide); `log_steps` for a symmetric-log axis."""
    part = table[table["metric"].isin(metrics) & table["layer"].notna() & table["step"].notna()]
    if part["step"].nunique() < 2:
        return None
    has_icl = icl is not None and len(icl) >= 2
    fig = _notebook_figure()(figsize=(8, 5.6 if has_icl else 3.8))
    axes = fig.subplots(2 if has_icl else 1, 1, sharex=True, squeeze=False)[:, 0]
    ax = axes[0]
    for metric in metrics:
        m = part[part["metric"] == metric]
        if m.empty:
            continue
        last = m[m["step"] == m["step"].max()]
        best = last.loc[last["value"].idxmax()]
        curve = m[(m["layer"] == best["layer"]) & (m["head"] == best["head"])].sort_values("step")
        ax.plot(curve["step"], curve["value"], marker="o", markersize=3, label=f"{metric} (L{best['layer']}H{best['head']})")
    ax.set_ylabel("score of the best head")
    ax.legend(fontsize=8)
    if has_icl:
        axes[1].plot(icl["step"], icl["value"], marker="o", markersize=3, color="tab:red")
        axes[1].axhline(0, color="gray", linewidth=0.8)
        axes[1].set_ylabel("ICL score\n(loss late - early)")
    for a in axes:
        a.grid(alpha=0.3)
        if phase is not None:
            a.axvspan(phase["start"], phase["end"], color="orange", alpha=0.25,
                      label="phase change" if a is axes[0] else None)
        if log_steps and part["step"].min() >= 0:
            a.set_xscale("symlog", linthresh=max(1.0, float(part.loc[part["step"] > 0, "step"].min())))
    if phase is not None:
        ax.legend(fontsize=8)
    axes[-1].set_xlabel("training step")
    fig.suptitle("head scores across training" + (" (shaded: steepest rise of the induction score)" if phase else ""),
                 fontsize=10)
    fig.tight_layout()
    return fig


def sinks_per_layer(table: pd.DataFrame, log_steps: bool = False):
    """Mean attention to the first token (alpha_0) per layer, against step (or per layer at one
    checkpoint); the y-range fitted to the data."""
    part = table[(table["metric"] == "sink_alpha") & table["layer"].notna()]
    if part.empty:
        return None
    per = part.groupby(["layer", "step", "checkpoint"], dropna=False, as_index=False)["value"].mean()
    fig = _notebook_figure()(figsize=(7, 3.4))
    ax = fig.subplots()
    if per["checkpoint"].nunique() >= 2 and per["step"].notna().all():
        for layer, curve in per.groupby("layer"):
            curve = curve.sort_values("step")
            ax.plot(curve["step"], curve["value"], marker="o", markersize=3, label=f"layer {layer}")
        ax.set_xlabel("training step")
        if log_steps and per["step"].min() >= 0 and (per["step"] > 0).any():
            ax.set_xscale("symlog", linthresh=float(per.loc[per["step"] > 0, "step"].min()))
        ax.legend(fontsize=8, ncol=max(1, per["layer"].nunique() // 8))
    else:
        ax.bar(per["layer"].astype(int), per["value"])
        ax.set_xlabel("layer")
    ax.set_ylabel("mean attention to token 0")
    lo, hi = float(per["value"].min()), float(per["value"].max())
    pad = max(0.02, 0.08 * (hi - lo))
    ax.set_ylim(max(0.0, lo - pad), min(1.0, hi + pad))
    ax.grid(alpha=0.3)
    ax.set_title("attention sink: mean alpha_0 over the heads of each layer (Gu et al. 2024)", fontsize=10)
    fig.tight_layout()
    return fig


def pruning_curves(points: pd.DataFrame, threshold: float | None = None):
    """Loss against the fraction of heads pruned: `points` [order, seed, fraction, loss], one line per
    order; an order with several seeds is drawn as its mean with the min-max band; `threshold` dotted."""
    if points.empty:
        return None
    fig = _notebook_figure()(figsize=(6.4, 3.8))
    ax = fig.subplots()
    for order, curve in points.groupby("order"):
        stats = curve.groupby("fraction")["loss"].agg(["mean", "min", "max", "size"]).sort_index()
        seeds = curve["seed"].nunique() if "seed" in curve else 1
        line, = ax.plot(stats.index, stats["mean"], marker="o", markersize=3,
                        label=f"{order} order" + (f" (mean of {seeds} seeds)" if seeds > 1 else ""))
        if seeds > 1:
            ax.fill_between(stats.index, stats["min"], stats["max"], color=line.get_color(), alpha=0.2)
    if threshold is not None:
        ax.axhline(threshold, color="gray", linestyle=":", linewidth=1, label="+5% of the clean loss")
    return _finished(fig, ax, "fraction of heads pruned", "held-out loss", "pruning curve (Michel et al. 2019)")


def _finished(fig, ax, xlabel: str, ylabel: str, title: str):
    """A one-axes figure's labels, legend, grid and title, laid out: the figure."""
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    return fig


def attribution_scatter(table: pd.DataFrame):
    """Attribution-patching estimate vs exact ablation delta per head, with the correlations."""
    est = table[(table["metric"] == "attribution") & table["layer"].notna()]
    exact = table[(table["metric"] == "exact_delta") & table["layer"].notna()]
    if est.empty or exact.empty:
        return None
    both = est.merge(exact, on=["layer", "head"], suffixes=("_est", "_exact"))
    fig = _notebook_figure()(figsize=(4.6, 4.2))
    ax = fig.subplots()
    ax.scatter(both["value_exact"], both["value_est"], s=18)
    lo = float(min(both["value_exact"].min(), both["value_est"].min()))
    hi = float(max(both["value_exact"].max(), both["value_est"].max()))
    ax.plot([lo, hi], [lo, hi], color="gray", linewidth=0.8, linestyle="--")
    for r in both.itertuples():
        ax.annotate(f"L{r.layer}H{r.head}", (r.value_exact, r.value_est), fontsize=6, alpha=0.7)
    ax.set_xlabel("exact mean-ablation delta loss")
    ax.set_ylabel("attribution estimate")
    ax.grid(alpha=0.3)
    corr = {m: table.loc[table["metric"] == f"attribution_{m}", "value"] for m in ("pearson", "spearman")}
    r = ", ".join(f"{m} {float(v.iloc[0]):+.2f}" for m, v in corr.items() if len(v))
    ax.set_title("attribution patching vs exact ablation" + (f"\n({r})" if r else ""), fontsize=10)
    fig.tight_layout()
    return fig


def position_losses(points: pd.DataFrame, bin_size: int | None = None):
    """Loss against position, one line per (setting, window): `points` [setting, window, position,
    loss]; losses averaged over bins of `bin_size` positions (default: ~64 bins) to tame the noise."""
    if points.empty:
        return None
    n = int(points["position"].max()) + 1
    bin_size = bin_size or max(1, n // 64)
    fig = _notebook_figure()(figsize=(7.5, 3.8))
    ax = fig.subplots()
    for (setting, window), curve in points.groupby(["setting", "window"], sort=False):
        binned = curve.groupby(curve["position"] // bin_size * bin_size)["loss"].mean()
        label = setting if not window else f"{setting} (window {window})"
        ax.plot(binned.index, binned.to_numpy(), linewidth=1.2, label=label,
                linestyle="-" if setting != "window" else "--")
    for window in sorted({int(w) for w in points["window"] if w}):
        ax.axvline(window, color="gray", linewidth=0.6, alpha=0.6)
    return _finished(fig, ax, "position in the stream", f"next-token loss (mean over {bin_size} positions)",
                     "StreamingLLM: loss per position (grey lines: window sizes)")


def mixed_precision_curve(mixed: pd.DataFrame):
    """Perplexity against bytes per token: one line per selection over k, the uniform caches as points."""
    fig = _notebook_figure()(figsize=(6.8, 4.0))
    ax = fig.subplots()
    uni = mixed[mixed["selection"] == "uniform"]
    ax.scatter(uni["bytes_per_token"], uni["perplexity"], color="black", zorder=3, label="uniform")
    for r in uni.itertuples():
        ax.annotate(r.precision, (r.bytes_per_token, r.perplexity), textcoords="offset points", xytext=(4, 4), fontsize=8)
    for sel, part in mixed[mixed["selection"] != "uniform"].groupby("selection"):
        curve = part.groupby("k")[["bytes_per_token", "perplexity"]].mean().sort_values("bytes_per_token")
        ax.plot(curve["bytes_per_token"], curve["perplexity"], marker="o", markersize=3,
                label=f"{sel}" + (" (mean of seeds)" if sel == "random" else ""), linestyle="--" if sel == "random" else "-")
    ax.set_xscale("log")
    return _finished(fig, ax, "KV-cache bytes per token (log)", "perplexity",
                     "mixed precision: top-k KV heads in fp32, the rest int4")


def policy_tradeoff(cells: pd.DataFrame, summary: pd.DataFrame):
    """Two panels against KV-cache bytes per token (log): passkey accuracy, one mark per policy and
    context length (bytes held at that length); perplexity, one mark per policy."""
    fig, (acc_ax, ppl_ax) = _figure(2, width=4.6, height=3.6)
    markers = "osD^v<>p*h"
    lengths = sorted(cells["length"].unique())
    for i, length in enumerate(lengths):
        part = cells[cells["length"] == length].groupby("policy", sort=False).agg(
            correct=("correct", "sum"), n=("n", "sum"), bytes_per_token=("bytes_per_token", "mean"))
        acc_ax.scatter(part["bytes_per_token"], part["correct"] / part["n"], marker=markers[i % len(markers)],
                       label=f"{length} tokens", zorder=3)
        if i == len(lengths) - 1:
            for policy, r in part.iterrows():
                acc_ax.annotate(policy, (r.bytes_per_token, r.correct / r.n), textcoords="offset points",
                                xytext=(4, 4), fontsize=7)
    acc_ax.set_ylim(-0.05, 1.05)
    acc_ax.set_ylabel("passkey accuracy")
    acc_ax.legend(fontsize=7)
    ppl_ax.scatter(summary["bytes_per_token"], summary["perplexity"], color="black", zorder=3)
    for r in summary.itertuples():
        ppl_ax.annotate(r.policy, (r.bytes_per_token, r.perplexity), textcoords="offset points", xytext=(4, 4),
                        fontsize=7)
    ppl_ax.set_ylabel("perplexity")
    for ax in (acc_ax, ppl_ax):
        ax.set_xscale("log")
        ax.set_xlabel("KV-cache bytes per token (log)")
        ax.grid(alpha=0.3)
    acc_ax.set_title("retrieval", fontsize=10)
    ppl_ax.set_title("perplexity", fontsize=10)
    fig.tight_layout()
    return fig


def selection_curves(sel: pd.DataFrame):
    """Passkey accuracy against KV-cache bytes per token, one line per selection over its budgets, a
    panel per prompt length; random draws as their mean with the best and worst seed as a bar."""
    lengths = sorted(sel["length"].unique())
    fig, axes = _figure(len(lengths), width=4.8, height=3.6)
    for ax, length in zip(axes, lengths):
        part = sel[sel["length"] == length]
        for name, line in part.groupby("selection", sort=False):
            line = line.sort_values("bytes_per_token")
            rate = line["correct"] / line["n"]
            if name == "random":
                lo, hi = line["worst_run"] / line["n_per_run"], line["best_run"] / line["n_per_run"]
                ax.errorbar(line["bytes_per_token"], rate, yerr=[rate - lo, hi - rate], linestyle="--", marker="o",
                            markersize=3, capsize=2, label="random (mean, best/worst seed)")
            elif len(line) == 1:
                ax.scatter(line["bytes_per_token"], rate, marker="s", zorder=3, label=name)
            else:
                ax.plot(line["bytes_per_token"], rate, marker="o", markersize=3, label=name)
        ax.set_xscale("log")
        ax.set_ylim(-0.05, 1.05)
        ax.set_xlabel("KV-cache bytes per token (log)")
        ax.set_ylabel("passkey accuracy")
        ax.set_title(f"{length} tokens", fontsize=10)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    return fig


def gate_curve(curve: pd.DataFrame):
    """DuoAttention gate training: total, distillation and L1 loss per step."""
    fig = _notebook_figure()(figsize=(5.6, 3.4))
    ax = fig.subplots()
    for col in [c for c in ("total", "distill", "l1") if c in curve.columns]:
        ax.plot(curve["step"] if "step" in curve else range(len(curve)), curve[col], label=col)
    ax.set_yscale("log")
    return _finished(fig, ax, "step", "loss (log)", "")
