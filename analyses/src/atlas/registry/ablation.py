"""ablation: the loss increase when each head alone is ablated (exact; mean, zero, resample)."""

from __future__ import annotations

from types import MappingProxyType

import pandas as pd

from ... import plots
from ...ablation import ablate_heads
from ...document import md_escape
from .base import Analysis, Context, Metric, ReportSection, RunView, concat, head_rows, per_head, per_model, register

PARAMS = MappingProxyType(dict(methods=("mean", "zero", "resample"), seed=0))
TOP = 10


def run(ctx: Context) -> pd.DataFrame:
    frames = [ablate_heads(ctx.model, ctx.tokens, method=m, seed=PARAMS["seed"], progress=False)
              for m in PARAMS["methods"]]
    return concat(*(per_head(f, "delta", f"delta_loss/{m}") for m, f in zip(PARAMS["methods"], frames)),
                  per_model("clean_loss", frames[0]["clean_loss"].iloc[0]))


def section(v: RunView) -> list:
    deltas = head_rows(v.last, "delta_loss/")
    if deltas.empty:
        return [f"{v.prefix}No ablation results (see Errors)."]
    wide = deltas.pivot_table(index=["layer", "head"], columns="metric", values="value").reset_index()
    wide.columns = [c.replace("delta_loss/", "delta ") for c in wide.columns]
    key = "delta mean" if "delta mean" in wide.columns else wide.columns[-1]
    top = wide.sort_values(key, ascending=False).head(TOP).round(4)
    clean = v.last[v.last["metric"] == "clean_loss"]["value"]
    return [f"{v.prefix}The {len(top)} heads (of {len(wide)}) whose ablation raises the loss most at {v.where}"
            + (f" (clean loss {float(clean.iloc[0]):.4f})" if len(clean) else "")
            + ". Each head alone has its output z replaced: `mean` by its mean over the data's positions, `zero` by 0, "
            "`resample` by z at the same position of another sequence (a seeded derangement); delta = ablated loss - "
            f"clean loss, exact (one forward per ablation). Data: {md_escape(v.settings.get('data_description', ''))}.",
            top, v.figure(plots.head_heatmaps(deltas, sorted(set(deltas["metric"])), "loss increase when ablated"),
                          "ablation")]


register(Analysis(
    "ablation", run, "loss increase when each head alone is ablated (exact; mean, zero and resample ablation of "
    "the head's output z)", PARAMS, expensive=True,
    metrics=(Metric("delta_loss/<method>", "head", "ablate_heads: loss increase, method mean/zero/resample"),
             Metric("clean_loss", "model", "loss without ablation")),
    section=ReportSection("ablation", "Head ablation", section)))
