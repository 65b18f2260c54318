"""`interp kv MODEL --task passkey --select retrieval,razor,loss,gates,random`: head roles compiled
into cache policies, side by side on one budget.

Stages (each with a progress bar): score the heads (`head_roles`: retrieval on scoring prompts drawn
from another seed than the evaluation's, RazorAttention's echo and induction, the streaming loss of
each KV head, DuoAttention's gates); build the selections (top-k KV heads full, the rest
streaming(sinks, window), k at each fraction of the KV heads, against random draws and SnapKV at the
same bytes); measure every selection's passkey accuracy, perplexity and bytes per token
(`kv_policies`). Writes kv_policies.parquet, kv_head_roles.parquet (one row per query head, the KV
head's scores beside it), kv_passkey_answers.parquet, kv_gates_curve.parquet (when gates are
trained), settings.json, report.html / report.md and figures/.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Sequence

import pandas as pd
import torch

from .. import plots
from .._common import stages
from ..document import Section, head_name, png, write_document
from .gates import gate_table, train_gates
from .roles import (
    equal_bytes_runs,
    kv_roles,
    loss_scores,
    overlap,
    razor_scores,
    ranking,
    retrieval_scores,
    selection_runs,
    share_above,
)
from .policies import PolicyRun, measure_runs, policy_sections
from ..sinks import attention_sinks
from ..store import OutputFolder, atomic_write_text
from ..sweep_data import source_line
from .tasks import RetrievalPrompt, accuracy_label, retrieval_prompts

SCORING_SEED_OFFSET = 1000
# DuoAttention gate training runs a count of seeded steps, never "as many as fit in N seconds": the same
# command trains the same gates, so selects the same heads, on any machine. On SmolLM2-135M's 8 gate prompts
# of 512 tokens a step took 3.5 s on the README's idle 2-core CPU (14 steps in 54 s; a prompt's first visit
# also computes its target): 32 steps, about 2 minutes, stay within the 150 s the time budget used to give.
# `gate_seconds` remains, as a cap only (the report says when it cut training).
GATE_STEPS = 32
LOSS_TOKENS = 1024  # the streaming-loss ranking reads the text's first 1024 tokens (892 past sinks + window 128)  # scoring prompts: keys drawn from seed + 1000, never an evaluation key


def gate_cache_dir() -> Path:
    """Where trained gates are kept between runs (keyed by model, data and settings): $INTERP_CACHE or
    ~/.cache/interp, under gates/."""
    root = os.environ.get("INTERP_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "interp")
    return Path(root) / "gates"


def scoring_prompts(model, eval_prompts: Sequence[RetrievalPrompt], n: int, seed: int) -> list[RetrievalPrompt]:
    """`n` prompts per evaluation length, at the evaluation depths, keys from another seed; none shares a
    key with the evaluation set."""
    lengths = sorted({p.length for p in eval_prompts})
    depths = sorted({p.depth for p in eval_prompts})
    variant = eval_prompts[0].variant
    per_cell = max(1, -(-n // len(depths)))
    taken = {p.key for p in eval_prompts}
    out = [p for p in retrieval_prompts(model, lengths[:1], depths, per_cell, seed + SCORING_SEED_OFFSET,
                                        variant=variant) if p.key not in taken]
    return out[:n] if len(out) >= n else out


def score_heads(model, prompts: Sequence[RetrievalPrompt], text: torch.Tensor, selections: Sequence[str], *,
                sinks: int, window: int, n_scoring: int, seed: int, gate_seconds: float, gate_steps: int,
                progress_bar=None, log=print, timings: dict | None = None):
    """(query-head table, KV-head table, gate curve or None)."""
    timings = {} if timings is None else timings
    stage = stages(timings, log)

    scoring = scoring_prompts(model, prompts, n_scoring, seed)
    query = stage("retrieval scores", lambda: retrieval_scores(model, scoring, progress_bar=progress_bar))
    razor = stage("echo and induction scores", lambda: razor_scores(model, seed=seed))
    query = query.merge(razor, on=["layer", "head", "kv_head"])
    sinks_frame = stage("sink scores", lambda: attention_sinks(model, text[:, :512], n_sink=1))
    sink = sinks_frame[sinks_frame["key"] == 0][["layer", "head", "alpha"]].rename(columns={"alpha": "sink"})
    query = query.merge(sink, on=["layer", "head"], how="left")
    loss = None
    if "loss" in selections:
        loss = stage("streaming loss per KV head",
                     lambda: loss_scores(model, text[:, :LOSS_TOKENS], sinks=sinks, window=window,
                                         progress_bar=progress_bar))
    gates = curve = None
    if "gates" in selections:
        # DuoAttention's synthetic passkey data, short enough for many steps on a CPU: 512-token
        # prompts (4 x the window) at the evaluation depths, keys from yet another seed
        depths = sorted({p.depth for p in prompts})
        gate_data = retrieval_prompts(model, [min(512, max(p.length for p in prompts))], depths, 2,
                                      seed + 2 * SCORING_SEED_OFFSET, variant=prompts[0].variant)
        result = stage("DuoAttention gates", lambda: train_gates(
            model, gate_data, sinks=sinks, window=window, steps=gate_steps, time_budget_s=gate_seconds, seed=seed,
            progress_bar=progress_bar, cache_dir=gate_cache_dir()))
        gates, curve = gate_table(result), result.curve
    roles = kv_roles(query, loss, gates)
    return query, roles, curve


def run_roles_study(model, out, *, prompts: Sequence[RetrievalPrompt], text_tokens: torch.Tensor,
                    selections: Sequence[str] = ("retrieval", "razor", "loss", "gates", "random"),
                    fractions: Sequence[float] = (0.1, 0.25, 0.5), seeds: Sequence[int] = (0, 1, 2), sinks: int = 4,
                    window: int = 128, n_scoring: int = 6, seed: int = 0, gate_seconds: float | None = None,
                    gate_steps: int = GATE_STEPS, equal_bytes: str | None = "snapkv", name: str = "model",
                    data_description: str = "", max_new_tokens: int = 8, progress_bar=None, log=print,
                    data_source: dict | None = None) -> Path:
    folder = OutputFolder(out)
    folder.check()
    timings: dict[str, float] = {}
    query, roles, curve = score_heads(model, prompts, text_tokens, selections, sinks=sinks, window=window,
                                      n_scoring=n_scoring, seed=seed, gate_seconds=gate_seconds, gate_steps=gate_steps,
                                      progress_bar=progress_bar, log=log, timings=timings)
    cfg = model.cfg
    rankings = {s: (None if s == "random" else ranking(roles, s)) for s in selections}
    stream = f"streaming({sinks},{window})"
    runs = [PolicyRun("full", "full", selection="full", budget=1.0, full_heads=cfg.n_layers * cfg.kv_heads),
            PolicyRun(stream, stream, budget=0.0, selection="streaming", full_heads=0)]
    runs += selection_runs(rankings, cfg.n_layers, cfg.kv_heads, fractions=fractions, seeds=seeds, sinks=sinks,
                           window=window)
    if equal_bytes:
        runs += equal_bytes_runs(fractions, sorted({p.length for p in prompts}), sinks=sinks, window=window,
                                 method=equal_bytes)
    answers, cells, summary = measure_runs(model, runs, prompts, text_tokens, max_new_tokens=max_new_tokens,
                                           progress_bar=progress_bar, log=log, timings=timings)
    head_table = query.merge(roles.drop(columns=[c for c in roles.columns if c.endswith("_mean")] +
                                        [c for c in ("retrieval", "echo", "induction", "razor") if c in roles.columns]),
                             on=["layer", "kv_head"], how="left")
    settings = dict(model=name, data=data_description, data_source=data_source, selections=list(selections), fractions=list(fractions),
                    seeds=list(seeds), sinks=sinks, window=window, n_scoring=n_scoring, seed=seed,
                    gate_steps=gate_steps, gate_seconds=gate_seconds,
                    gate_steps_done=None if curve is None else len(curve), equal_bytes=equal_bytes, prompts=len(prompts),
                    lengths=sorted({p.length for p in prompts}), depths=sorted({p.depth for p in prompts}),
                    max_new_tokens=max_new_tokens, seconds=timings)
    sections = roles_sections(name, cells, summary, query, roles, curve, sinks, window, timings,
                              gate_steps=gate_steps, gate_seconds=gate_seconds)
    sections += policy_sections(name, cells, summary, answers, data_description, timings)[1:]
    if data_source is not None:
        sections[0].add(source_line(data_source))
    with folder.writing():
        files = ["kv_policies.parquet", "kv_head_roles.parquet", "kv_passkey_answers.parquet", "settings.json"]
        if curve is not None:
            files.append("kv_gates_curve.parquet")
        folder.claim(*files)
        cells.to_parquet(Path(out) / "kv_policies.parquet", index=False)
        head_table.to_parquet(Path(out) / "kv_head_roles.parquet", index=False)
        answers.to_parquet(Path(out) / "kv_passkey_answers.parquet", index=False)
        if curve is not None:
            curve.to_parquet(Path(out) / "kv_gates_curve.parquet", index=False)
        atomic_write_text(Path(out) / "settings.json", json.dumps(settings, indent=2))
        return write_document(out, f"Head roles and KV-cache policies: {name}", sections, folder=folder)


def selection_table(cells: pd.DataFrame) -> pd.DataFrame:
    """One row per (selection, budget, length): passkey correct / n (random: summed over seeds, and
    the best and worst seed), mean bytes per token."""
    sel = cells[cells["selection"].notna()]
    rows = []
    for (s, b, length), part in sel.groupby(["selection", "budget", "length"], dropna=False, sort=False):
        per_run = part.groupby("policy")[["correct", "n"]].sum()
        row = dict(selection=s, budget=b, length=length, correct=int(per_run["correct"].sum()),
                   n=int(per_run["n"].sum()), bytes_per_token=float(part["bytes_per_token"].mean()),
                   runs=len(per_run))
        row["best_run"] = int(per_run["correct"].max())
        row["worst_run"] = int(per_run["correct"].min())
        row["n_per_run"] = int(per_run["n"].max())
        rows.append(row)
    return pd.DataFrame(rows)


def roles_headline(name, cells, roles, query, sinks, window) -> list[str]:
    table = selection_table(cells)
    full = table[table["selection"] == "full"]
    lines = []
    for length in sorted(table["length"].unique()):
        f = full[full["length"] == length]
        if not len(f):
            continue
        fk, fn = int(f["correct"].iloc[0]), int(f["n"].iloc[0])
        here = table[table["length"] == length]
        parts, enough = [], None
        for budget in sorted(here[here["selection"].isin(RANKED)]["budget"].unique()):
            at = here[(here["budget"] == budget) & here["selection"].isin(RANKED)]
            top = int(at["best_run"].max())
            best = ", ".join(at[at["best_run"] == top]["selection"])
            n = int(at["n_per_run"].max())
            rnd = here[(here["selection"] == "random") & (here["budget"] == budget)]
            rnd_text = (f"; random {int(rnd['worst_run'].iloc[0])}-{int(rnd['best_run'].iloc[0])}") if len(rnd) else ""
            parts.append(f"{budget:.0%}: {best} {accuracy_label(top, n)}{rnd_text}")
            if enough is None and fk and top >= 0.8 * fk * n / fn:
                enough = (budget, best, top, n)
        lines.append(f"At {length} tokens the full cache finds {accuracy_label(fk, fn)} keys and every head "
                     f"streaming({sinks},{window}) {_stream_count(table, length)}. Best ranking per share of KV heads "
                     f"kept full (random draws: worst-best seed): " + "; ".join(parts) + ".")
        lines.append(f"The smallest share at which a ranking keeps at least 80% of the full cache's accuracy: "
                     f"{enough[0]:.0%} ({enough[1]}, {accuracy_label(enough[2], enough[3])})." if enough else
                     "No ranking keeps 80% of the full cache's accuracy at these shares.")
    scored = query[query["retrieval"] > 0]
    top_ret = [(int(r.layer), int(r.head)) for r in scored.nlargest(10, "retrieval").itertuples()]
    top_ind = [(int(r.layer), int(r.head)) for r in query.nlargest(10, "induction").itertuples()]
    shared = overlap(top_ret, {"induction": top_ind})["induction"]
    names = ", ".join(f"{head_name(l, h)} {query.set_index(['layer', 'head']).loc[(l, h), 'retrieval']:.2f}"
                      for l, h in top_ret[:5])
    lines.append(f"{share_above(query, 'retrieval'):.1%} of {len(query)} query heads have a retrieval score above 0.1 "
                 f"(Wu et al.: under 5%); {len(scored)} score at all, the strongest {names}. Of the "
                 f"{len(top_ret)} strongest retrieval heads, {shared} are among the 10 strongest induction heads "
                 f"({', '.join(head_name(l, h) for l, h in top_ind[:5])}, ...).")
    return lines


RANKED = ("retrieval", "razor", "loss", "gates")


def _stream_count(table, length) -> str:
    s = table[(table["selection"] == "streaming") & (table["length"] == length)]
    return accuracy_label(int(s["correct"].iloc[0]), int(s["n"].iloc[0])) if len(s) else "(not run)"


def gate_cut(curve: pd.DataFrame | None, gate_steps: int | None, gate_seconds: float | None) -> str | None:
    """The sentence a report owes its reader when the time cap stopped gate training before its count of
    steps (the gates, and the heads they select, then depend on the machine's speed); None otherwise."""
    if curve is None or gate_steps is None or len(curve) >= gate_steps:
        return None
    return (f"The time cap of {gate_seconds:g} s stopped DuoAttention's gate training after {len(curve)} of its "
            f"{gate_steps} steps: these gates (and the heads they select) depend on this machine's speed; drop the "
            "cap for gates that are the same on any machine.")


def roles_sections(name, cells, summary, query, roles, curve, sinks, window, timings, *, gate_steps=None,
                   gate_seconds=None) -> list[Section]:
    cut = gate_cut(curve, gate_steps, gate_seconds)
    s = Section("summary", "Summary").add(
        *roles_headline(name, cells, roles, query, sinks, window), cut,
        "Time: " + ", ".join(f"{k} {v:.0f} s" for k, v in timings.items()) + ".")
    sel = selection_table(cells)
    sel = sel.assign(passkey=[accuracy_label(c, n) for c, n in zip(sel["correct"], sel["n"])],
                     bytes_per_token=sel["bytes_per_token"].round(0).astype(int))
    table = Section("selections", "Selections at equal budget").add(
        f"Top-k KV heads by each ranking kept full, the rest streaming({sinks},{window}); random: k heads per seed "
        "(passkey summed over seeds; best_run / worst_run are single seeds); SnapKV on every head with the per-head "
        "budget of the same bytes per token. Accuracy as k of n.",
        sel[["selection", "budget", "length", "passkey", "best_run", "worst_run", "n_per_run", "bytes_per_token"]],
        png(plots.selection_curves(sel), "kv_selections.png"))
    cols = [c for c in ("retrieval", "echo", "induction", "razor", "sink") if c in query.columns]
    top = query.nlargest(10, "retrieval")[["layer", "head", "kv_head", *cols]]
    top.insert(0, "name", [head_name(l, h) for l, h in zip(top["layer"], top["head"])])
    heads = Section("heads", "Head roles").add(
        "The 10 query heads with the highest retrieval scores, beside their echo, induction (RazorAttention, on "
        "repeated random tokens) and sink (attention to the first token) scores. KV heads rank by the max over "
        "their query heads.", top.round(4))
    kv_cols = [c for c in ("retrieval", "razor", "loss", "gate") if c in roles.columns]
    kv_top = {c: ", ".join(f"L{int(r.layer)}KV{int(r.kv_head)}" for r in roles.nlargest(9, c).itertuples())
              for c in kv_cols}
    heads.add("Top 9 KV heads by each ranking: " + "; ".join(f"{c}: {v}" for c, v in kv_top.items()) + ".")
    sections = [s, table, heads]
    if curve is not None and len(curve):
        sections.append(Section("gates", "DuoAttention gates").add(
            f"{len(curve)} optimisation steps in {curve.iloc[-1]['seconds']:.0f} s (Adam on one scalar gate per KV head, "
            f"the model frozen; distillation of the final hidden states plus an L1 penalty on the gates): loss "
            f"{curve.iloc[0]['total']:.4g} -> {curve.iloc[-1]['total']:.4g}, mean gate {curve.iloc[-1]['mean_gate']:.3f}."
            + (f" {cut}" if cut else ""),
            png(plots.gate_curve(curve), "kv_gates_curve.png")))
    return sections
