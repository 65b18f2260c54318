"""sinks: attention to the first token per head and the sink rate (Gu et al. 2024)."""

from __future__ import annotations

from types import MappingProxyType

import pandas as pd

from ... import plots
from ...sinks import attention_sinks, sink_rate
from ...document import head_name
from .base import Analysis, Context, Metric, ReportSection, RunView, concat, per_head, per_model, register, rows
from .detection import SINK_EPSILON, shared_pass

PARAMS = MappingProxyType(dict(n_sink=1, epsilon=SINK_EPSILON))


def run(ctx: Context) -> pd.DataFrame:
    frame = shared_pass(ctx).sinks  # the head detectors' streaming pass, where it streamed
    if frame is None:
        frame = attention_sinks(ctx.model, ctx.tokens, n_sink=PARAMS["n_sink"], epsilon=PARAMS["epsilon"])
    first = frame[frame["key"] == 0]
    rates = sink_rate(frame)
    rates = rates[rates["key"] == 0]
    per_layer = rates[rates["layer"] != "all"]
    overall = float(rates.loc[rates["layer"] == "all", "sink_rate"].iloc[0])
    return concat(
        per_head(first, "alpha", "sink_alpha"),
        per_head(first, "value_norm_ratio", "sink_value_norm_ratio"),
        rows([int(l) for l in per_layer["layer"]], None, "sink_rate", per_layer["sink_rate"].astype(float).tolist()),
        per_model("sink_rate", overall),
    )


def section(v: RunView) -> list:
    rates = v.last[v.last["metric"] == "sink_rate"]
    per_layer = rates[rates["layer"].notna()][["layer", "value"]].rename(columns={"value": "sink_rate"})
    overall = rates[rates["layer"].isna()]["value"]
    eps = v.params("sinks").get("epsilon", PARAMS["epsilon"])
    alpha = v.last[(v.last["metric"] == "sink_alpha") & v.last["layer"].notna()]
    ratio = v.last[(v.last["metric"] == "sink_value_norm_ratio") & v.last["layer"].notna()]
    top = alpha.merge(ratio, on=["layer", "head"], suffixes=("", "_ratio")).nlargest(10, "value")
    top = pd.DataFrame({"head": [head_name(r.layer, r.head) for r in top.itertuples()],
                        "alpha_0": top["value"].round(3).to_numpy(),
                        "||v_0|| / mean ||v_j||": top["value_ratio"].round(3).to_numpy()})
    return [f"{v.prefix}Sink rate (Gu et al. 2024): the share of heads whose mean attention to token 0 exceeds "
            f"epsilon = {eps}, per layer at {v.where}" + (f"; over the model {float(overall.iloc[0]):.2f}." if len(overall) else "."),
            f"The {len(top)} heads attending most to token 0, with the first token's value norm over the mean value "
            "norm of the other tokens (sinks tend to carry small values: ratios below 1)." if len(top) else None,
            top if len(top) else None,
            pd.DataFrame([{"layer": "sink rate", **{str(int(l)): round(float(r), 2) for l, r in
                                                    zip(per_layer["layer"], per_layer["sink_rate"])}}])
            if not per_layer.empty else None,
            v.figure(plots.sinks_per_layer(v.table, v.log_steps), "sinks")]


register(Analysis(
    "sinks", run, "attention sinks (Gu et al. 2024): attention to the first token per head, Sink rate per layer",
    PARAMS,
    metrics=(
        Metric("sink_alpha", "head", "attention_sinks: mean attention to token 0 (Gu et al.)",
               label="attention to token 0 (sink)", heatmap=True),
        Metric("sink_value_norm_ratio", "head", "||v_0|| over the mean ||v_j|| of the other keys"),
        Metric("sink_rate", "layer", "share of the layer's heads with alpha_0 > epsilon (per model: over all heads)"),
    ),
    section=ReportSection("sinks", "Attention sinks", section)))
