"""The features study's report: a summary, what each head moves (a heads x top-features table and a heatmap of
the shown features' attribution shares), the offline feature view, the logit effects, the settings."""

from __future__ import annotations

import json

import pandas as pd

from ..document import Html, Section, head_name, md_escape, png
from .contexts import context_text
from .logits import LOGIT_COLUMNS
from .view import feature_view

PER_HEAD = 5  # features named per head in the report's table


def report_sections(s, m, record: dict) -> list[Section]:
    out = [_summary(s, m, record)]
    if m.site.heads:
        out.append(_heads_section(m))
    out += [_view_section(s, m), _logits_section(m),
            Section("settings", "Settings").add("```\n" + json.dumps(record, indent=2) + "\n```")]
    return out


def _summary(s, m, record: dict) -> Section:
    c, summary = m.sae_cfg, m["features"]
    alive = summary[summary["n_active"] > 0]
    out = Section("summary", "Summary").add(
        f"{md_escape(s.model)} with the {c.architecture} SAE {md_escape(s.sae)} on {md_escape(c.hook_name)} "
        f"({c.d_sae:,} features of {c.d_in} inputs): {record['n_sequences']} sequence(s) of {record['seq_len']} "
        f"tokens. {len(alive):,} features are active (activation > 0) somewhere; the median active one fires on "
        f"{(alive['frequency'].median() if len(alive) else 0):.2%} of tokens.")
    if not m.site.heads:
        return out.add(f"{md_escape(c.hook_name)} is not split by head: the head tables (decoder norms, attribution, "
                       "top features per head) need an attention-output SAE on blocks.L.attn.hook_z. Contexts and "
                       "logit effects below.")
    largest, of = m.residual
    tops = summary[summary["n_active"] > 0]["top_head"].value_counts().sort_index()
    return out.add(
        "Direct feature attribution (Kissane et al. 2024): each active feature's pre-activation, summed over the "
        "positions where it is active, splits into one term per head plus a constant; here the terms add up to it "
        f"within {largest:.3g} (the largest summed pre-activation is {of:.3g}).",
        "Active features by their top head (the largest share of the decoder row's squared norm): " + ", ".join(
            f"{head_name(m.site.layer, h)} {n}" for h, n in tops.items()) + ".")


def _heads_section(m) -> Section:
    top = m["head_features"]
    cells = top[top["rank"] < PER_HEAD].assign(cell=lambda t: [
        f"f{f} ({sh:.0%})" for f, sh in zip(t["feature"], t["share"])])
    table = cells.pivot_table(index=["layer", "head", "by"], columns="rank", values="cell", aggfunc="first")
    table.columns = [f"#{r + 1}" for r in table.columns]
    table = table.reset_index()
    table.insert(0, "head", [head_name(l, h) for l, h in zip(table.pop("layer"), table.pop("head"))])
    return Section("heads", "What each head moves").add(
        f"Each head's top {PER_HEAD} features, by direct attribution (summed over the positions where the feature is "
        "active; the share is the head's |attribution| over the feature's sum across heads) and by decoder-norm "
        "share (the share of the decoder row's squared norm on the head's d_head slice, Kissane et al.'s "
        "weight-based head attribution).",
        table, png(shares_heatmap(m["attribution"], m.shown), "head_shares.png",
                   "each shown feature's attribution share by head"))


def shares_heatmap(attribution: pd.DataFrame, shown: list[int]):
    """Heads (rows) x the shown features (columns), coloured by the head's share of the feature's attribution."""
    from matplotlib.figure import Figure

    part = attribution[attribution["feature"].isin(shown)]
    if part.empty:
        return None
    grid = part.pivot_table(index=["layer", "head"], columns="feature", values="share").reindex(columns=shown)
    fig = Figure(figsize=(max(4.0, 0.45 * len(shown) + 2), max(2.0, 0.35 * len(grid) + 1.2)))
    ax = fig.subplots()
    im = ax.imshow(grid.to_numpy(), aspect="auto", vmin=0, vmax=1, cmap="viridis")
    ax.set_yticks(range(len(grid)), [head_name(l, h) for l, h in grid.index])
    ax.set_xticks(range(len(shown)), [str(f) for f in shown], rotation=90)
    ax.set_xlabel("feature")
    fig.colorbar(im, ax=ax, label="share of |attribution|")
    fig.tight_layout()
    return fig


def _logits(m) -> pd.DataFrame:
    """The logit effects, or no rows (a wrapped model has no weight views to read them from)."""
    found = m.get("logit_effects")
    return found if found is not None else pd.DataFrame(columns=list(LOGIT_COLUMNS))


def _view_section(s, m) -> Section:
    heads = m.tables.get("attribution")
    view = feature_view(m.shown, m["features"], m["contexts"], _logits(m), m.strings, heads=heads,
                        title=f"{len(m.shown)} features of {m.sae_cfg.hook_name}")
    texts = context_text(m["contexts"][m["contexts"]["feature"].isin(m.shown)], m.strings)
    first = texts[texts["rank"] == 0].assign(context=lambda t: t["before"] + "[" + t["token_text"] + "]" + t["after"])
    return Section("view", "The features").add(
        f"The {len(m.shown)} features shown (each head's top features by attribution in turn, or the largest total "
        f"activation), each with its {s.top_k} max-activating contexts over the text: a window of "
        f"{s.window[0]} tokens before and {s.window[1]} after, every token shaded by the feature's activation there.",
        Html(view.fragment, markdown="(interactive: open report.html) Each shown feature's strongest context, "
                                     "its token in brackets:"),
        first[["feature", "activation", "document", "position", "context"]].round(4))


def _logits_section(m) -> Section:
    out = Section("logits", "Direct effect on the logits")
    if m.get("logit_effects") is None:
        return out.add("Not measured: the model is wrapped (transformers runs it), and the logit effect reads interp's "
                       "weight views (W_O, W_U), which only native models have.")
    effects = m["logit_effects"]
    part = effects[effects["feature"].isin(m.shown)]
    rows = []
    for f in m.shown:
        one = part[part["feature"] == f]
        line = lambda d: ", ".join(f"{t!r} {v:+.2f}" for t, v in zip(  # noqa: E731
            one[one["direction"] == d]["token_text"], one[one["direction"] == d]["effect"]))
        rows.append(dict(feature=f, raises=line("top"), lowers=line("bottom")))
    return out.add(
        "Each shown feature's decoder row written into the residual stream (through each head's W_O for an "
        "attention-output SAE) and read by the unembedding, through the final norm's linear part with its scale "
        "frozen: the tokens it raises and lowers most.", pd.DataFrame(rows, columns=["feature", "raises", "lowers"]))


__all__ = ["report_sections", "shares_heatmap"]
