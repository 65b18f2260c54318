"""induction: detect_head on the sweep data, Olsson et al.'s score on repeated random tokens, and
the in-context-learning score. Across checkpoints it owns the report's small multiples and the curves
against training step with the phase change marked (`phase_change`), and it adds the ICL score and
the phase change to the summary's headline.

Phase change: over consecutive checkpoints, the step interval where the maximum induction score
(Olsson et al.'s, on repeated random tokens) of heads outside layer 0 rises fastest per training
step (layer 0 cannot form an induction head with a previous-token head below it)."""

from __future__ import annotations

from types import MappingProxyType

import numpy as np
import pandas as pd

from ... import plots
from ...heads import icl_score, induction_scores
from .base import Analysis, Context, Metric, ReportSection, RunView, concat, metrics, model_rows, per_head, per_model, register
from .detection import detect, detect_metric, shared_pass

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
    icl = icl_score(ctx.model, ctx.tokens, early=early, late=p["icl_late"],  # raises beyond the data
                    resid=shared_pass(ctx).resid).iloc[0]  # the detection pass's forward, where it streamed
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


def phase_change(table: pd.DataFrame) -> dict | None:
    """The steepest rise of the max induction score outside layer 0 between consecutive checkpoints."""
    ind = table[(table["metric"] == "induction_score") & table["layer"].notna() & table["step"].notna()
                & np.isfinite(table["value"].to_numpy(dtype=float, na_value=np.nan))]
    if ind.empty:
        return None
    later = ind[ind["layer"] >= 1] if int(ind["layer"].max()) >= 1 else ind
    curve = later.groupby("step")["value"].max().sort_index()
    if len(curve) < 3:
        return None
    steps, values = curve.index.to_numpy(dtype=float), curve.to_numpy()
    slopes = np.diff(values) / np.maximum(np.diff(steps), 1)
    i = int(np.argmax(slopes))
    if slopes[i] <= 0:
        return None
    return {"start": int(steps[i]), "end": int(steps[i + 1]), "score_before": float(values[i]),
            "score_after": float(values[i + 1]), "score_final": float(values[-1]),
            "layers": "layers >= 1" if int(ind["layer"].max()) >= 1 else "all layers"}


def headline(v: RunView) -> list[str]:
    """The ICL score (with the positions it compares) and the phase change, for the summary."""
    facts = []
    icl = model_rows(v.table, "icl_score")
    if not icl.empty:
        where = {m: model_rows(v.table, f"icl_{m}_position")["value"] for m in ("early", "late")}
        at = (f" (loss at token {int(where['late'].iloc[-1])} minus token {int(where['early'].iloc[-1])})"
              if all(len(w) for w in where.values()) else "")
        step = icl["step"].iloc[-1]
        facts.append(f"ICL score {icl['value'].iloc[-1]:+.3f}{at}" + (f" at step {int(step)}" if pd.notna(step) else ""))
    phase = phase_change(v.table)
    if phase:
        facts.append(f"phase change between steps {phase['start']} and {phase['end']} "
                     f"(max induction score {phase['score_before']:.2f} -> {phase['score_after']:.2f}, "
                     f"{phase['score_final']:.2f} at the end)")
    return facts


def small_multiples(v: RunView) -> list:
    fig = plots.small_multiples(v.table, "induction_score")
    return [f"{v.prefix}Olsson et al.'s induction score of every head at each checkpoint (shared colour scale)." if fig
            else f"{v.prefix}Needs the induction analysis on two or more checkpoints.",
            v.figure(fig, "induction_small_multiples")]


def curves(v: RunView) -> list:
    phase = phase_change(v.table)
    fig = plots.best_head_curves(v.table, [m.name for m in metrics(lambda m: m.curve)], phase,
                                 model_rows(v.table, "icl_score"), log_steps=v.log_steps)
    text = (f"{v.prefix}Each line follows the head that scores highest at the last checkpoint. " +
            (f"Phase change (shaded): the max induction score ({phase['layers']}) rises fastest between steps "
             f"{phase['start']} and {phase['end']} ({phase['score_before']:.2f} -> {phase['score_after']:.2f}; "
             f"{phase['score_final']:.2f} at the end). The ICL score (loss at a late token minus loss at an early "
             "one; negative means the model learns in context) is in the lower panel." if phase else
             "No phase change found (needs the induction analysis on three or more checkpoints with a rising score)."))
    return [text if fig else f"{v.prefix}Needs head scores on two or more checkpoints with steps.", v.figure(fig, "curves")]


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
    ),
    across=(ReportSection("small-multiples", "Induction heads across checkpoints", small_multiples),
            ReportSection("curves", "Scores against training step", curves)),
    headline=headline,
))
