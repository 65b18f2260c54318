"""Figures of a sweep's tidy results table (run, checkpoint, step, analysis, layer, head, metric, value).

Each function takes the table (already restricted to one run) and returns a matplotlib Figure, or
None when the table holds nothing to draw. Figures are built with `matplotlib.figure.Figure`, not
pyplot, so drawing a report never touches global pyplot state or needs a display.
Single-checkpoint heatmaps reuse the analyzers' `plot_head_scores`.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
from matplotlib.figure import Figure

from .plotting import plot_head_scores
from .registry import parse_pruning_metric


def _grid(table: pd.DataFrame, metric: str) -> np.ndarray:
    part = table[(table["metric"] == metric) & table["layer"].notna()]
    return part.pivot_table(index="layer", columns="head", values="value", aggfunc="mean").to_numpy()


LABELS = {
    "previous_token": "previous-token (detect_head, data)",
    "duplicate_token": "duplicate-token (detect_head, data)",
    "induction": "induction (detect_head, data)",
    "induction_score": "induction (Olsson, repeated random)",
    "sink_alpha": "attention to token 0 (sink)",
}


def head_heatmaps(table: pd.DataFrame, metrics: list[str], title: str):
    """Layers x heads heatmaps of `metrics` at one checkpoint (the analyzers' plot_head_scores)."""
    part = table[table["metric"].isin(metrics) & table["layer"].notna()]
    if part.empty:
        return None
    present = [m for m in metrics if m in set(part["metric"])]
    labels = [LABELS.get(m, m) for m in present]
    kind = pd.Categorical(part["metric"].astype(str).map(lambda m: LABELS.get(m, m)), labels)
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
    fig = Figure(figsize=(1.9 * ncols + 0.8, 1.7 * nrows + 0.6), layout="constrained")
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


def best_head_curves(table: pd.DataFrame, metrics: list[str], phase: dict | None, icl: pd.DataFrame | None):
    """Score vs step of the best head (at the last checkpoint) per metric; the phase change shaded;
    the ICL score on a second axis below."""
    part = table[table["metric"].isin(metrics) & table["layer"].notna() & table["step"].notna()]
    if part["step"].nunique() < 2:
        return None
    has_icl = icl is not None and len(icl) >= 2
    fig = Figure(figsize=(8, 5.6 if has_icl else 3.8))
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
        if part["step"].min() >= 0:
            a.set_xscale("symlog", linthresh=max(1.0, float(part.loc[part["step"] > 0, "step"].min())))
    if phase is not None:
        ax.legend(fontsize=8)
    axes[-1].set_xlabel("training step")
    fig.suptitle("head scores across training" + (" (shaded: steepest rise of the induction score)" if phase else ""),
                 fontsize=10)
    fig.tight_layout()
    return fig


def sinks_per_layer(table: pd.DataFrame):
    """Mean attention to the first token (alpha_0) per layer, against step (or per layer at one checkpoint)."""
    part = table[(table["metric"] == "sink_alpha") & table["layer"].notna()]
    if part.empty:
        return None
    per = part.groupby(["layer", "step", "checkpoint"], dropna=False, as_index=False)["value"].mean()
    fig = Figure(figsize=(7, 3.4))
    ax = fig.subplots()
    if per["checkpoint"].nunique() >= 2 and per["step"].notna().all():
        for layer, curve in per.groupby("layer"):
            curve = curve.sort_values("step")
            ax.plot(curve["step"], curve["value"], marker="o", markersize=3, label=f"layer {layer}")
        ax.set_xlabel("training step")
        if per["step"].min() >= 0 and (per["step"] > 0).any():
            ax.set_xscale("symlog", linthresh=float(per.loc[per["step"] > 0, "step"].min()))
        ax.legend(fontsize=8)
    else:
        ax.bar(per["layer"].astype(int), per["value"])
        ax.set_xlabel("layer")
    ax.set_ylabel("mean attention to token 0")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.set_title("attention sink: mean alpha_0 over the heads of each layer (Gu et al. 2024)", fontsize=10)
    fig.tight_layout()
    return fig


def pruning_curves(table: pd.DataFrame):
    """Loss against the fraction of heads pruned, one line per order (importance vs random)."""
    parsed = [(parse_pruning_metric(m), v) for m, v in zip(table["metric"], table["value"])]
    points = pd.DataFrame([(o, f, v) for p, v in parsed if p is not None for o, f in [p]],
                          columns=["order", "fraction", "loss"])
    if points.empty:
        return None
    fig = Figure(figsize=(6, 3.6))
    ax = fig.subplots()
    for order, curve in points.groupby("order"):
        curve = curve.sort_values("fraction")
        ax.plot(curve["fraction"], curve["loss"], marker="o", markersize=3, label=f"{order} order")
    ax.set_xlabel("fraction of heads pruned")
    ax.set_ylabel("loss")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    ax.set_title("pruning curve (Michel et al. 2019)", fontsize=10)
    fig.tight_layout()
    return fig


def attribution_scatter(table: pd.DataFrame):
    """Attribution-patching estimate vs exact ablation delta per head, with the correlations."""
    est = table[(table["metric"] == "attribution") & table["layer"].notna()]
    exact = table[(table["metric"] == "exact_delta") & table["layer"].notna()]
    if est.empty or exact.empty:
        return None
    both = est.merge(exact, on=["layer", "head"], suffixes=("_est", "_exact"))
    fig = Figure(figsize=(4.6, 4.2))
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
