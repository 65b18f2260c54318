"""Plots for the analyzers' DataFrames: layer x head heatmaps, curves, composition matrices.

Every function takes a frame as the analyzers return it and gives back a `matplotlib.figure.Figure`,
built without pyplot (nothing global, nothing shown or saved: `fig.savefig(path)`, or let a notebook
display it: as a cell's value it shows as a PNG, see `NotebookFigure`).
"""

from __future__ import annotations

import functools
import io
import math
from typing import Sequence

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


def __getattr__(name: str):  # `interp.analyses.plotting.NotebookFigure`, built lazily (PEP 562)
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
        ax.set_yticks(range(grid.shape[0]), [str(l) for l in grid.index])
        ax.set_xlabel("head")
        ax.set_ylabel("layer")
        label = name if isinstance(name, str) else f"{facet} {name}"  # a bare number ("0: alpha") says nothing
        ax.set_title(value if name is None else f"{label}: {value}")
        if annotate or (annotate is None and grid.size <= 64):
            arr = grid.to_numpy()
            for i in range(arr.shape[0]):
                for j in range(arr.shape[1]):
                    if arr[i, j] == arr[i, j]:  # not NaN
                        ax.text(j, i, f"{arr[i, j]:.2f}", ha="center", va="center", fontsize=7, color="w")
        fig.colorbar(im, ax=ax, shrink=0.8)
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
