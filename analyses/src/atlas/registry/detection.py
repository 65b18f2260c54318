"""previous_token, duplicate_token: TransformerLens-style `detect_head` scores on the sweep data."""

from __future__ import annotations

from types import MappingProxyType
from typing import Callable

import pandas as pd

from ..atlas_pass import AtlasPass, atlas_pass
from .base import Analysis, Context, Metric, per_head, register

DETECT_KINDS = ("previous_token", "duplicate_token", "induction")
SINK_EPSILON = 0.3  # the sinks analysis's epsilon (its PARAMS), for the pass it shares


def shared_pass(ctx: Context) -> AtlasPass:
    """The checkpoint's one streaming pass (`interp.analyses.atlas.atlas_pass`): the three detection kinds, the
    sinks' alpha_0 and the final residual stream (for the ICL score), computed once for every adapter
    that reads them (detection, induction, sinks)."""
    return ctx.once("atlas_pass", lambda: atlas_pass(ctx.model, ctx.tokens, DETECT_KINDS, epsilon=SINK_EPSILON))


def detect(kind: str) -> Callable[[Context], pd.DataFrame]:
    """One kind of `detect_heads`; the three kinds share one streaming pass per checkpoint (with sinks)."""

    def run(ctx: Context) -> pd.DataFrame:
        frame = shared_pass(ctx).detect
        return per_head(frame[frame["kind"] == kind], "score", kind)

    return run


def detect_metric(kind: str) -> Metric:
    words = kind.replace("_", "-")
    return Metric(kind, "head", "detect_heads (TransformerLens detect_head) on the sweep data",
                  label=f"{words} (detect_head, data)", heatmap=True, curve=kind != "induction",
                  headline=kind != "induction")


for _kind in DETECT_KINDS[:2]:
    register(Analysis(
        _kind, detect(_kind),
        f"{_kind.replace('_', '-')} head scores (TransformerLens detect_head) on the sweep data",
        MappingProxyType(dict(method="auto")), metrics=(detect_metric(_kind),)))
