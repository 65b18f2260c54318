"""composition: Elhage et al.'s Q-, K- and V-composition between the top previous-token heads (an
earlier layer) and the top induction heads (a later one), beside the same score for random matrices
of the same shapes. An induction head reads the previous-token head's output through its keys, so
K-composition is the one expected to stand out."""

from __future__ import annotations

from types import MappingProxyType

import pandas as pd
import torch

from ...composition import composition_matrix, random_baseline
from ...document import head_name
from .base import Analysis, Context, Metric, ReportSection, RunView, concat, per_model, register, require_finite
from .detection import detect
from .induction import olsson

PARAMS = MappingProxyType(dict(top=3, n_baseline_samples=200, seed=0))


def run(ctx: Context) -> pd.DataFrame:
    k = PARAMS["top"]
    use = "ranking heads for composition"
    prev = require_finite(detect("previous_token")(ctx), "value", "previous_token", use)
    prev = prev.sort_values("value", ascending=False)
    ind = olsson(ctx)
    ind = require_finite(ind[ind["kind"] == "induction"], "score", "induction_score", use)
    ind = ind.sort_values("score", ascending=False)
    tops_a = [(int(r.layer), int(r.head)) for r in prev.head(k).itertuples()]
    tops_b = [(int(r.layer), int(r.head)) for r in ind.head(k).itertuples()]
    cfg = ctx.model.cfg
    out = [per_model("composition_baseline",
                     random_baseline(cfg.d_model, cfg.head_dim, PARAMS["n_baseline_samples"], PARAMS["seed"]))]
    layer = torch.arange(cfg.n_layers)
    later = (layer[:, None, None, None] < layer[None, None, :, None]).expand(-1, cfg.n_heads, -1, cfg.n_heads)
    for kind in ("q", "k", "v"):
        m = composition_matrix(ctx.model, kind)
        if later.any():  # a one-layer model has no pair (layer A < layer B): no mean, rather than a NaN
            # over the pairs by layer, not by "not NaN": a NaN from the weights must reach the sweep's check
            out.append(per_model(f"composition_mean/{kind}", float(m[later].mean())))
        for la, ha in tops_a:
            for lb, hb in tops_b:
                if la < lb:
                    out.append(per_model(f"composition/{kind}/{head_name(la, ha)}->{head_name(lb, hb)}",
                                         float(m[la, ha, lb, hb])))
    return concat(*out)


def section(v: RunView) -> list:
    rows = v.last[v.last["metric"].str.startswith("composition/")]
    meta = dict(zip(v.last["metric"], v.last["value"]))
    if "composition_baseline" not in meta:
        return [f"{v.prefix}No composition results (see Errors)."]
    base = meta["composition_baseline"]
    means = {k: meta.get(f"composition_mean/{k}") for k in ("q", "k", "v")}
    if rows.empty:
        return [f"{v.prefix}No (previous-token head, later induction head) pair among the top {PARAMS['top']} of "
                f"each: nothing to compose. Random baseline {base:.3f}."]
    parts = rows["metric"].str.split("/", expand=True)
    table = pd.DataFrame({"pair": parts[2], "kind": parts[1], "score": rows["value"].to_numpy()})
    table = table.pivot(index="pair", columns="kind", values="score").reset_index()
    table.columns = ["previous-token head -> induction head"] + [f"{c.upper()}-composition" for c in table.columns[1:]]
    table = table.sort_values("K-composition", ascending=False)
    k_mean = float(table["K-composition"].mean())
    return [f"{v.prefix}Composition scores (Elhage et al. 2021: ||W_A W_B||_F / (||W_A||_F ||W_B||_F)) from the top "
            f"{PARAMS['top']} previous-token heads (detect_head on the data) to the top {PARAMS['top']} induction heads "
            f"(Olsson et al.) in later layers, at {v.where}. Random matrices of the same shapes score {base:.3f}; the "
            f"mean over all head pairs is Q {means['q']:.3f}, K {means['k']:.3f}, V {means['v']:.3f}. These pairs' "
            f"K-composition averages {k_mean:.3f} ({k_mean / base:.1f}x the random baseline).",
            table.round(4)]


register(Analysis(
    "composition", run, "Q-, K-, V-composition (Elhage et al.) from the top previous-token heads to the top induction "
    "heads, with a random-matrix baseline", PARAMS, native_only=True,
    metrics=(Metric("composition/<kind>/<A>-><B>", "model", "composition score of one pair"),
             Metric("composition_mean/<kind>", "model", "mean over all pairs (layer A < layer B)"),
             Metric("composition_baseline", "model", "mean score of random matrices of the same shapes")),
    section=ReportSection("composition", "Composition: previous-token heads into induction heads", section)))
