"""induction: detect_head on the sweep data, Olsson et al.'s score on repeated random tokens, and
the in-context-learning score. Its figures (small multiples, the phase change) are the report's
across-checkpoint sections, since they need no section of their own."""

from __future__ import annotations

from types import MappingProxyType

import pandas as pd

from ..heads import icl_score, induction_scores
from .base import Analysis, Context, Metric, concat, per_head, per_model, register
from .detection import detect, detect_metric

PARAMS = MappingProxyType(dict(method="streaming", seq_len=50, n_repeats=2, batch_size=10, seed=0,
                               prepend_bos=True, icl_early=50, icl_late=500))


def run(ctx: Context) -> pd.DataFrame:
    p = PARAMS
    found = detect("induction")(ctx)
    # a model whose context is shorter than BOS + n_repeats * seq_len gets the longest half that fits
    seq_len = min(p["seq_len"], (ctx.model.cfg.n_ctx - int(p["prepend_bos"])) // p["n_repeats"])
    olsson = induction_scores(ctx.model, seq_len=seq_len, n_repeats=p["n_repeats"], batch_size=p["batch_size"],
                              seed=p["seed"], prepend_bos=p["prepend_bos"])
    early = min(p["icl_early"], ctx.tokens.shape[1] // 4)  # short sequences: an early token still early
    icl = icl_score(ctx.model, ctx.tokens, early=early, late=p["icl_late"]).iloc[0]
    return concat(
        found,
        per_head(olsson[olsson["kind"] == "induction"], "score", "induction_score"),
        per_head(olsson[olsson["kind"] == "prefix_matching"], "score", "prefix_matching_score"),
        per_model("repeated_loss_first_copy", olsson.attrs["loss_first_copy"]),
        per_model("repeated_loss_repeats", olsson.attrs["loss_repeats"]),
        per_model("icl_score", icl["icl_score"]),
        per_model("icl_loss_early", icl["loss_early"]),
        per_model("icl_loss_late", icl["loss_late"]),
    )


register(Analysis(
    "induction", run, "induction head scores (detect_head on the sweep data; Olsson et al. on repeated random "
    "tokens) and the in-context-learning score", PARAMS,
    metrics=(
        detect_metric("induction"),
        Metric("induction_score", "head", "induction_scores: Olsson et al., repeated random tokens",
               label="induction (Olsson, repeated random)", heatmap=True, curve=True, headline=True),
        Metric("prefix_matching_score", "head", "likewise"),
        Metric("repeated_loss_first_copy", "model", "loss on the first copy of those tokens"),
        Metric("repeated_loss_repeats", "model", "loss on the repeats"),
        Metric("icl_score", "model", "icl_score: loss at a late token minus an early one"),
        Metric("icl_loss_early", "model", "loss at the early token"),
        Metric("icl_loss_late", "model", "loss at the late token"),
    )))
