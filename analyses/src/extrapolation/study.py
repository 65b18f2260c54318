"""`interp extrapolate MODEL`: a rotary model read at 1x, 1.5x and 2x its trained context (n_ctx) as loaded
("none") and with RoPE scalings (PI, NTK-aware, YaRN: factor 2 by default), the heads that break, and a
repair of those heads alone; measured by `extrapolate.py`, written by `study.run`. A model with ALiBi (or
no) positions is read as loaded only: no scaling, share or repair applies to it (the controlled case beside
a RoPE twin: the zoo's alibi-gqa-4l and rope-gqa-4l). Learned and sinusoidal positions end at n_ctx.

Per scaling, one pass over the evaluation text at the longest length gives perplexity by position bucket
and every head's scores at every length (the autopsy); then the passkey prompts at every length and
depth. From the model as loaded: each head's change past n_ctx, its share of q . k energy on the rotary
pairs that never complete a period within n_ctx, and Spearman's rho between the two over heads. The
heads that break most at the longest length (at most `repair_fraction` of them) are then repaired: the
repair scaling (YaRN by default) on their KV heads only, and LogN temperature on the query heads only;
each is compared with the same scaling on every head, on perplexity and passkey at the longest length.

Tables: perplexity (scaling, bucket: positions start..end-1), passkey (one row per answer), autopsy (long
rows as `interp lengths`' with a scaling column) and heads (one row per head: share, changes, break rank,
which repair changed it; window 0 for a global layer). Figures: perplexity by position per scaling; each
head's change against its never-completed share.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

import numpy as np
import pandas as pd

from interp.errors import as_user_errors, check_int, check_real
from interp.models.rope.choice import as_hf, choose
from interp.models.rope.heads import logn_heads, scaled_heads

from ..document import Section, head_name, png
from .extrapolate import (BUCKETS, CHANGES, DEPTHS, FACTOR, REPAIR_FRACTION, SCALINGS, PairEnergy, autopsy_pass,
                          breaking_order, bucket_perplexity, choose_repair, head_changes, never_completed_shares,
                          passkey_answers, reference_length, rope_as, rotary_tables, scaled_layers, scaling_name,
                          sequence_nll, share_correlations, split_perplexity)
from ..kv.tasks import accuracy_label, retrieval_prompts
from .lengths import FROM_FRACTION, check_lengths
from ..study import Measured, Study, StudySettings, Table

LOGN = "logn"  # the temperature repair's name
AUTO = "auto"  # the repair by default: yarn on a rotary model, none elsewhere
AS_LOADED = ("alibi", None)  # positions read past n_ctx as loaded (None: no positions, NoPE)
SUMMARY = ("entropy", "sink", "distance", "distance_p99", "previous_token", "induction")


@dataclass(frozen=True, kw_only=True, eq=False)
class ExtrapolateSettings(StudySettings):
    """lengths: None for n_ctx, 1.5 n_ctx, 2 n_ctx (at least one within n_ctx and one past it); scalings:
    names for `extrapolate.scaling_name` ("none", the model as loaded, always measured), a bare type
    taking `factor` (None: `SCALINGS` on a rotary model, none alone on ALiBi); the passkey prompts
    (`depths`, empty for none; `prompts` per (length, depth), `seed`, `max_new_tokens`); `buckets` of positions for
    perplexity; the repair: `repair_scaling` (one of the scalings; None: no repair; "auto": yarn on a
    rotary model, none elsewhere) on at most `repair_fraction` of the heads, and LogN temperature on as many."""

    lengths: tuple[int, ...] | None = None
    scalings: tuple[str, ...] | None = None
    factor: float = FACTOR
    depths: tuple[float, ...] = DEPTHS
    prompts: int = 1
    seed: int = 0
    max_new_tokens: int = 8
    buckets: int = BUCKETS
    repair_scaling: str | None = AUTO
    repair_fraction: float = REPAIR_FRACTION
    backend: str = "auto"
    from_fraction: float = FROM_FRACTION


def check_scalings(cfg, scalings, factor: float) -> tuple[str, ...]:
    """The scalings' names (`scaling_name`), "none" first, each checked against the model's config (None: the
    default for its positions: `SCALINGS` on RoPE, none alone on ALiBi or no positions)."""
    if cfg.positional in AS_LOADED:
        other = [x for x in (scalings or ()) if str(x).strip() != "none"]
        if other:
            raise ValueError(f"--scalings {other[0]}: RoPE scalings need rotary positions, and this model's are "
                             f"{cfg.positional or 'none'}: it is read as loaded (leave --scalings out)")
        return ("none",)
    if cfg.positional != "rotary":
        raise ValueError(f"interp extrapolate reads a model past its trained context, and this model's positions are "
                         f"{cfg.positional} embeddings, which end at n_ctx={cfg.n_ctx:,}: give a model with rotary, "
                         "ALiBi or no positions")
    scalings = SCALINGS if scalings is None else scalings
    check_real("--factor", factor, minimum=0, strict=True)
    names = [scaling_name(x, factor) for x in scalings]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise ValueError(f"--scalings lists {', '.join(repeated)} twice")
    if "none" not in names:
        raise ValueError("--scalings must include none (the model as loaded): the heads' change past n_ctx is "
                         "measured on it")
    for n in names:
        if n != "none":
            choose(cfg, n)  # a bad type, factor or key: one line
    return ("none", *[n for n in names if n != "none"])


@dataclass(frozen=True, kw_only=True, eq=False)
class ExtrapolateMeasured(Measured):
    """Beside the tables: perplexity inside n_ctx and past it per scaling ({name: (inside, past)}), the first
    length past n_ctx, the repair (what settings.json says of it; None: none), n_ctx, the positions ("rotary",
    "alibi", "none", ...), the rotary tables (`extrapolate.rotary_tables`), each scaling's transformers
    parameters, and the layers' windows."""

    split: dict[str, tuple[float, float]]
    first: int
    repaired: dict | None
    n_ctx: int
    positional: str
    rotary_tables: list[dict]
    scalings: dict[str, dict]
    windows: list[int | None]


