"""streaming: StreamingLLM (Xiao et al. 2023) on one long stream of the sweep's kind of data: loss
with full attention, a sliding window, and the window + 4 sink tokens, at two window sizes, with
positions inside the rolling cache as published (rotary models; others keep original positions)."""

from __future__ import annotations

import dataclasses
import math
from types import MappingProxyType

import pandas as pd

from ... import plots
from ...streaming import window_eval
from ...data import build_tokens, prebuild_tokens
from .base import Analysis, Context, Metric, ReportSection, RunView, concat, per_model, register

PARAMS = MappingProxyType(dict(max_stream=2048, ctx_multiple=4, window_fractions=(1 / 32, 1 / 8), n_sink=4, seed=0))


def stream_length(model) -> int:
    """2048 tokens, or 4x the context for short-context rotary models (to go past it), never more than
    n_ctx for learned / sinusoidal positions (they have no embedding past it)."""
    cfg = model.cfg
    if cfg.positional in ("learned", "sinusoidal"):
        return min(PARAMS["max_stream"], cfg.n_ctx)
    return min(PARAMS["max_stream"], PARAMS["ctx_multiple"] * cfg.n_ctx)


def windows(n: int) -> list[int]:
    return sorted({max(2, int(n * f)) for f in PARAMS["window_fractions"]})


def stream(ctx: Context):
    """One stream of the sweep's kind of data (text, corpus, random), `stream_length` tokens long."""
    n = stream_length(ctx.model)
    spec = dataclasses.replace(ctx.data, n_seqs=1, seq_len=n, seed=PARAMS["seed"])
    return build_tokens(spec, ctx.model, prebuild_tokens(spec))


def run(ctx: Context) -> pd.DataFrame:
    tokens = stream(ctx)
    positions = "cache" if ctx.model.cfg.positional == "rotary" else "original"
    per = window_eval(ctx.model, tokens, windows(tokens.shape[1]), n_sink=PARAMS["n_sink"], positions=positions,
                      per_position=True)
    out = []
    for (setting, window), rows in per.groupby(["setting", "window"], dropna=False, sort=False):
        key = f"{setting}@{0 if pd.isna(window) else int(window)}"
        out.append(per_model(f"streaming_loss/{key}", rows["loss"].mean()))
        out += [per_model(f"streaming_position_loss/{key}#{int(p)}", l) for p, l in zip(rows["position"], rows["loss"])]
    out.append(per_model("streaming_cache_positions", float(positions == "cache")))
    out.append(per_model("streaming_tokens", tokens.shape[1]))
    return concat(*out)


def _parse(metric: str):
    key, _, pos = metric.split("/", 1)[1].partition("#")
    setting, _, window = key.partition("@")
    return setting, int(window), (int(pos) if pos else None)


def section(v: RunView) -> list:
    rows = v.last[v.last["metric"].str.startswith("streaming_loss/")]
    if rows.empty:
        return [f"{v.prefix}No StreamingLLM results (see Errors)."]

    # a loss past ~709 overflows exp: its perplexity is inf, which the table leaves blank (never "inf")
    table = pd.DataFrame([dict(zip(("setting", "window"), _parse(m)[:2]), loss=val,
                               perplexity=math.exp(val) if val < 700 else math.inf)
                          for m, val in zip(rows["metric"], rows["value"])])
    table["window"] = table["window"].map(lambda w: "" if w == 0 else w)
    pos = v.last[v.last["metric"].str.startswith("streaming_position_loss/")]
    points = pd.DataFrame([(*_parse(m), val) for m, val in zip(pos["metric"], pos["value"])],
                          columns=["setting", "window", "position", "loss"])
    meta = dict(zip(v.last["metric"], v.last["value"]))
    cache = bool(meta.get("streaming_cache_positions", 0))
    n = int(meta.get("streaming_tokens", 0))
    full = float(table.loc[table["setting"] == "full", "loss"].iloc[0])
    facts = []
    for w in sorted(set(table["window"]) - {""}):
        win = float(table[(table["setting"] == "window") & (table["window"] == w)]["loss"].iloc[0])
        sink = float(table[(table["setting"] == "window+sink") & (table["window"] == w)]["loss"].iloc[0])
        facts.append(f"window {w}: {win:.3f} alone, {sink:.3f} with {PARAMS['n_sink']} sinks "
                     f"({'recovers' if abs(sink - full) < abs(win - full) else 'does not recover'} toward full attention's {full:.3f})")
    return [f"{v.prefix}StreamingLLM (Xiao et al. 2023) on one {n}-token stream at {v.where}: mean next-token loss "
            f"with full attention, with a sliding window, and with the window plus the first {PARAMS['n_sink']} "
            "tokens kept (attention sinks). "
            + ("Positions inside the rolling cache, as published (sinks stay at the start of the positional range). "
               if cache else "Original positions (the model's positions are not rotary). ")
            + "; ".join(facts) + ".",
            table.round(4),
            v.figure(plots.position_losses(points), "streaming")]


register(Analysis(
    "streaming", run, "StreamingLLM: loss with full attention, a sliding window, and window + 4 sinks, per position",
    PARAMS, expensive=True, native_only=True, kv_cache=True,
    metrics=(Metric("streaming_loss/<setting>@<window>", "model", "window_eval: mean loss over the stream"),
             Metric("streaming_position_loss/<setting>@<window>#<pos>", "model", "loss at each position"),
             Metric("streaming_cache_positions", "model", "1 when positions were renumbered in the cache")),
    section=ReportSection("streaming", "StreamingLLM: windows and attention sinks", section)))
