"""`interp kv select MODEL --rankings retrieval,razor,loss,gates,random`: head roles compiled into
cache policies, side by side at equal shares of the KV heads kept full (`RolesStudy`).

Stages (each with a progress bar): score the heads (`roles`: retrieval on scoring prompts drawn
from another seed than the evaluation's, the static score from the weights alone beside it
(`static_scores`: no forward pass; NaN without RoPE), RazorAttention's echo and induction, the
streaming loss of each KV head, DuoAttention's gates); build the selections (top-k KV heads full,
the rest streaming(sinks, window), k at each fraction of the KV heads, against random draws and
one policy on every head at the same bytes: `--equal-bytes`, SnapKV by default); measure every
selection's passkey accuracy, perplexity and bytes per token (`policies`). Writes kv_policies.parquet, kv_head_roles.parquet (one row per query head, the
KV head's scores beside it; static, low_freq_share and effective_rank from the weights),
kv_passkey_answers.parquet, kv_gates_curve.parquet (when gates are trained), settings.json,
report.html / report.md and figures/.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import pandas as pd
import torch

from interp.errors import check_int, check_real
from interp.models.kv.policies import Streaming, parse_policy

from .. import plots
from .._common import stages
from ..document import Section, head_name, png
from ..study import Measured, Study, Table
from .gates import gate_table, train_gates
from .static_scores import STATIC_COLUMNS, agreement, check_rotary, static_columns, static_retrieval_scores
from .roles import (
    check_selection,
    equal_bytes_budget,
    equal_bytes_name,
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
from .policies import (
    ANSWER_COLUMNS,
    COLUMNS,
    PolicyRun,
    RetrievalSettings,
    check_retrieval,
    measure_runs,
    policy_sections,
    prompts_of,
    prompts_record,
)
from ..sinks import attention_sinks
from .tasks import RetrievalPrompt, accuracy_label, retrieval_prompts

SCORING_SEED_OFFSET = 1000
# DuoAttention gate training runs a count of seeded steps, never "as many as fit in N seconds": the same
# command trains the same gates, so selects the same heads, on any machine. On SmolLM2-135M's 8 gate prompts
# of 512 tokens a step took 3.5 s on the README's idle 2-core CPU (14 steps in 54 s; a prompt's first visit
# also computes its target): 32 steps, about 2 minutes, stay within the 150 s the time budget used to give.
# `gate_seconds` remains, as a cap only (the report says when it cut training).
GATE_STEPS = 32
SELECT_LENGTHS = (1024,)  # prompt lengths of `interp kv select` (fitted to a shorter model's context)
# The streaming-loss ranking reads the perplexity text's first LOSS_TOKENS tokens (892 predicted past sinks 4 +
# window 128): `loss_tokens` in settings.json. It is what the ranking's heads depend on: on SmolLM2-135M the
# same command with the whole 2,048-token text (as before 2026-11-25 17:26, when this cap came in for speed)
# keeps a different half of the KV heads, 5 of 8 pass keys at 50% instead of 0 of 8 (docs/kv_cache.md, head roles).
LOSS_TOKENS = 1024


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


def measured_retrieval(model, length: int, *, n_scoring: int = 6, depths: Sequence[float] = (0.1, 0.3, 0.5, 0.7),
                       prompts: int = 2, seed: int = 0, progress_bar: bool | None = None):
    """Wu et al.'s retrieval score of every query head (`roles.retrieval_scores`) as `interp kv select` measures it
    at one prompt length: `n_scoring` scoring prompts (`scoring_prompts`) beside an evaluation set of `prompts` per
    depth from `seed`. Its defaults are the study's; notebook 10's recipe is length 256, n_scoring 4, depths
    (0.2, 0.6)."""
    evaluation = retrieval_prompts(model, [length], depths, prompts, seed)
    return retrieval_scores(model, scoring_prompts(model, evaluation, n_scoring, seed), progress_bar=progress_bar)


def static_report(model, *, cut: int | None = None, top: int = 20, compare: int | None = None,
                  n_scoring: int = 6) -> str:
    """What `interp kv static` prints: the static score of every head (`static_scores`), its time, the `top` heads
    (0: all); with `compare` (a prompt length), the retrieval score measured as `measured_retrieval` does, Spearman's
    rho and the top-10 overlap (`static_scores.agreement`)."""
    import time

    start = time.perf_counter()
    frame = static_retrieval_scores(model, cut=cut)
    seconds = time.perf_counter() - start
    cfg = model.cfg
    planes = ", ".join(f"{n // cfg.n_heads} layers {p} of {cfg.rot_dim // 2}" for p, n in
                       frame["low_planes"].value_counts(sort=False).sort_index().items())
    lines = [f"Static retrieval score of {len(frame)} query heads from the weights alone: {seconds:.2f} s, no forward "
             f"pass. Low-frequency rotary planes (wavelength > {int(frame['cut'].iloc[0]):,} tokens): {planes}. "
             "score = low_freq_share x (1 - (effective_rank - 1) / (min(d_head, d_model) - 1)); the definitions: "
             "interp.analyses.kv.static_scores (its source's formulas were not available: ours, from its abstract)."]
    shown = frame.sort_values("score", ascending=False, kind="stable")
    shown = shown.head(top) if top else shown
    shown.insert(0, "name", [head_name(l, h) for l, h in zip(shown["layer"], shown["head"])])
    lines.append(shown[["name", "kv_head", "score", "low_freq_share", "effective_rank"]].round(4)
                 .to_string(index=False))
    if compare is not None:
        start = time.perf_counter()
        q = measured_retrieval(model, compare, n_scoring=n_scoring).merge(
            frame.rename(columns={"score": "static"}), on=["layer", "head", "kv_head"])
        a = agreement(q)
        tops = {k: ", ".join(head_name(l, h) for l, h in v) for k, v in a["top"].items()}
        lines.append(f"Against Wu et al.'s retrieval score ({n_scoring} passkey prompts of {compare:,} tokens, as `interp "
                     f"kv select`; {int(q['copied'].iloc[0])} needle tokens copied, {int((q['retrieval'] > 0).sum())} "
                     f"heads score at all; {time.perf_counter() - start:.0f} s): Spearman's rho {a['spearman']:.3f} over "
                     f"{a['heads']} heads; {a['overlap']} of the {len(a['top']['retrieval'])} strongest retrieval heads "
                     f"are among the {a['k']} highest static scores.\n  retrieval: {tops['retrieval']}\n  static:    "
                     f"{tops['static']}")
    return "\n\n".join(lines)


def score_heads(model, prompts: Sequence[RetrievalPrompt], text: torch.Tensor, s: RolesSettings,
                stage: Callable | None = None):
    """(query-head table, KV-head table, gate curve or None): the rankings `s.selections` asks for, with its
    sinks, window, scoring prompts, seed, gate steps (and cap) and `loss_tokens` (the streaming-loss ranking
    reads the text's first that many tokens). `stage`: a study's stage timer (`study.run`)."""
    stage = stage or stages({})
    selections, sinks, window, seed, progress_bar = s.selections, s.sinks, s.window, s.seed, s.progress

    scoring = scoring_prompts(model, prompts, s.n_scoring, seed)
    query = stage("retrieval scores", lambda: retrieval_scores(model, scoring, progress_bar=progress_bar))
    query = query.merge(stage("static scores (weights alone)", lambda: static_columns(model)), on=["layer", "head"])
    razor = stage("echo and induction scores", lambda: razor_scores(model, seed=seed))
    query = query.merge(razor, on=["layer", "head", "kv_head"])
    sinks_frame = stage("sink scores", lambda: attention_sinks(model, text[:, :512], n_sink=1))
    sink = sinks_frame[sinks_frame["key"] == 0][["layer", "head", "alpha"]].rename(columns={"alpha": "sink"})
    query = query.merge(sink, on=["layer", "head"], how="left")
    loss = None
    if "loss" in selections:
        loss = stage("streaming loss per KV head",
                     lambda: loss_scores(model, text[:, :s.loss_tokens], sinks=sinks, window=window,
                                         progress_bar=progress_bar))
    gates = curve = None
    if "gates" in selections:
        # DuoAttention's synthetic passkey data, short enough for many steps on a CPU: 512-token
        # prompts (4 x the window) at the evaluation depths, keys from yet another seed
        depths = sorted({p.depth for p in prompts})
        gate_data = retrieval_prompts(model, [min(512, max(p.length for p in prompts))], depths, 2,
                                      seed + 2 * SCORING_SEED_OFFSET, variant=prompts[0].variant)
        result = stage("DuoAttention gates", lambda: train_gates(
            model, gate_data, sinks=sinks, window=window, steps=s.gate_steps, time_budget_s=s.gate_seconds, seed=seed,
            progress_bar=progress_bar, cache_dir=gate_cache_dir()))
        gates, curve = gate_table(result), result.curve
    roles = kv_roles(query, loss, gates)
    return query, roles, curve


@dataclass(frozen=True, kw_only=True, eq=False)
class RolesSettings(RetrievalSettings):
    """selections: rankings from `roles.RANKINGS` (and "random"); fractions: of the KV heads kept full;
    selection_seeds: random draws per fraction; the rest of the heads streaming(sinks, window); n_scoring:
    prompts that score retrieval heads (keys from another seed); DuoAttention's gates trained for
    `gate_steps` (capped at `gate_seconds` when given); `equal_bytes`: a budget policy (snapkv, h2o, tova,
    ..., with any '+' setting: "tova+protect(10%)") on every head at each selection's bytes (None: not compared)."""

    selections: tuple[str, ...] = ("retrieval", "razor", "loss", "gates", "random")
    fractions: tuple[float, ...] = (0.1, 0.25, 0.5)
    selection_seeds: tuple[int, ...] = (0, 1, 2)
    sinks: int = 4
    window: int = 128
    n_scoring: int = 6
    gate_seconds: float | None = None
    gate_steps: int = GATE_STEPS
    equal_bytes: str | None = "snapkv"
    loss_tokens: int = LOSS_TOKENS


@dataclass(frozen=True, kw_only=True, eq=False)
class RolesMeasured(Measured):
    """Beside the tables: the query heads' scores (`query`), the KV heads' rankings (`roles`), one row per
    run (`summary`: perplexity and bytes per token on the text) and the evaluation prompts."""

    query: pd.DataFrame
    roles: pd.DataFrame
    summary: pd.DataFrame
    prompts: list[RetrievalPrompt]


class RolesStudy(Study):
    """Head roles compiled into cache policies, side by side at equal shares of KV heads kept full."""

    name = "kv-roles"
    title = "Head roles and KV-cache policies"
    tables = (Table("kv_policies", (*COLUMNS, "selection_seed", "full_heads")),
              Table("kv_head_roles", ("layer", "head", "kv_head", "retrieval", "echo", "induction", "razor", "sink",
                                      *STATIC_COLUMNS)),
              Table("kv_passkey_answers", ANSWER_COLUMNS),
              Table("kv_gates_curve", ("step", "total", "distill", "l1", "mean_gate", "seconds"), optional=True))

    def uses_kv_cache(self, settings) -> bool:
        return True

    def check(self, cfg, s: RolesSettings):
        check_selection(s.selections, s.fractions, 10**9)  # names and (0, 1]; k checked with the model's heads below
        check_int("--selection-seeds", len(s.selection_seeds), minimum=1)
        check_int("--scoring-prompts", s.n_scoring, minimum=1)
        check_int("--gate-steps", s.gate_steps, minimum=1)
        if s.gate_seconds is not None:
            check_real("--gate-seconds", s.gate_seconds, minimum=0.0, strict=True)
        s, notes = check_retrieval(cfg, s, SELECT_LENGTHS)
        check_selection(s.selections, s.fractions, cfg.n_layers * cfg.kv_heads)
        if "static" in s.selections:
            check_rotary(cfg, "--rankings static (the static retrieval score)")
        stream = PolicyRun("streaming", Streaming(s.sinks, s.window))
        for max_len in (min(s.lengths) + s.max_new_tokens, s.data.length):
            stream.grid_for(cfg, max_len)
        # after the window's own check, so a window too long is blamed on --window, not on --loss-tokens
        if "loss" in s.selections:
            check_int("--loss-tokens", s.loss_tokens, minimum=s.sinks + s.window + 2,
                      hint=f"the loss ranking scores the tokens past sinks + window = {s.sinks + s.window}")
        if s.equal_bytes:  # the policy at the selections' bytes: its budget must fit the perplexity text too
            budgets = {equal_bytes_budget(f, n, s.sinks, s.window) for f in s.fractions for n in s.lengths}
            need = max(budgets)
            for budget in {min(budgets), need}:  # the method's name and its protect setting, at the budgets it runs at
                parse_policy(equal_bytes_name(s.equal_bytes, budget))
            if need > s.data.length:
                raise ValueError(f"--equal-bytes compares {s.equal_bytes} at the selections' bytes, {need} tokens per "
                                 f"head at the longest length and largest fraction, more than the {s.data.length}-token "
                                 f"perplexity text holds: pass --seq-len {need} or more, or shorter --lengths or "
                                 "smaller --fractions")
        return s, notes

    def measure(self, model, s: RolesSettings, stage):
        prompts = prompts_of(model, s)
        text = s.data.tokens(model)
        query, roles, curve = score_heads(model, prompts, text, s, stage)
        cfg = model.cfg
        rankings = {name: (None if name == "random" else ranking(roles, name)) for name in s.selections}
        stream = f"streaming({s.sinks},{s.window})"
        runs = [PolicyRun("full", "full", selection="full", full_fraction=1.0, full_heads=cfg.n_layers * cfg.kv_heads),
                PolicyRun(stream, stream, selection="streaming", tokens_per_head=s.sinks + s.window, full_fraction=0.0,
                          full_heads=0)]
        runs += selection_runs(rankings, cfg.n_layers, cfg.kv_heads, fractions=s.fractions, seeds=s.selection_seeds,
                               sinks=s.sinks, window=s.window)
        if s.equal_bytes:
            runs += equal_bytes_runs(s.fractions, sorted({p.length for p in prompts}), sinks=s.sinks, window=s.window,
                                     method=s.equal_bytes)
        answers, cells, summary = measure_runs(model, runs, prompts, text, max_new_tokens=s.max_new_tokens,
                                               chunk=s.chunk, progress_bar=s.progress, stage=stage)
        head_table = query.merge(roles.drop(columns=[c for c in roles.columns if c.endswith("_mean")] +
                                            [c for c in QUERY_SCORES if c in roles.columns]),
                                 on=["layer", "kv_head"], how="left")
        tables = {"kv_policies": cells, "kv_head_roles": head_table, "kv_passkey_answers": answers}
        return RolesMeasured(tables=tables if curve is None else {**tables, "kv_gates_curve": curve}, query=query,
                             roles=roles, summary=summary, prompts=prompts)

    def record(self, s: RolesSettings, m: RolesMeasured) -> dict:
        curve = m.get("kv_gates_curve")
        return dict(selections=list(s.selections), fractions=list(s.fractions), seeds=list(s.selection_seeds),
                    sinks=s.sinks, window=s.window, n_scoring=s.n_scoring, seed=s.seed, gate_steps=s.gate_steps,
                    gate_seconds=s.gate_seconds, gate_steps_done=None if curve is None else len(curve),
                    equal_bytes=s.equal_bytes, **prompts_record(m.prompts), max_new_tokens=s.max_new_tokens,
                    loss_tokens=min(s.loss_tokens, s.data.length) if "loss" in s.selections else None)

    def sections(self, s: RolesSettings, m: RolesMeasured, record) -> list[Section]:
        cells, summary = m["kv_policies"], m.summary
        sections = roles_sections(s.model, cells, summary, m.query, m.roles, m.get("kv_gates_curve"), s.sinks,
                                  s.window, gate_steps=s.gate_steps, gate_seconds=s.gate_seconds,
                                  equal_bytes=s.equal_bytes)
        if (n := record.get("loss_tokens")) is not None:
            sections[2].add(f"The streaming-loss ranking reads the perplexity text's first {n} tokens (the loss of the "
                            f"{n - s.sinks - s.window - 1} tokens predicted past sinks + window): a ranking that decides "
                            "half the KV heads on small loss differences, so another span of text can keep other heads.")
        return sections + policy_sections(s.model, cells, summary, m["kv_passkey_answers"],
                                          record["data_description"])[1:]


def selection_table(cells: pd.DataFrame) -> pd.DataFrame:
    """One row per (selection, full_fraction, length): passkey correct / n (random: summed over seeds, and
    the best and worst seed), mean bytes per token."""
    sel = cells[cells["selection"].notna()]
    rows = []
    for (s, f, length), part in sel.groupby(["selection", "full_fraction", "length"], dropna=False, sort=False):
        per_run = part.groupby("policy")[["correct", "n"]].sum()
        row = dict(selection=s, full_fraction=f, length=length, correct=int(per_run["correct"].sum()),
                   n=int(per_run["n"].sum()), bytes_per_token=float(part["bytes_per_token"].mean()),
                   runs=len(per_run))
        row["best_run"] = int(per_run["correct"].max())
        row["worst_run"] = int(per_run["correct"].min())
        row["n_per_run"] = int(per_run["n"].max())
        rows.append(row)
    return pd.DataFrame(rows)


def roles_headline(name, cells, roles, query, sinks, window, equal_bytes: str | None = None) -> list[str]:
    table = selection_table(cells)
    same = table[table["selection"] == equal_bytes] if equal_bytes else table.iloc[:0]
    full = table[table["selection"] == "full"]
    lines = []
    for length in sorted(table["length"].unique()):
        f = full[full["length"] == length]
        if not len(f):
            continue
        fk, fn = int(f["correct"].iloc[0]), int(f["n"].iloc[0])
        here = table[table["length"] == length]
        parts, enough = [], None
        for share in sorted(here[here["selection"].isin(RANKED)]["full_fraction"].unique()):
            at = here[(here["full_fraction"] == share) & here["selection"].isin(RANKED)]
            top = int(at["best_run"].max())
            best = ", ".join(at[at["best_run"] == top]["selection"])
            n = int(at["n_per_run"].max())
            rnd = here[(here["selection"] == "random") & (here["full_fraction"] == share)]
            rnd_text = (f"; random {int(rnd['worst_run'].iloc[0])}-{int(rnd['best_run'].iloc[0])}") if len(rnd) else ""
            eq = same[(same["full_fraction"] == share) & (same["length"] == length)]
            eq_text = (f"; {equal_bytes} on every head at the same bytes "
                       f"{accuracy_label(int(eq['correct'].iloc[0]), int(eq['n'].iloc[0]))}") if len(eq) else ""
            parts.append(f"{share:.0%}: {best} {accuracy_label(top, n)}{rnd_text}{eq_text}")
            if enough is None and fk and top >= 0.8 * fk * n / fn:
                enough = (share, best, top, n)
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


RANKED = ("retrieval", "razor", "loss", "gates", "static")
QUERY_SCORES = ("retrieval", "echo", "induction", "razor", "static")  # per query head; per KV head, the max


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


def static_sentence(query: pd.DataFrame, roles: pd.DataFrame) -> str | None:
    """The report's word on the static score beside the measured retrieval score: Spearman's rho over the query
    heads and over the KV heads, and the top-10 overlap; a model without RoPE has none (one sentence); None when
    the head table has no static column."""
    if "static" not in query.columns:
        return None
    if query["static"].isna().all():
        return "No static retrieval score: it reads RoPE's frequencies, and this model has no rotary positions."
    a = agreement(query)
    kv = agreement(roles.rename(columns={"kv_head": "head"}))
    names = ", ".join(head_name(l, h) for l, h in a["top"]["static"][:5])
    return (f"The static retrieval score (from the weights alone: low-frequency share of the query-key kernel times "
            f"its concentration, `interp kv static`) against the measured one: Spearman's rho {a['spearman']:.2f} over "
            f"{a['heads']} query heads ({kv['spearman']:.2f} over {kv['heads']} KV heads); {a['overlap']} of the "
            f"{len(a['top']['retrieval'])} strongest retrieval heads are among its {a['k']} highest ({names}, ...).")


def roles_sections(name, cells, summary, query, roles, curve, sinks, window, *, gate_steps=None,
                   gate_seconds=None, equal_bytes: str | None = "snapkv") -> list[Section]:
    cut = gate_cut(curve, gate_steps, gate_seconds)
    static = static_sentence(query, roles)
    s = Section("summary", "Summary").add(*roles_headline(name, cells, roles, query, sinks, window, equal_bytes),
                                         static, cut)
    sel = selection_table(cells)
    sel = sel.assign(passkey=[accuracy_label(c, n) for c, n in zip(sel["correct"], sel["n"])],
                     bytes_per_token=sel["bytes_per_token"].round(0).astype(int))
    table = Section("selections", "Selections at equal shares of KV heads kept full").add(
        f"Top-k KV heads by each ranking kept full, the rest streaming({sinks},{window}); random: k heads per seed "
        "(passkey summed over seeds; best_run / worst_run are single seeds)"
        + (f"; {equal_bytes} on every head with the per-head budget of the same bytes per token" if equal_bytes
           else "") + ". Accuracy as k of n.",
        sel[["selection", "full_fraction", "length", "passkey", "best_run", "worst_run", "n_per_run", "bytes_per_token"]],
        png(plots.selection_curves(sel), "kv_selections.png"))
    cols = [c for c in ("retrieval", "echo", "induction", "razor", "sink", "static") if c in query.columns]
    top = query.nlargest(10, "retrieval")[["layer", "head", "kv_head", *cols]]
    top.insert(0, "name", [head_name(l, h) for l, h in zip(top["layer"], top["head"])])
    heads = Section("heads", "Head roles").add(
        "The 10 query heads with the highest retrieval scores, beside their echo, induction (RazorAttention, on "
        "repeated random tokens), sink (attention to the first token) and static (from the weights alone: "
        "`interp kv static`) scores. KV heads rank by the max over their query heads.", top.round(4))
    kv_cols = [c for c in ("retrieval", "razor", "loss", "gate", "static")
               if c in roles.columns and roles[c].notna().any()]
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
