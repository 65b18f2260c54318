"""previous_token, duplicate_token: TransformerLens-style `detect_head` scores on the sweep data."""

from __future__ import annotations

from types import MappingProxyType
from typing import Callable

import pandas as pd

from ..heads import detect_heads
from .base import Analysis, Context, Metric, per_head, register

DETECT_KINDS = ("previous_token", "duplicate_token", "induction")


def detect(kind: str) -> Callable[[Context], pd.DataFrame]:
    """One kind of `detect_heads`; the three kinds share one streaming pass per checkpoint."""

    def run(ctx: Context) -> pd.DataFrame:
        frame = ctx.once("detect_heads", lambda: detect_heads(ctx.model, ctx.tokens, kinds=DETECT_KINDS,
                                                               method="auto"))
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
