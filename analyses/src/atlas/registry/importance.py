"""importance: Michel et al. head importance and attribution patching against exact ablation."""

from __future__ import annotations

import math
from types import MappingProxyType

import pandas as pd

from ... import plots
from ...importance import head_importance
from .base import Analysis, Context, Metric, ReportSection, RunView, concat, per_head, per_model, register

PARAMS = MappingProxyType(dict(method="mean", normalize=True, seed=0))


def run(ctx: Context) -> pd.DataFrame:
    p = PARAMS
    frame = head_importance(ctx.model, ctx.tokens, normalize=p["normalize"], method=p["method"], seed=p["seed"],
                            compare_exact=True, progress=False)
    # A correlation over heads is NaN where it is undefined (one head, or a constant side): no row then, since
    # it is not a finding. NaN weights cannot hide here: they leave the heads' own rows NaN, which the sweep
    # reports as an error.
    corr = [per_model(f"attribution_{c}", frame.attrs[c]) for c in ("pearson", "spearman")
            if math.isfinite(frame.attrs[c])]
    return concat(
        per_head(frame, "importance", "importance"),
        per_head(frame, "attribution", "attribution"),
        per_head(frame, "ablation_delta", "exact_delta"),
        *corr,
    )


def section(v: RunView) -> list:
    corr = v.table[v.table["metric"].isin(["attribution_pearson", "attribution_spearman"])]
    if corr.empty:
        if (v.last["metric"] == "attribution").any():
            return [f"{v.prefix}Attribution patching ran, but its correlation with exact ablation is undefined here "
                    "(fewer than two heads, or a constant score)."]
        return [f"{v.prefix}No importance results (see Errors)."]
    wide = corr.pivot_table(index=["checkpoint", "step"], columns="metric", values="value").reset_index()
    return [f"{v.prefix}Attribution patching (a first-order estimate of each head's mean-ablation effect from one "
            "forward and backward pass) against the exact ablation sweep; Pearson and Spearman correlation over heads.",
            wide.sort_values("step").round(4), v.figure(plots.attribution_scatter(v.last), "attribution")]


register(Analysis(
    "importance", run, "Michel et al. head importance and the attribution-patching estimate of mean ablation, with "
    "its correlation to the exact ablation", PARAMS, expensive=True, gradients=True,
    metrics=(Metric("importance", "head", "head_importance: Michel et al. (normalised per layer)"),
             Metric("attribution", "head", "attribution-patching estimate of mean ablation"),
             Metric("exact_delta", "head", "exact mean ablation"),
             Metric("attribution_pearson", "model", "correlation over heads"),
             Metric("attribution_spearman", "model", "rank correlation over heads")),
    section=ReportSection("attribution", "Attribution patching vs exact ablation", section)))
