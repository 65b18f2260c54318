"""pruning: loss as heads are pruned cumulatively (Michel et al. 2019), importance vs random order."""

from __future__ import annotations

from types import MappingProxyType

import pandas as pd

from .. import plots
from ..pruning import pruning_curve
from .base import Analysis, Context, Metric, ReportSection, RunView, concat, per_model, register

PARAMS = MappingProxyType(dict(orders=("importance", "random"), step=0.1, method="zero", seed=0))


def pruning_metric(order: str, fraction: float) -> str:
    """The metric name of one point of a pruning curve; `parse_pruning_metric` inverts it."""
    return f"pruning_loss/{order}@{fraction:.4f}"


def parse_pruning_metric(metric: str) -> tuple[str, float] | None:
    if not metric.startswith("pruning_loss/"):
        return None
    order, fraction = metric[len("pruning_loss/"):].rsplit("@", 1)
    return order, float(fraction)


def curve_points(table: pd.DataFrame) -> pd.DataFrame:
    """The pruning rows of a results table as [order, fraction, loss]."""
    parsed = [(parse_pruning_metric(m), v) for m, v in zip(table["metric"], table["value"])]
    return pd.DataFrame([(o, f, v) for p, v in parsed if p is not None for o, f in [p]],
                        columns=["order", "fraction", "loss"])


def run(ctx: Context) -> pd.DataFrame:
    p = PARAMS
    frames = [pruning_curve(ctx.model, ctx.tokens, order=o, step=p["step"], method=p["method"], seed=p["seed"],
                            progress_bar=False) for o in p["orders"]]
    return concat(*(per_model(pruning_metric(o, float(r.fraction_pruned)), float(r.loss))
                    for o, f in zip(p["orders"], frames) for r in f.itertuples()))


def section(v: RunView) -> list:
    p = v.params("pruning")
    fig = plots.pruning_curves(curve_points(v.last))
    if fig is None:
        return [f"{v.prefix}No pruning results (see Errors)."]
    return [f"{v.prefix}Loss on the sweep data as heads are removed cumulatively ({p.get('method', 'zero')} "
            f"replacement, {p.get('step', 0.1):g} of the heads per step) at {v.where}: Michel et al.'s importance "
            "order (least important first, recomputed after every step) against a random order.",
            v.figure(fig, "pruning")]


register(Analysis(
    "pruning", run, "loss as heads are pruned cumulatively (Michel et al.), importance order vs a random order",
    PARAMS, expensive=True,
    metrics=(Metric("pruning_loss/<order>@<frac>", "model", "pruning_curve: loss with that fraction of heads pruned"),),
    section=ReportSection("pruning", "Pruning curve", section)))
