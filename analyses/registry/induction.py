"""induction: detect_head on the sweep data, Olsson et al.'s score on repeated random tokens, and
the in-context-learning score. Its figures (small multiples, the phase change) are the report's
across-checkpoint sections, since they need no section of their own."""

from __future__ import annotations

from types import MappingProxyType

import pandas as pd

from ..heads import icl_score, induction_scores
from .base import Analysis, Context, Metric, concat, per_head, per_model, register
from .detection import detect, detect_metric

PARAMS = MappingProxyType(dict(method="auto", seq_len=50, n_repeats=2, batch_size=10, seed=0,
                               prepend_bos=True, icl_early=50, icl_late=None))
# icl_late None: the last position of the data's sequences (Olsson et al. use 500 of 512). The
# positions used are results (icl_early_position, icl_late_position), so the report states them.


def olsson(ctx: Context) -> pd.DataFrame:
    """Olsson et al.'s scores on repeated random tokens, once per checkpoint (composition reuses them)."""
    p = PARAMS
    # a model whose context is shorter than BOS + n_repeats * seq_len gets the longest half that fits
    seq_len = min(p["seq_len"], (ctx.model.cfg.n_ctx - int(p["prepend_bos"])) // p["n_repeats"])
    return ctx.once("olsson", lambda: induction_scores(
        ctx.model, seq_len=seq_len, n_repeats=p["n_repeats"], batch_size=p["batch_size"], seed=p["seed"],
        prepend_bos=p["prepend_bos"]))


def run(ctx: Context) -> pd.DataFrame:
    p = PARAMS
    found = detect("induction")(ctx)
    scores = olsson(ctx)
    early = min(p["icl_early"], ctx.tokens.shape[1] // 4)  # short sequences: an early token still early
    icl = icl_score(ctx.model, ctx.tokens, early=early, late=p["icl_late"]).iloc[0]  # raises beyond the data
    return concat(
        found,
        per_head(scores[scores["kind"] == "induction"], "score", "induction_score"),
        per_head(scores[scores["kind"] == "prefix_matching"], "score", "prefix_matching_score"),
        per_head(scores[scores["kind"] == "previous_token"], "score", "previous_token_score"),
        per_model("repeated_loss_first_copy", scores.attrs["loss_first_copy"]),
        per_model("repeated_loss_repeats", scores.attrs["loss_repeats"]),
        per_model("icl_score", icl["icl_score"]),
        per_model("icl_loss_early", icl["loss_early"]),
        per_model("icl_loss_late", icl["loss_late"]),
        per_model("icl_early_position", icl["early"]),
        per_model("icl_late_position", icl["late"]),
    )


register(Analysis(
    "induction", run, "induction head scores (detect_head on the sweep data; Olsson et al. on repeated random "
    "tokens) and the in-context-learning score", PARAMS,
    metrics=(
        detect_metric("induction"),
        Metric("induction_score", "head", "induction_scores: Olsson et al., repeated random tokens",
               label="induction (Olsson, repeated random)", heatmap=True, curve=True, headline=True),
        Metric("prefix_matching_score", "head", "likewise"),
        Metric("previous_token_score", "head", "attention to the previous token on the same repeated random tokens",
               label="previous-token (repeated random)", heatmap=True),
        Metric("repeated_loss_first_copy", "model", "loss on the first copy of those tokens"),
        Metric("repeated_loss_repeats", "model", "loss on the repeats"),
        Metric("icl_score", "model", "icl_score: loss at a late token minus an early one"),
        Metric("icl_loss_early", "model", "loss at the early token"),
        Metric("icl_loss_late", "model", "loss at the late token"),
        Metric("icl_early_position", "model", "the early token's position (50, or a quarter of short sequences)"),
        Metric("icl_late_position", "model", "the late token's position (the last of the data's sequences)"),
    )))
