"""pruning: Michel et al. (2019)'s experiment. Heads are ordered on the first half of the data's
sequences and the loss is measured on the held-out half; importance order against reverse order and
random orders (3 seeds). The headline is the fraction of heads prunable within +5% of the clean loss."""

from __future__ import annotations

from types import MappingProxyType

import pandas as pd

from ... import plots
from ...pruning import pruning_study
from .base import Analysis, Context, Metric, ReportSection, RunView, concat, per_model, register

PARAMS = MappingProxyType(dict(split=0.5, seeds=(0, 1, 2), step=0.025, max_fraction=0.2, method="zero",
                               tolerance=0.05, max_seqs=8, max_len=256))


def pruning_metric(order: str, fraction: float, seed: int = 0) -> str:
    """The metric name of one point of a pruning curve; `parse_pruning_metric` inverts it."""
    return f"pruning_loss/{order}#{seed}@{fraction:.4f}"


def parse_pruning_metric(metric: str) -> tuple[str, float, int] | None:
    if not metric.startswith("pruning_loss/"):
        return None
    rest, fraction = metric[len("pruning_loss/"):].rsplit("@", 1)
    order, _, seed = rest.partition("#")
    return order, float(fraction), int(seed or 0)


def curve_points(table: pd.DataFrame) -> pd.DataFrame:
    """The pruning rows of a results table as [order, seed, fraction, loss]."""
    parsed = [(parse_pruning_metric(m), v) for m, v in zip(table["metric"], table["value"])]
    return pd.DataFrame([(o, s, f, v) for p, v in parsed if p is not None for o, f, s in [p]],
                        columns=["order", "seed", "fraction", "loss"])


def run(ctx: Context) -> pd.DataFrame:
    p = PARAMS
    tokens = ctx.pieces(p["max_len"], p["max_seqs"])  # its own length: a forward per pruning step and order
    curves = pruning_study(ctx.model, tokens, split=p["split"], seeds=p["seeds"], step=p["step"],
                           max_fraction=p["max_fraction"], method=p["method"], tolerance=p["tolerance"],
                           progress_bar=False)
    return concat(*(per_model(pruning_metric(r.order, float(r.fraction_pruned), int(r.seed)), float(r.loss))
                    for r in curves.itertuples()),
                  *(per_model(f"pruning_prunable/{o}", f) for o, f in curves.attrs["prunable"].items()),
                  per_model("pruning_clean_loss", curves.attrs["clean_loss"]),
                  per_model("pruning_seq_len", tokens.shape[1]), per_model("pruning_n_seqs", tokens.shape[0]))


def section(v: RunView) -> list:
    p = v.params("pruning")
    points = curve_points(v.last)
    clean = v.last.loc[v.last["metric"] == "pruning_clean_loss", "value"]
    tol = p.get("tolerance", 0.05)
    fig = plots.pruning_curves(points, None if clean.empty else float(clean.iloc[0]) * (1 + tol))
    if fig is None:
        return [f"{v.prefix}No pruning results (see Errors)."]
    prunable = {m.split("/", 1)[1]: val for m, val in zip(v.last["metric"], v.last["value"])
                if m.startswith("pruning_prunable/")}
    n_heads = int(v.last["head"].dropna().nunique() * (v.last["layer"].dropna().max() + 1)) if v.last["layer"].notna().any() else None
    table = pd.DataFrame([{"order": o, f"fraction prunable within +{tol:.0%}": round(f, 4),
                           **({"heads": round(f * n_heads, 1)} if n_heads else {})} for o, f in sorted(prunable.items())])
    seeds = points.loc[points["order"] == "random", "seed"].nunique()
    ran = {m: v.last.loc[v.last["metric"] == f"pruning_{m}", "value"] for m in ("seq_len", "n_seqs")}
    data_len = v.settings.get("data", {}).get("seq_len")
    own = (f" It ran at its own length: {int(ran['n_seqs'].iloc[0])} pieces of {int(ran['seq_len'].iloc[0])} tokens "
           f"of the data's {data_len}-token sequences (a forward per pruning step and order)."
           if len(ran["seq_len"]) and len(ran["n_seqs"]) and data_len and ran["seq_len"].iloc[0] < data_len else "")
    best = max(prunable, key=prunable.get) if prunable else None
    return [f"{v.prefix}Michel et al.'s pruning experiment at {v.where}: heads are ordered on the first "
            f"{p.get('split', 0.5):.0%} of the data's sequences and removed cumulatively ({p.get('method', 'zero')} "
            f"replacement, {p.get('step', 0.1):g} of the heads per step, importance recomputed after each step); the "
            f"loss is measured on the held-out rest. Importance order (least important first) against the reverse "
            f"order and a random order ({seeds} seed(s): mean, shaded min-max). The dotted line is +{tol:.0%} of the "
            "unpruned loss" + (f"; clean loss {float(clean.iloc[0]):.4f}." if len(clean) else ".")
            + (f" Most heads prunable within +{tol:.0%}: the {best} order ({prunable[best]:.1%} of the heads)."
               if best else "") + own,
            table if prunable else None, v.figure(fig, "pruning")]


register(Analysis(
    "pruning", run, "Michel et al.'s pruning curve: importance from one split of the data, loss on the held-out split; "
    "importance vs reverse vs random order", PARAMS, expensive=True, gradients=True,
    metrics=(Metric("pruning_loss/<order>#<seed>@<frac>", "model", "held-out loss with that fraction of heads pruned"),
             Metric("pruning_prunable/<order>", "model", "largest fraction pruned within +5% of the clean loss"),
             Metric("pruning_clean_loss", "model", "held-out loss of the unpruned model"),
             Metric("pruning_seq_len", "model", "tokens per sequence it ran on (its own length: at most max_len)"),
             Metric("pruning_n_seqs", "model", "sequences (or pieces of them) it ran on")),
    section=ReportSection("pruning", "Pruning curve", section), max_len=PARAMS["max_len"]))