class ExtrapolateStudy(Study):
    """`interp extrapolate`: see the module docstring."""

    name = "extrapolate"
    title = "Reading past the trained context"
    tables = (Table("perplexity", ("scaling", "repair", "heads", "bucket", "start", "end", "tokens", "nll", "perplexity",
                                   "past_context"), csv=True),
              Table("passkey", ("scaling", "repair", "heads", "length", "depth", "seed", "key", "n_tokens", "answer",
                                "correct"), csv=True),
              Table("autopsy", ("scaling", "length", "layer", "head", "metric", "value", "extrapolated")),
              Table("heads", ("layer", "head", "name", "window", "share", "never_pairs", *CHANGES, "first_change",
                              "break_rank", "repaired_scaling", "repaired_temperature"), csv=True))

    def uses_kv_cache(self, settings) -> bool:
        return bool(settings.depths)  # the passkey answers are decoded through the cache

    def check(self, cfg, s: ExtrapolateSettings):
        scalings = check_scalings(cfg, s.scalings, s.factor)
        n_ctx = cfg.n_ctx
        lengths = s.lengths if s.lengths is not None else (n_ctx, (3 * n_ctx) // 2, 2 * n_ctx)
        lengths = check_lengths(list(lengths), n_ctx, extrapolate=True, minimum=4)
        if lengths[0] > n_ctx or lengths[-1] <= n_ctx:
            raise ValueError(f"--lengths needs one length within the model's context (n_ctx={n_ctx:,}) and one past "
                             f"it, e.g. --lengths {n_ctx},{2 * n_ctx}")
        for depth in s.depths:
            if not 0.0 <= depth <= 1.0:  # nan fails too
                raise ValueError(f"--depths {depth:g}: a depth is the fraction of the filler before the needle, "
                                 "between 0 and 1")
        check_int("--prompts", s.prompts, minimum=1)
        check_int("--new-tokens", s.max_new_tokens, minimum=1)
        check_int("--seed", s.seed, minimum=0)
        check_int("--buckets", s.buckets, minimum=1, maximum=lengths[-1] - 1)
        repair = s.repair_scaling
        if repair == AUTO:
            repair = "yarn" if cfg.positional == "rotary" else None
        elif repair is not None and cfg.positional != "rotary":
            raise ValueError(f"--repair {repair}: a repair rescales RoPE on the heads that break, and this model's "
                             f"positions are {cfg.positional or 'none'}: leave --repair out")
        if repair is not None:
            repair = scaling_name(repair, s.factor)
            if repair == "none" or repair not in scalings:
                raise ValueError(f"--repair {repair} is compared with the same scaling on every head: list it in "
                                 f"--scalings too (now {','.join(scalings)})")
            check_real("--repair-fraction", s.repair_fraction, minimum=0, strict=True)
            if s.repair_fraction > REPAIR_FRACTION:
                raise ValueError(f"--repair-fraction {s.repair_fraction:g}: a repair changes at most "
                                 f"{REPAIR_FRACTION:g} of the heads")
        s.placement.check_fits(cfg, s.data.rows, lengths[-1], what="--lengths")  # the text's pass
        if s.depths:
            s.placement.check_fits(cfg, 1, lengths[-1] + s.max_new_tokens, what="--lengths")  # a passkey answer
        data = s.data.at_length(lengths[-1]) if s.data.spec is not None else s.data
        if data.length < lengths[-1]:
            raise ValueError(f"the data holds {data.length} tokens a sequence, fewer than the longest length "
                             f"{lengths[-1]}")
        data.check(cfg.d_vocab)
        return dataclasses.replace(s, lengths=tuple(lengths), scalings=scalings, repair_scaling=repair, data=data), []

    def measure(self, model, s: ExtrapolateSettings, stage):
        cfg, lengths, longest = model.cfg, list(s.lengths), s.lengths[-1]
        n_ctx, group, total = cfg.n_ctx, cfg.n_heads // cfg.kv_heads, cfg.n_layers * cfg.n_heads
        tokens = s.data.tokens(model)[:, :longest]
        prompts = []  # no depths: no passkey
        if s.depths:
            with as_user_errors(ValueError):  # a tokenizer that cannot hold a prompt at the shortest length: one line
                prompts = retrieval_prompts(model, lengths, list(s.depths), s.prompts, s.seed, max_length=longest)

        def answers_to(asked, name):
            if not asked:
                return passkey_answers(model, [])  # the table's columns, no row
            return stage(f"{name}: passkey ({len(asked)} prompts)",
                         lambda: passkey_answers(model, asked, s.max_new_tokens))
        rotary = model.rotary is not None
        energy = PairEnergy(model, n_ctx) if rotary else None
        rescaled = len(scaled_layers(cfg)) * cfg.n_heads  # the heads a global scaling changes
        ppl, answers, autopsy, split = [], [], [], {}

        def keep(name, nll, ans, heads, repair):
            ppl.append(bucket_perplexity(nll, s.buckets, n_ctx).assign(scaling=name, repair=repair, heads=heads))
            answers.append(ans.assign(scaling=name, repair=repair, heads=heads))
            split[name] = split_perplexity(nll, n_ctx)

        for name in s.scalings:
            with rope_as(model, name), as_user_errors(ValueError):  # NaN scores: one line, never a finding
                scores, nll = stage(f"{name}: scores and losses at {longest:,} tokens", lambda: autopsy_pass(
                    model, tokens, lengths, energy=energy if name == "none" else None, from_fraction=s.from_fraction,
                    backend=s.backend))
                ans = answers_to(prompts, name)
            autopsy.append(scores.assign(scaling=name))
            keep(name, nll, ans, 0 if name == "none" else rescaled, False)

        changes = head_changes(autopsy[0], n_ctx)
        first = min(n for n in lengths if n > n_ctx)
        heads = _heads_table(model, energy, changes, first, longest)
        repaired = None
        if s.repair_scaling is not None:
            chosen, groups = choose_repair(breaking_order(changes, longest), cfg, s.repair_fraction)
            scaled = sorted((l, h) for l, g in groups for h in range(g * group, (g + 1) * group))
            long_prompts = [p for p in prompts if p.length == longest]
            runs = [(f"{s.repair_scaling} (repair)", scaled,
                     lambda: scaled_heads(model, groups, choose(cfg, s.repair_scaling))),
                    (f"{LOGN} (repair)", chosen, lambda: logn_heads(model, chosen, n_ctx))]
            for name, changed, repair in runs:
                if not changed:  # no KV head's query heads fit the budget
                    continue
                with repair():
                    nll = stage(f"{name}: losses at {longest:,} tokens", lambda: sequence_nll(model, tokens))
                    ans = answers_to(long_prompts, name)
                keep(name, nll, ans, len(changed), True)
            pairs = list(zip(heads["layer"], heads["head"]))
            heads["repaired_scaling"] = [p in set(scaled) for p in pairs]
            heads["repaired_temperature"] = [p in set(chosen) for p in pairs]
            repaired = {"scaling": s.repair_scaling, "fraction": s.repair_fraction,
                        "budget_heads": int(s.repair_fraction * total + 1e-9),
                        "kv_heads": [f"L{l}KV{g}" for l, g in groups],
                        "scaled_heads": [head_name(l, h) for l, h in scaled],
                        "logn_heads": [head_name(l, h) for l, h in chosen]}
        tables = {"perplexity": pd.concat(ppl, ignore_index=True), "passkey": pd.concat(answers, ignore_index=True),
                  "autopsy": pd.concat(autopsy, ignore_index=True), "heads": heads}
        return ExtrapolateMeasured(tables=tables, split=split, first=first, repaired=repaired, n_ctx=n_ctx,
                                   positional=cfg.positional or "none",
                                   rotary_tables=rotary_tables(model, n_ctx) if rotary else [],
                                   scalings={n: as_hf(choose(cfg, n)) for n in s.scalings if n != "none"},
                                   windows=list(cfg.windows()))

    def record(self, s: ExtrapolateSettings, m: ExtrapolateMeasured) -> dict:
        heads, n_ctx = m["heads"], m.n_ctx
        out = {"n_ctx": n_ctx, "lengths": list(s.lengths), "reference_length": reference_length(s.lengths, n_ctx),
               "first_length_past": m.first, "scalings": list(s.scalings), "scaling_parameters": m.scalings,
               "factor": s.factor, "depths": list(s.depths), "prompts_per_cell": s.prompts, "seed": s.seed,
               "max_new_tokens": s.max_new_tokens, "n_sequences": s.data.rows, "buckets": s.buckets,
               "queries_from_fraction": s.from_fraction, "rotary_tables": m.rotary_tables,
               "positions": m.positional,
               "spearman": share_correlations(heads) if m.rotary_tables else None,
               "break_first": list(heads.sort_values("break_rank")["name"].head(10)),
               "perplexity_inside_past": {k: [round(a, 4), round(b, 4)] for k, (a, b) in m.split.items()},
               "repair": m.repaired}
        if m.rotary_tables and any(w is not None for w in m.windows):
            out["spearman_global_layers"] = share_correlations(heads[heads["window"] == 0])
        return out

    def sections(self, s: ExtrapolateSettings, m: ExtrapolateMeasured, record) -> list[Section]:
        return report_sections(s.model, m, record)


def _heads_table(model, energy, changes: pd.DataFrame, first: int, longest: int) -> pd.DataFrame:
    """One row per head: its share (NaN without rotary positions: `energy` None), its changes at the longest
    length, its entropy change and break rank at the first length past n_ctx."""
    if energy is not None:
        table = never_completed_shares(model, energy)
    else:
        cfg = model.cfg
        table = pd.DataFrame([{"layer": l, "head": h, "share": float("nan"), "never_pairs": 0}
                              for l in range(cfg.n_layers) for h in range(cfg.n_heads)])
    table = table.set_index(["layer", "head"])
    table = table.join(changes[changes["length"] == longest].set_index(["layer", "head"])[list(CHANGES)])
    table["first_change"] = changes[changes["length"] == first].set_index(["layer", "head"])["entropy"]
    order = breaking_order(changes, first)
    table["break_rank"] = pd.Series(np.arange(1, len(order) + 1), index=pd.MultiIndex.from_arrays(
        [order["layer"], order["head"]]))
    table = table.reset_index()
    windows = model.cfg.windows()
    table.insert(2, "name", [head_name(l, h) for l, h in zip(table["layer"], table["head"])])
    table.insert(3, "window", [windows[l] or 0 for l in table["layer"]])
    return table.assign(repaired_scaling=False, repaired_temperature=False)


# ---- the report ------------------------------------------------------------------------------------------
def plot_perplexity(ppl: pd.DataFrame, n_ctx: int):
    """Perplexity by position bucket, one line per scaling (repairs dashed), the trained context marked."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(9, 4.5))
    ax = fig.subplots()
    for i, (name, part) in enumerate(ppl.groupby("scaling", sort=False)):
        mid = (part["start"] + part["end"]) / 2
        ax.plot(mid, part["perplexity"], "--" if part["repair"].iloc[0] else "-", marker="o", ms=3, color=f"C{i}",
                label=name)
    ax.axvline(n_ctx, color="0.4", lw=0.8, ls=":")
    ax.set_yscale("log")
    ax.set_xlabel(f"position of the predicted token (dotted: the trained context, {n_ctx:,})")
    ax.set_ylabel("perplexity")
    ax.legend(fontsize=8, frameon=False)
    fig.tight_layout()
    return fig


def plot_change_vs_share(heads: pd.DataFrame, spearman: dict, named: list[str], longest: int):
    """Each head's |change| (entropy, distance, sink) against its never-completed share; sliding-window layers'
    heads in blue, the heads that break first named."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(13, 4))
    labels = {"entropy": "|entropy change| (nats)", "distance": "|log2 distance ratio|", "sink": "|sink change|"}
    for ax, c in zip(fig.subplots(1, 3), CHANGES):
        colour = np.where(heads["window"].to_numpy() > 0, "C0", "C3")
        ax.scatter(heads["share"], heads[c].abs(), s=10, c=colour, alpha=0.7)
        for _, r in heads[heads["name"].isin(named)].iterrows():
            ax.annotate(r["name"], (r["share"], abs(r[c])), fontsize=7)
        rho = spearman.get(c)
        ax.set_title(f"{labels[c]} at {longest:,}: Spearman {'n/a' if rho is None else f'{rho:+.2f}'}", fontsize=9)
        ax.set_xlabel("share of |q.k| energy on never-completed pairs", fontsize=8)
    fig.tight_layout()
    return fig


def _layers(layers: list[int]) -> str:
    if layers == list(range(layers[0], layers[-1] + 1)):
        return f"layers {layers[0]}-{layers[-1]}" if len(layers) > 1 else f"layer {layers[0]}"
    return "layers " + ", ".join(map(str, layers))


def _ppl_line(split: dict, names) -> str:
    return "; ".join(f"{n} {split[n][0]:.2f} / {split[n][1]:.2f}" for n in names if n in split)


def _accuracy(part: pd.DataFrame) -> str:
    return accuracy_label(int(part["correct"].sum()), len(part))


def report_sections(model_name: str, m: ExtrapolateMeasured, record: dict) -> list[Section]:
    """The report of `ExtrapolateStudy` from what it measured and settings.json."""
    heads, passkey = m["heads"], m["passkey"]
    order = heads.sort_values("break_rank")  # the heads that break first, first
    sections = [_summary(model_name, m, record, order), _perplexity_section(m["perplexity"], record["n_ctx"])]
    if not passkey.empty:
        sections.append(_passkey_section(passkey, record))
    sections.append(_autopsy_section(m["autopsy"], order, record))
    if record["rotary_tables"]:
        sections.append(_frequencies_section(heads, list(order["name"].head(5)), record))
    if record.get("repair"):
        sections.append(_repair_section(m, record))
    sections.append(Section("settings", "Settings").add("```\n" + json.dumps(record, indent=2) + "\n```"))
    return sections


def _rho_text(rho: dict | None) -> str:
    return ", ".join(f"{c} {'n/a' if rho[c] is None else f'{rho[c]:+.2f}'}" for c in CHANGES) if rho else ""


def _summary(model_name: str, m: ExtrapolateMeasured, record: dict, order: pd.DataFrame) -> Section:
    passkey, split = m["passkey"], m.split
    lengths, n_ctx, first = record["lengths"], record["n_ctx"], record["first_length_past"]
    longest, ref, scalings = lengths[-1], record["reference_length"], record["scalings"]
    rotary = bool(record["rotary_tables"])
    at_longest, asked = passkey[passkey["length"] == longest], not passkey.empty
    read_as = (f"as loaded (none) and with {', '.join(scalings[1:]) or 'no scaling'}, each from an original length of "
               "n_ctx" if rotary else "as loaded: " + (
                   "it has no positional encoding (NoPE)" if record.get("positions") == "none"
                   else f"its positions are {record.get('positions')}") + ", which no RoPE scaling applies to")
    summary = Section("summary", "Summary").add(
        f"{model_name} read at {', '.join(f'{n:,}' for n in lengths)} tokens (trained context n_ctx = {n_ctx:,}) "
        f"{read_as}. Per "
        f"scaling one forward over {record['n_sequences']} sequence(s) of the evaluation text at {longest:,} tokens gives "
        "the perplexity by position and every head's scores at every length (queries L/2 .. L-1, by the streaming "
        "statistics kernel: no n x n pattern); " + ("the passkey prompts are answered greedily through the full cache."
                                                    if asked else "no passkey prompt was asked (--depths none)."),
        f"Perplexity inside n_ctx / past it: {_ppl_line(split, split)}.")
    if asked:
        summary.add(f"Passkey at {longest:,} tokens: " + "; ".join(
            f"{n} {_accuracy(g)}" for n, g in at_longest.groupby("scaling", sort=False)) + ".")
    summary.add(
        f"The heads that break first (the largest change in attention entropy from {ref:,} to {first:,} tokens, as "
        "loaded): " + ", ".join(f"{r['name']} ({r['first_change']:+.3f} nats)" for _, r in order.head(5).iterrows())
        + ".")
    if rotary:
        summary.add(f"Spearman's rho over the {len(order)} heads between each head's share of |q.k| energy on the "
                    f"rotary pairs that never complete a period within n_ctx and how much it changes from {ref:,} to "
                    f"{longest:,} tokens: {_rho_text(record['spearman'])}.")
    repaired = record.get("repair")
    if repaired:
        def said(name):
            part = at_longest[at_longest["scaling"] == name]
            return f"perplexity past n_ctx {split[name][1]:.2f}" + (f", passkey {_accuracy(part)}" if asked else "")

        summary.add(f"Repair at {longest:,} tokens (the heads that break most, at most {repaired['fraction']:g} of "
                    "them): " + "; ".join(f"{n}: {said(n)}" for n in split if n.endswith("(repair)"))
                    + f"; against {repaired['scaling']} on every head: {said(repaired['scaling'])}, and none: "
                    f"{said('none')}.")
    if record.get("spearman_global_layers"):
        g = record["spearman_global_layers"]
        summary.add("Over the global layers' heads only: " + ", ".join(
            f"{c} {'n/a' if g[c] is None else f'{g[c]:+.2f}'}" for c in CHANGES) + ".")
    return summary


def _perplexity_section(ppl: pd.DataFrame, n_ctx: int) -> Section:
    table = ppl.pivot_table(index="scaling", columns="bucket", values="perplexity", sort=False)
    spans = ppl.drop_duplicates("bucket").set_index("bucket")
    table.columns = [f"{spans.loc[b, 'start']:,}-{spans.loc[b, 'end'] - 1:,}" for b in table.columns]
    return Section("perplexity", "Perplexity by position").add(
        "Perplexity of the tokens at each span of positions (the first token is never predicted); dashed lines and "
        "rows marked (repair) change only the heads the autopsy chose, at the longest length.",
        png(plot_perplexity(ppl, n_ctx), "perplexity_by_position.png"), table.round(3).reset_index())


def _passkey_section(passkey: pd.DataFrame, record: dict) -> Section:
    longest = record["lengths"][-1]
    at_longest = passkey[passkey["length"] == longest]
    cells = passkey.groupby(["scaling", "length"], sort=False).apply(_accuracy, include_groups=False).unstack()
    cells.columns = [f"{c:,}" for c in cells.columns]
    depth = at_longest.groupby(["scaling", "depth"], sort=False).apply(_accuracy, include_groups=False).unstack()
    depth.columns = [f"depth {c:g}" for c in depth.columns]
    return Section("passkey", "Passkey").add(
        f"Correct answers by length (the key in the {record['max_new_tokens']} greedy tokens after the prompt):",
        cells.fillna("").reset_index(), f"At {longest:,} tokens, by depth of the needle:", depth.reset_index())


def _autopsy_section(autopsy: pd.DataFrame, order: pd.DataFrame, record: dict) -> Section:
    first, longest, ref = record["first_length_past"], record["lengths"][-1], record["reference_length"]
    means = autopsy[autopsy["metric"].isin(SUMMARY)].pivot_table(index=["scaling", "length"], columns="metric",
                                                                 values="value", sort=False)[list(SUMMARY)]
    top = order.head(10)[["name", *(["share"] if record["rotary_tables"] else []), "first_change", *CHANGES]].rename(
        columns={"first_change": f"entropy change at {first:,}", **{c: f"{c} change at {longest:,}" for c in CHANGES}})
    return Section("autopsy", "The heads, by length and scaling").add(
        "The mean over heads of each score at each length and scaling (queries L/2 .. L-1):",
        means.round(4).reset_index(),
        f"The heads that break first, as loaded: by |entropy change| from {ref:,} to {first:,} tokens (distance: log2 "
        "of (distance + 1) over the reference's; the autopsy table holds every head's scores):",
        top.round(4))


def _frequencies_section(heads: pd.DataFrame, named: list[str], record: dict) -> Section:
    n_ctx, longest, ref = record["n_ctx"], record["lengths"][-1], record["reference_length"]
    tables = "; ".join(f"{_layers(t['layers'])}: {t['never_completed_pairs']} of {t['pairs']} pairs ("
                       + (f"from pair {t['first_never_completed']} on; " if t["never_completed_pairs"] else "")
                       + f"the longest period {t['longest_period']:,.0f} tokens)" for t in record["rotary_tables"])
    return Section("frequencies", "Never-completed rotary pairs").add(
        f"Pair i turns at theta_i; it completes a period within n_ctx = {n_ctx:,} when 2 pi / theta_i <= n_ctx. "
        f"Pairs that never do: {tables}. A head's share is its |q_i| |k_i| (means over the trained context's "
        f"positions) on those pairs over all its dimensions. Spearman's rho with the change from {ref:,} to "
        f"{longest:,}: {_rho_text(record['spearman'])}.",
        png(plot_change_vs_share(heads, record["spearman"], named, longest), "change_vs_share.png"))


def _repair_section(m: ExtrapolateMeasured, record: dict) -> Section:
    ppl, passkey, split, repaired = m["perplexity"], m["passkey"], m.split, record["repair"]
    longest, asked = record["lengths"][-1], not passkey.empty
    at_longest = passkey[passkey["length"] == longest]
    global_name = repaired["scaling"]
    rows = []
    for name in ["none", global_name, *[n for n in split if n.endswith("(repair)")]]:
        part = at_longest[at_longest["scaling"] == name]
        heads_changed = int(ppl.loc[ppl["scaling"] == name, "heads"].iloc[0])
        rows.append({"scaling": name, "heads changed": heads_changed, "perplexity inside n_ctx": split[name][0],
                     "perplexity past n_ctx": split[name][1],
                     **({f"passkey at {longest:,}": _accuracy(part)} if asked else {})})
    every = rows[1]["heads changed"] == len(repaired["scaled_heads"])
    return Section("repair", "Repairing the heads that break").add(
        f"The heads whose entropy moves most at {longest:,} tokens, at most {repaired['fraction']:g} of all "
        f"({repaired['budget_heads']} heads): {global_name} on their KV heads only "
        f"({', '.join(repaired['kv_heads']) or 'none fit the budget'}: every query head of a chosen KV head counts), "
        f"and LogN temperature (max(1, log(p + 1) / log n_ctx) on the logits of the query at position p) on "
        f"{', '.join(repaired['logn_heads']) or 'no head'}; against the same scaling on every head"
        + (f" (the KV heads chosen hold every head {global_name} changes: the two are the same model)" if every
           else "") + ":",
        pd.DataFrame(rows).round(4))


__all__ = ["ExtrapolateMeasured", "ExtrapolateSettings", "ExtrapolateStudy", "check_scalings", "plot_change_vs_share", "plot_perplexity",
           "report_sections"]
