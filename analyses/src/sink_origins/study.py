"""`interp sinks MODEL`: where the attention sinks are, and what makes the first token one.

One forward of the unmodified model (`measure.sink_pass`) gives, per head, the sink mass on the first token, on
the first delimiter and on the largest other key (with gpt-oss's learned sink logits, each head's exact sink
share), per layer the residual stream's massive activations (Sun et al. 2024), and the loss. Then one forward
per intervention (`interventions.py`: the massive dimensions zeroed, the query bias removed, each early MLP
mean-ablated at the first position, the first token's key direction projected out) gives the sink mass per layer
and the loss after it, beside the unmodified model's. The sink levels (`levels.py`): every position that draws a
sink's mass in some layer, grouped by the token it holds, the layer it forms at, its mass by layer, and which
attention layer or MLP before that layer makes it (zeroed there, one forward each).

Tables: heads (one row per head: first, delimiter, other and its position, learned, which sink, is_sink),
massive (the largest activations per layer, one per dimension and token kind), interventions (one row per
intervention and the unmodified model, "none"), intervention_layers (the same per layer), sink_levels (one row per
sink site), sink_level_layers (its mass by layer) and sink_level_ablations (one row per site and component removed).
Figures: sink mass by layer and head, the largest activation per layer by token kind, sink mass by layer per
intervention, sink mass by layer per sink site.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

import pandas as pd
import torch

from interp.errors import check_int, check_real
from interp.models.placement.device import to_numpy

from .._common import progress
from ..document import Section, png
from ..plots import plot_head_scores
from ..study import Measured, Study, StudySettings, Table, fit_default
from .interventions import Reference, check_interventions, choose_massive, describe, expand, hooks_for, label
from .levels import ABLATION_COLUMNS, LAYER_COLUMNS, LEVEL_COLUMNS, MAX_SITES, n_levels, sink_levels
from .measure import KINDS, MASSIVE_MIN, MASSIVE_RATIO, delimiter_ids, is_massive, sink_pass, token_kinds

EPSILON = 0.3  # Gu et al.'s threshold: a head is a sink head when its alpha_0 exceeds it
TOP_K = 4  # massive-activation rows per layer
HEAD_COLUMNS = ("layer", "head", "first", "delimiter", "other", "other_position", "other_is_delimiter", "learned",
                "sink", "sink_mass", "is_sink")
MASSIVE_COLUMNS = ("layer", "rank", "dim", "kind", "sequence", "position", "token", "value", "magnitude", "median",
                   "ratio", "massive")
RUN_COLUMNS = ("intervention", "description", "sink_mass", "sink_mass_change", "delimiter_mass", "sink_rate", "loss",
               "loss_change")


@dataclass(frozen=True, kw_only=True, eq=False)
class SinksSettings(StudySettings):
    """interventions: names from `interventions.INTERVENTIONS` (None: every one that applies to the model);
    mlp_layers: the early MLPs ablated one at a time (None: 0, 1, 2); epsilon: Gu et al.'s threshold in [0, 1];
    top_k: massive-activation rows per layer; massive_min, massive_ratio: Sun et al.'s criterion; delimiters:
    the delimiter token ids (None: found from the tokenizer's text of each token); backend: the statistics';
    levels: the sink sites whose makers are traced (`levels.py`; 0: the sites and their masses only)."""

    interventions: tuple[str, ...] | None = None
    mlp_layers: tuple[int, ...] | None = None
    epsilon: float = EPSILON
    top_k: int = TOP_K
    massive_min: float = MASSIVE_MIN
    massive_ratio: float = MASSIVE_RATIO
    delimiters: tuple[int, ...] | None = None
    backend: str = "auto"
    levels: int = MAX_SITES


@dataclass(frozen=True, kw_only=True, eq=False)
class SinksMeasured(Measured):
    """Beside the tables: the first token's massive dimensions by the layer where each appears (and whether they
    meet the criterion), whether the model has learned sink logits, how many sequences had a delimiter, whether every
    sequence starts with the same token (a BOS: then key_direction sets that key to zero)."""

    massive: dict[int, list[int]]
    massive_found: bool
    learned: bool
    with_delimiter: int
    same_first: bool


class SinksStudy(Study):
    """`interp sinks`: see the module docstring."""

    name = "sinks"
    title = "Where the attention sinks come from"
    tables = (Table("heads", HEAD_COLUMNS, csv=True), Table("massive", MASSIVE_COLUMNS, csv=True),
              Table("interventions", RUN_COLUMNS, csv=True),
              Table("intervention_layers", ("intervention", "layer", "sink_mass", "delimiter_mass", "sink_rate")),
              Table("sink_levels", LEVEL_COLUMNS, csv=True), Table("sink_level_layers", LAYER_COLUMNS),
              Table("sink_level_ablations", ABLATION_COLUMNS, csv=True))

    def check(self, cfg, s: SinksSettings):
        names, layers, notes = check_interventions(s.interventions, cfg, s.mlp_layers)
        check_int("--top-k", s.top_k, minimum=1)
        check_int("--levels", s.levels, minimum=0)
        check_real("massive_min", s.massive_min, minimum=0)
        check_real("massive_ratio", s.massive_ratio, minimum=1)
        data, note = check_sink_settings(cfg, s)
        s = dataclasses.replace(s, interventions=names, mlp_layers=layers, data=data)
        return s, notes + ([note] if note else [])

    def measure(self, model, s: SinksSettings, stage):
        tokens = s.data.tokens(model)
        delims = set(s.delimiters) if s.delimiters is not None else delimiter_ids(model, tokens)
        kinds, first_delim = token_kinds(tokens, delims)
        common = dict(kinds=kinds, first_delim=first_delim, backend=s.backend)
        base = stage("the unmodified model: sinks, massive activations, loss", lambda: sink_pass(
            model, tokens, reference=True, mlp_layers=s.mlp_layers, top_k=s.top_k, **common))
        massive, found = choose_massive(base.first_magnitude, base.medians, s.massive_min, s.massive_ratio)
        ref = Reference(massive, found, base.mlp_means, base.key_dirs)
        runs = [("none", "the unmodified model", base)]
        for name, l in progress(expand(s.interventions, s.mlp_layers), desc="interventions", enabled=s.progress):
            hooks = hooks_for(model, name, l, ref)
            res = stage(label(name, l), lambda: sink_pass(model, tokens, hooks=hooks, **common))
            runs.append((label(name, l), describe(name, l, ref), res))
        levels = stage("sink levels: every key's mass, then the components before each level", lambda: sink_levels(
            model, tokens, s.epsilon, delims, max_sites=s.levels, text=lambda i: _token_text(model, i),
            progress=lambda xs, desc: progress(xs, desc=desc, enabled=s.progress)))
        tables = {"heads": heads_table(base, kinds, s.epsilon), **levels,
                  "massive": massive_table(model, base, tokens, s.massive_min, s.massive_ratio),
                  **run_tables(runs, s.epsilon)}
        return SinksMeasured(tables=tables, massive=massive, massive_found=found,
                             learned="learned" in base.heads, with_delimiter=int((first_delim >= 0).sum()),
                             same_first=bool((tokens[:, 0] == tokens[0, 0]).all()))

    def record(self, s: SinksSettings, m: SinksMeasured) -> dict:
        runs = m["interventions"].set_index("intervention")
        return {"interventions": list(s.interventions), "mlp_layers": list(s.mlp_layers), "epsilon": s.epsilon,
                "n_sequences": s.data.rows, "seq_len": s.data.length, "sequences_with_delimiter": m.with_delimiter,
                "massive_criterion": {"min": s.massive_min, "ratio": s.massive_ratio},
                "massive_first_token": {"dims_by_layer": {str(l): d for l, d in m.massive.items()},
                                        "meets_criterion": m.massive_found},
                "learned_sinks": m.learned,
                "sink_mass": {k: round(float(v), 5) for k, v in runs["sink_mass"].items()},
                "sink_levels": _levels_record(m["sink_levels"]),
                "loss": {k: round(float(v), 5) for k, v in runs["loss"].items()}}

    def sections(self, s: SinksSettings, m: SinksMeasured, record) -> list[Section]:
        return report_sections(s.model, m, record)


def check_sink_settings(cfg, s: StudySettings):
    """What the sinks study and its onset over checkpoints check alike, before the model loads: --epsilon a share
    of attention, the text's length (a default fitted to n_ctx, said in the note; one past it refused), at least
    one sequence, ids inside the vocabulary, and memory. Returns (the data to read, the note or None)."""
    check_real("--epsilon", s.epsilon, minimum=0)
    if s.epsilon > 1:
        raise ValueError(f"--epsilon must be between 0 and 1 (a share of attention), got {s.epsilon:g}")
    data, note = fit_default(s.data, cfg.n_ctx)
    if data.length > cfg.n_ctx:
        raise ValueError(f"--seq-len {data.length} is past this model's context (n_ctx={cfg.n_ctx:,})")
    if data.length < 4:
        raise ValueError(f"--seq-len {data.length}: the study needs at least 4 tokens a sequence")
    check_int("--n-seqs", data.rows, minimum=1)
    data.check(cfg.d_vocab)
    s.placement.check_fits(cfg, data.rows, data.length)
    return data, note


# ---- tables ------------------------------------------------------------------------------------------------
def heads_table(base, kinds: torch.Tensor, epsilon: float) -> pd.DataFrame:
    """One row per head: its sink masses, which is largest (first, delimiter, other, or learned: the learned sink
    logit's share) and whether it passes `epsilon`."""
    h = base.heads
    n_layers, n_heads = h["first"].shape
    where = h["_other_where"]  # [layer, batch, head]
    kind_at = kinds.gather(1, where.permute(1, 0, 2).reshape(kinds.shape[0], -1)).reshape(
        kinds.shape[0], n_layers, n_heads)
    is_delim = (kind_at == KINDS.index("delimiter")).float().mean(0)
    cols = {k: to_numpy(h[k].reshape(-1)) for k in ("first", "delimiter", "other", "other_position")}
    frame = pd.DataFrame({"layer": [l for l in range(n_layers) for _ in range(n_heads)],
                          "head": list(range(n_heads)) * n_layers, **cols,
                          "other_is_delimiter": to_numpy(is_delim.reshape(-1))})
    frame["learned"] = to_numpy(h["learned"].reshape(-1)) if "learned" in h else float("nan")
    masses = frame[["first", "delimiter", "other", "learned"]].fillna(-1.0)  # learned: NaN without sink logits
    frame["sink"] = masses.idxmax(axis=1)
    frame["sink_mass"] = masses.max(axis=1)
    frame["is_sink"] = frame["sink_mass"] > epsilon
    frame["other_position"] = frame["other_position"].astype(int)
    return frame[list(HEAD_COLUMNS)]


def _token_text(model, i: int) -> str:
    tok = getattr(model, "tokenizer", None)
    return str(i) if tok is None else tok.decode([i])


def massive_table(model, base, tokens, minimum: float, at_least: float) -> pd.DataFrame:
    """The massive-activation rows of every layer, with each row's token text and Sun et al.'s mark."""
    frame = pd.DataFrame(base.massive, columns=[c for c in MASSIVE_COLUMNS if c not in ("token", "massive")])
    ids = tokens[frame["sequence"].tolist(), frame["position"].tolist()].tolist() if len(frame) else []
    frame["token"] = [_token_text(model, int(i)) for i in ids]
    frame["massive"] = is_massive(frame["magnitude"], frame["ratio"], minimum, at_least)
    return frame[list(MASSIVE_COLUMNS)]


def run_tables(runs, epsilon: float) -> dict[str, pd.DataFrame]:
    """interventions (one row per run) and intervention_layers (one per run and layer)."""
    rows, layers = [], []
    base = runs[0][2]
    for name, what, res in runs:
        first, delim = res.heads["first"], res.heads["delimiter"]
        rows.append(dict(intervention=name, description=what, sink_mass=float(first.mean()),
                         sink_mass_change=float(first.mean() - base.heads["first"].mean()),
                         delimiter_mass=float(delim.nanmean()), sink_rate=float((first > epsilon).float().mean()),
                         loss=res.loss, loss_change=res.loss - base.loss))
        for l in range(first.shape[0]):
            layers.append(dict(intervention=name, layer=l, sink_mass=float(first[l].mean()),
                               delimiter_mass=float(delim[l].nanmean()),
                               sink_rate=float((first[l] > epsilon).float().mean())))
    return {"interventions": pd.DataFrame(rows), "intervention_layers": pd.DataFrame(layers)}


# ---- the report --------------------------------------------------------------------------------------------
def plot_by_layer(frame: pd.DataFrame, value: str, hue: str, ylabel: str, logy: bool = False):
    """One line per `hue` of `value` over layers."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(9, 4))
    ax = fig.subplots()
    for i, (name, part) in enumerate(frame.groupby(hue, sort=False)):
        plain = name == "none"  # the unmodified model, drawn first and darkest
        ax.plot(part["layer"], part[value], marker="o", ms=3, color="black" if plain else f"C{i % 10}",
                lw=2.2 if plain else 1.2, label=str(name), ls="-" if i < 10 else "--")
    if logy:
        ax.set_yscale("log")
    ax.set_xlabel("layer")
    ax.set_ylabel(ylabel)
    ax.legend(fontsize=8, frameon=False)
    fig.tight_layout()
    return fig


def report_sections(model_name: str, m: SinksMeasured, record: dict) -> list[Section]:
    heads, massive, runs = m["heads"], m["massive"], m["interventions"]
    sections = [_summary(model_name, m, record), _sinks_section(heads, record), _massive_section(massive, m, record),
                _interventions_section(runs, m["intervention_layers"], m.same_first),
                _levels_section(m["sink_levels"], m["sink_level_layers"], m["sink_level_ablations"], record)]
    sections.append(Section("settings", "Settings").add("```\n" + json.dumps(record, indent=2) + "\n```"))
    return sections


def _summary(model_name: str, m: SinksMeasured, record: dict) -> Section:
    heads, massive, runs = m["heads"], m["massive"], m["interventions"]
    eps = record["epsilon"]
    per_layer = heads.groupby("layer")["first"].mean()
    start = per_layer[per_layer > eps]
    kinds = heads[heads["is_sink"]]["sink"].value_counts()
    top = massive.sort_values("magnitude", ascending=False).iloc[0] if len(massive) else None
    base = runs.iloc[0]
    others = runs.iloc[1:].sort_values("sink_mass")
    out = Section("summary", "Summary").add(
        f"{model_name}: {record['n_sequences']} sequence(s) of {record['seq_len']} tokens. Sink mass is Gu et al. "
        "(2024)'s alpha: the mean over the queries that see a key of each one's attention on it.",
        f"First-token sink mass, mean over heads: {base['sink_mass']:.3f}; {base['sink_rate']:.0%} of heads put more "
        f"than {eps:g} on it" + (f"; the layer mean passes {eps:g} from layer {start.index[0]} on." if len(start)
                                 else "."),
        "Sink heads by where their sink is: " + (", ".join(f"{k} {v}" for k, v in kinds.items()) or "none") + ".")
    if m.learned:
        out.add(f"Learned sink logits: their share of attention, mean over heads, {heads['learned'].mean():.3f}.")
    if top is not None:
        out.add(f"The largest activation in the residual stream: {top['value']:+.1f} in dimension {top['dim']} at "
                f"the {top['kind'].replace('_', ' ')} token ({top['token']!r}) after layer {top['layer']}, "
                f"{top['ratio']:,.0f} x the layer's median |activation|.")
    out.add(_levels_headline(m["sink_levels"], eps))
    if len(others):
        best = others.iloc[0]
        out.add(f"The intervention that lowers the first-token sink most: {best['intervention']} ({best['description']}"
                f"): sink mass {base['sink_mass']:.3f} -> {best['sink_mass']:.3f}, loss {base['loss']:.3f} -> "
                f"{best['loss']:.3f}.")
    return out


def _sinks_section(heads: pd.DataFrame, record: dict) -> Section:
    shown = ["first", "delimiter"] + (["learned"] if heads["learned"].notna().any() else [])
    long = heads.melt(id_vars=["layer", "head"], value_vars=shown, var_name="kind", value_name="alpha")
    by_layer = heads.groupby("layer")[["first", "delimiter", "other", "learned"]].mean()
    by_layer = by_layer.dropna(axis=1, how="all")
    sinks = heads[heads["is_sink"]].groupby(["layer", "sink"]).size().unstack(fill_value=0)
    sinks = sinks.reindex(by_layer.index, fill_value=0).add_prefix("sink heads: ")
    table = by_layer.round(4).join(sinks).reset_index()
    return Section("sinks", "Sink mass by layer and head").add(
        "Each head's attention on the first token and on the first delimiter (the first newline, period, comma, "
        f"colon, ... token; {record['sequences_with_delimiter']} of {record['n_sequences']} sequences have one), "
        "and on the largest other key in the first half of the sequence: means per layer, and how many heads per "
        f"layer have each as their sink (above {record['epsilon']:g}).",
        png(plot_head_scores(long, "alpha", facet="kind", vmin=0, vmax=1, annotate=False), "sink_mass_heads.png"),
        table)


def _massive_section(massive: pd.DataFrame, m: SinksMeasured, record: dict) -> Section:
    crit = record["massive_criterion"]
    per_kind = massive.groupby(["layer", "kind"], as_index=False)["magnitude"].max()
    shown = massive.assign(token=massive["token"].map(repr))  # a newline token shown as '\n'
    top = shown[shown["rank"] == 0][["layer", "dim", "kind", "token", "value", "median", "ratio", "massive"]]
    where = "; ".join(f"{', '.join(map(str, d))} after layer {l}" for l, d in m.massive.items())
    zeroed = (f"The first token's massive dimensions, by the layer where each appears: {where}" if m.massive_found else
              f"No first-token activation meets the criterion; its largest relative to the median: {where}") + (
        " (the massive_dims and massive_held interventions zero these).")
    return Section("massive", "Massive activations").add(
        "The largest |activation| of the residual stream after each layer (Sun et al. 2024), one per dimension and "
        f"token kind; massive: |a| > {crit['min']:g} and at least {crit['ratio']:g} x the layer's median |a|. "
        + zeroed,
        png(plot_by_layer(per_kind, "magnitude", "kind", "largest |activation|", logy=True), "massive_by_layer.png"),
        "The largest per layer:", top.round(3),
        "Every row marked massive (the first 40):", shown[shown["massive"]].round(3).head(40))


def _interventions_section(runs: pd.DataFrame, layers: pd.DataFrame, same_first: bool) -> Section:
    same = (" Every sequence starts with the same token, so its mean key direction is its key's own: key_direction "
            "sets the first token's key to zero in every layer." if same_first else "")
    return Section("interventions", "What makes the first token a sink").add(
        "Each intervention beside the unmodified model (none): the first-token sink mass (mean over heads), the "
        "first-delimiter sink mass, the share of heads above the threshold, and the loss." + same,
        runs.round(4),
        png(plot_by_layer(layers, "sink_mass", "intervention", "first-token sink mass (mean over heads)"),
            "interventions_by_layer.png"))


# ---- the sink levels ---------------------------------------------------------------------------------------------
def _site_label(row) -> str:
    if row["site"] == "first":
        return "first token" + (f" {row['token']!r}" if row["token"] else "")
    return repr(row["token"])


def _maker(row) -> str:
    if row["component"] == "embedding":
        return "made by the embedding"
    verb = "removed by zeroing" if row["removes"] else "lowered most by zeroing"
    return f"{verb} {row['component']}: {row['mass_without']:.2f}"


def _levels_record(levels: pd.DataFrame) -> dict:
    traced = levels[levels["traced"]]
    return {"n_sites": len(levels), "n_levels": n_levels(levels),
            "traced": [dict(site=r["site"], token=r["token"], level=int(r["level"]), component=r["component"],
                            mass_at_level=round(float(r["mass_at_level"]), 4),
                            mass_without=None if pd.isna(r["mass_without"]) else round(float(r["mass_without"]), 4))
                       for _, r in traced.iterrows()]}


def _levels_headline(levels: pd.DataFrame, eps: float) -> str:
    """One line: how many sink levels, and each traced site's token, level and maker."""
    if not len(levels):
        return f"Sink levels: none (no position draws {eps:g} of any head's attention past it)."
    traced = levels[levels["traced"]].sort_values("level")
    said = "; ".join(f"{_site_label(r)} at layer {r['level']} (mass {r['mass_at_level']:.2f}, " + _maker(r) + ")"
                     for _, r in traced.iterrows())
    return (f"Sink levels: {n_levels(levels)} (layers {', '.join(map(str, sorted(levels['level'].unique())))}) over "
            f"{len(levels)} sink site(s); " + said + ".")


def _levels_section(levels: pd.DataFrame, layers: pd.DataFrame, ablations: pd.DataFrame, record: dict) -> Section:
    out = Section("levels", "Sink levels").add(
        "Every position that draws a sink's mass in some layer (`analyses/src/sink_origins/levels.py`): key k is a "
        f"sink at layer l when some head of l puts at least {record['epsilon']:g} of its attention on it, averaged "
        "over the queries at least 4 tokens past it. Positions are grouped by the token they hold (position 0: the "
        "first token); a site's mass is the mean over its positions of the largest head's alpha, its level the "
        "first layer where that mass reaches the threshold. What makes it: each attention layer and MLP before "
        "the level, its output zeroed at the site's positions only; the one that lowers the mass at the level "
        "most (removes: below the threshold).")
    if not len(levels):
        return out.add("No sink site.")
    shown = levels.assign(token=levels["token"].map(repr))
    out.add(shown.drop(columns=["token_id"]).round(3).head(30))
    traced = levels[levels["traced"]]
    names = dict(zip(traced["site"], [f"{_site_label(r)} (L{r['level']})" for _, r in traced.iterrows()]))
    part = layers[layers["site"].isin(names)].assign(site=lambda f: f["site"].map(names))
    out.add(png(plot_by_layer(part, "mass", "site", "sink mass (mean over positions, largest head)"),
                "sink_levels_by_layer.png"))
    if len(ablations):
        out.add("Each component before a traced site's level, zeroed at its positions: its mass at the level.",
                ablations.round(4))
    return out


__all__ = ["SinksMeasured", "SinksSettings", "SinksStudy", "heads_table", "massive_table", "run_tables"]
