"""The report of a sweep folder: `report.html` (self-contained: PNGs inlined as base64, no external
assets, opens offline) and `report.md` (the same sections; PNGs in `figures/`).

Sections, in order (HTML ids in brackets): summary [summary], errors and skipped checkpoints
[errors], head scores at the last checkpoint [heatmaps], induction across checkpoints
[small-multiples], scores against training step with the phase change marked [curves], attention
sinks [sinks], head ablation [ablation], pruning [pruning], attribution vs exact ablation
[attribution], settings [settings]. A section whose analysis was not run says so, rather than
vanishing, so every report has the same shape. With several runs, the per-run sections repeat per run.

Phase change (`phase_change`): over consecutive checkpoints, the step interval where the maximum
induction score (Olsson et al.'s, on repeated random tokens) of heads outside layer 0 rises fastest
per training step (layer 0 cannot form an induction head with a previous-token head below it).
"""

from __future__ import annotations

import base64
import html
import io
import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from . import plots
from .registry import ANALYSES
from .store import ResultStore, load_results

HEAD_METRICS = ["previous_token", "duplicate_token", "induction", "induction_score", "sink_alpha"]
CURVE_METRICS = ["previous_token", "duplicate_token", "induction_score"]
SECTION_IDS = ("summary", "errors", "heatmaps", "small-multiples", "curves", "sinks", "ablation", "pruning",
               "attribution", "settings")


@dataclass
class Image:
    name: str  # file name under figures/
    png: bytes
    caption: str = ""


@dataclass
class Section:
    id: str
    title: str
    blocks: list = field(default_factory=list)  # str (a paragraph), pd.DataFrame (a table), Image

    def add(self, *blocks) -> "Section":
        self.blocks.extend(b for b in blocks if b is not None)
        return self


# ---- numbers the report derives ----------------------------------------------------------------
def phase_change(table: pd.DataFrame) -> dict | None:
    """The steepest rise of the max induction score outside layer 0 between consecutive checkpoints."""
    ind = table[(table["metric"] == "induction_score") & table["layer"].notna() & table["step"].notna()]
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


def _per_model(table: pd.DataFrame, metric: str) -> pd.DataFrame:
    return table[(table["metric"] == metric) & table["layer"].isna()].sort_values("step")


def _last(table: pd.DataFrame) -> pd.DataFrame:
    """Rows of the last checkpoint (by step) that has them, per metric."""
    if table.empty:
        return table
    order = table.assign(_k=table["step"].fillna(-1))
    return order[order["_k"] == order.groupby("metric")["_k"].transform("max")].drop(columns="_k")


def _top_head(last: pd.DataFrame, metric: str) -> str | None:
    m = last[(last["metric"] == metric) & last["layer"].notna()]
    if m.empty:
        return None
    r = m.loc[m["value"].idxmax()]
    return f"L{r['layer']}H{r['head']} ({r['value']:.3f})"


def _png(fig, name: str, caption: str = "") -> Image | None:
    if fig is None:
        return None
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90)
    import matplotlib.pyplot as plt

    plt.close(fig)  # figures from pyplot (plot_head_scores) must be released; harmless for the others
    return Image(name, buf.getvalue(), caption)


def _not_run(analysis: str) -> str:
    return f"Not run in this sweep: add `{analysis}` to `--analyses`."


# ---- sections ----------------------------------------------------------------------------------
def build_sections(out) -> tuple[str, list[Section]]:
    out = Path(out)
    store = ResultStore(out)
    settings = store.read_json("settings.json")
    if settings is None:
        raise FileNotFoundError(f"{out} is not a sweep folder (no settings.json): run `interp sweep ... --out {out}` first")
    table = load_results(out)
    errors = store.errors()
    timing = store.read_json("timing.json", {"invocations": []})
    analyses = settings.get("analyses", [])
    runs = list(settings.get("runs", {})) or sorted(table["run"].dropna().unique())
    title = f"interp sweep: {', '.join(runs)}"
    sections = [_summary(settings, table, errors, timing, store, runs), _errors(errors)]
    per_run = {sid: Section(sid, t) for sid, t in [
        ("heatmaps", "Head scores at the last checkpoint"), ("small-multiples", "Induction heads across checkpoints"),
        ("curves", "Scores against training step"), ("sinks", "Attention sinks"), ("ablation", "Head ablation"),
        ("pruning", "Pruning curve"), ("attribution", "Attribution patching vs exact ablation")]}
    for run in runs:
        t = table[table["run"] == run]
        prefix = f"{run}: " if len(runs) > 1 else ""
        _run_sections(per_run, t, run, prefix, analyses, settings)
    sections += list(per_run.values())
    sections.append(Section("settings", "Settings").add(
        "The settings every result in this folder was computed with (`settings.json`).",
        "```\n" + json.dumps(settings, indent=2) + "\n```"))
    return title, sections


def _summary(settings, table, errors, timing, store, runs) -> Section:
    s = Section("summary", "Summary")
    run_rows = []
    for run in runs:
        t = table[table["run"] == run]
        steps = t["step"].dropna()
        listed = settings.get("runs", {}).get(run, {})
        run_rows.append({"run": run, "source": listed.get("source", ""),
                         "checkpoints": len(listed.get("checkpoints", [])) or t["checkpoint"].nunique(),
                         "with results": t["checkpoint"].nunique(),
                         "steps": f"{int(steps.min())}..{int(steps.max())}" if len(steps) else ""})
    wall = sum(i["seconds"] for i in timing.get("invocations", []))
    compute = store.seconds()
    skipped = sorted({f"{e['run']}/{e['checkpoint']}" for e in errors if e["analysis"] == "load"})
    s.add(f"Analyses: {', '.join(settings.get('analyses', []))}. Data: {settings.get('data_description', '')}. "
          f"Ablation, pruning and importance ran on {'every checkpoint' if settings.get('expensive_on') == 'all' else 'the last checkpoint of each run'}.",
          pd.DataFrame(run_rows),
          f"Errors: {len(errors)}" + (f"; checkpoints skipped (could not be loaded): {', '.join(skipped)}" if skipped else "")
          + f". Time taken: {wall:.1f} s wall over {len(timing.get('invocations', []))} sweep invocation(s), "
          f"{compute['seconds'].sum():.1f} s of analysis compute. Results: {len(table)} rows in results.parquet / results.csv.")
    if not compute.empty:
        s.add(compute.groupby("analysis", as_index=False)
              .agg(tasks=("seconds", "size"), seconds=("seconds", "sum"), per_task=("seconds", "mean")).round(2))
    for run in runs:
        t = table[table["run"] == run]
        last = _last(t)
        facts = [f"{m} {h}" for m in ("induction_score", "previous_token", "duplicate_token") if (h := _top_head(last, m))]
        icl = _per_model(t, "icl_score")
        if not icl.empty:
            facts.append(f"ICL score {icl['value'].iloc[-1]:+.3f} at step {icl['step'].iloc[-1]}")
        phase = phase_change(t)
        if phase:
            facts.append(f"phase change between steps {phase['start']} and {phase['end']} "
                         f"(max induction score {phase['score_before']:.2f} -> {phase['score_after']:.2f})")
        if facts:
            s.add(f"{run}: best heads at the last checkpoint: " + "; ".join(facts) + ".")
    s.add(f"Versions: {', '.join(f'{k} {v}' for k, v in settings.get('versions', {}).items())}. "
          f"Report written {time.strftime('%Y-%m-%d %H:%M:%S')}.")
    return s


def _errors(errors: list[dict]) -> Section:
    s = Section("errors", "Errors and skipped checkpoints")
    if not errors:
        return s.add("None: every checkpoint loaded and every analysis finished.")
    frame = pd.DataFrame(errors)[["run", "checkpoint", "analysis", "error", "message", "path"]]
    frame["message"] = frame["message"].map(lambda m: m.splitlines()[0][:300])
    return s.add("These were skipped (analysis `load`: the checkpoint itself could not be read, so none of its "
                 "analyses ran). A later `interp sweep` with the same --out retries them.", frame)


def _run_sections(sec: dict, t: pd.DataFrame, run: str, prefix: str, analyses: list, settings: dict) -> None:
    last = _last(t)
    slug = run.replace("/", "_")
    desc = {a: ANALYSES[a].description for a in analyses if a in ANALYSES}
    heat = [m for m in HEAD_METRICS if m in set(last["metric"])]
    step = last["step"].dropna()
    where = f"step {int(step.max())}" if len(step) else "the last checkpoint"
    sec["heatmaps"].add(
        f"{prefix}Layers (rows) x heads (columns) at {where}. " + " ".join(f"{a}: {d}." for a, d in desc.items()
                                                                         if a in ("previous_token", "duplicate_token", "induction", "sinks"))
        if heat else f"{prefix}No head scores: run previous_token, duplicate_token, induction or sinks (or see Errors).",
        _png(plots.head_heatmaps(last, heat, f"{run} at {where}"), f"{slug}_heatmaps.png") if heat else None)

    fig = plots.small_multiples(t, "induction_score")
    sec["small-multiples"].add(
        f"{prefix}Olsson et al.'s induction score of every head at each checkpoint (shared colour scale)." if fig
        else f"{prefix}Needs the induction analysis on two or more checkpoints.",
        _png(fig, f"{slug}_induction_small_multiples.png"))

    phase = phase_change(t)
    fig = plots.best_head_curves(t, CURVE_METRICS, phase, _per_model(t, "icl_score"))
    text = (f"{prefix}Each line follows the head that scores highest at the last checkpoint. " +
            (f"Phase change (shaded): the max induction score ({phase['layers']}) rises fastest between steps "
             f"{phase['start']} and {phase['end']} ({phase['score_before']:.2f} -> {phase['score_after']:.2f}; "
             f"{phase['score_final']:.2f} at the end). The ICL score (loss at a late token minus loss at an early "
             "one; negative means the model learns in context) is in the lower panel." if phase else
             "No phase change found (needs the induction analysis on three or more checkpoints with a rising score)."))
    sec["curves"].add(text if fig else f"{prefix}Needs head scores on two or more checkpoints with steps.",
                      _png(fig, f"{slug}_curves.png"))

    if "sinks" not in analyses:
        sec["sinks"].add(_not_run("sinks"))
    else:
        rates = last[(last["metric"] == "sink_rate")]
        per_layer = rates[rates["layer"].notna()][["layer", "value"]].rename(columns={"value": "sink_rate"})
        overall = rates[rates["layer"].isna()]["value"]
        eps = settings.get("params", {}).get("sinks", {}).get("epsilon", 0.3)
        sec["sinks"].add(
            f"{prefix}Sink rate (Gu et al. 2024): the share of heads whose mean attention to token 0 exceeds "
            f"epsilon = {eps}, per layer at {where}" + (f"; over the model {float(overall.iloc[0]):.2f}." if len(overall) else "."),
            per_layer.reset_index(drop=True) if not per_layer.empty else None,
            _png(plots.sinks_per_layer(t), f"{slug}_sinks.png"))

    _ablation(sec["ablation"], last, prefix, slug, analyses, settings)
    if "pruning" not in analyses:
        sec["pruning"].add(_not_run("pruning"))
    else:
        p = settings.get("params", {}).get("pruning", {})
        fig = plots.pruning_curves(last)
        sec["pruning"].add(
            f"{prefix}Loss on the sweep data as heads are removed cumulatively ({p.get('method', 'zero')} replacement, "
            f"{p.get('step', 0.1):g} of the heads per step) at {where}: Michel et al.'s importance order "
            "(least important first, recomputed after every step) against a random order." if fig
            else f"{prefix}No pruning results (see Errors).", _png(fig, f"{slug}_pruning.png"))
    _attribution(sec["attribution"], t, last, prefix, slug, analyses)


def _ablation(s: Section, last: pd.DataFrame, prefix: str, slug: str, analyses: list, settings: dict) -> None:
    if "ablation" not in analyses:
        s.add(_not_run("ablation"))
        return
    deltas = last[last["metric"].str.startswith("delta_loss/") & last["layer"].notna()]
    if deltas.empty:
        s.add(f"{prefix}No ablation results (see Errors).")
        return
    wide = deltas.pivot_table(index=["layer", "head"], columns="metric", values="value").reset_index()
    wide.columns = [c.replace("delta_loss/", "delta ") for c in wide.columns]
    key = "delta mean" if "delta mean" in wide.columns else wide.columns[-1]
    top = wide.sort_values(key, ascending=False).head(10).round(4)
    clean = last[(last["metric"] == "clean_loss")]["value"]
    step = last["step"].dropna()
    s.add(f"{prefix}The 10 heads whose ablation raises the loss most at "
          f"{'step ' + str(int(step.max())) if len(step) else 'the last checkpoint'}"
          + (f" (clean loss {float(clean.iloc[0]):.4f})" if len(clean) else "")
          + ". Each head alone has its output z replaced: `mean` by its mean over the data's positions, `zero` by 0, "
          "`resample` by z at the same position of another sequence (a seeded derangement); delta = ablated loss - "
          f"clean loss, exact (one forward per ablation). Data: {settings.get('data_description', '')}.",
          top, _png(plots.head_heatmaps(deltas, sorted(set(deltas["metric"])), "loss increase when ablated"),
                    f"{slug}_ablation.png"))


def _attribution(s: Section, t: pd.DataFrame, last: pd.DataFrame, prefix: str, slug: str, analyses: list) -> None:
    if "importance" not in analyses:
        s.add(_not_run("importance"))
        return
    corr = t[t["metric"].isin(["attribution_pearson", "attribution_spearman"])]
    if corr.empty:
        s.add(f"{prefix}No importance results (see Errors).")
        return
    wide = corr.pivot_table(index=["checkpoint", "step"], columns="metric", values="value").reset_index()
    wide = wide.sort_values("step").round(4)
    s.add(f"{prefix}Attribution patching (a first-order estimate of each head's mean-ablation effect from one "
          "forward and backward pass) against the exact ablation sweep; Pearson and Spearman correlation over heads.",
          wide, _png(plots.attribution_scatter(last), f"{slug}_attribution.png"))


# ---- rendering ---------------------------------------------------------------------------------
_CSS = """body{font-family:system-ui,sans-serif;max-width:1100px;margin:2em auto;padding:0 1em;color:#222}
h1{font-size:1.6em}h2{border-bottom:1px solid #ddd;padding-bottom:.2em;margin-top:1.8em}
table{border-collapse:collapse;font-size:.85em;margin:.8em 0}td,th{border:1px solid #ccc;padding:.2em .5em;text-align:right}
th{background:#f3f3f3}img{max-width:100%;display:block;margin:.8em 0}pre{background:#f6f6f6;padding:.8em;overflow:auto;font-size:.8em}
nav a{margin-right:1em}"""


def _html_block(b) -> str:
    if isinstance(b, pd.DataFrame):
        return b.to_html(index=False, border=0, na_rep="", float_format=lambda x: f"{x:.4g}")
    if isinstance(b, Image):
        data = base64.b64encode(b.png).decode()
        return f'<img alt="{html.escape(b.name)}" src="data:image/png;base64,{data}">'
    if b.startswith("```"):
        return f"<pre>{html.escape(b.strip('`').strip())}</pre>"
    return f"<p>{html.escape(b)}</p>"


def render_html(title: str, sections: list[Section]) -> str:
    nav = "".join(f'<a href="#{s.id}">{html.escape(s.title)}</a>' for s in sections)
    body = "".join(f'<section id="{s.id}"><h2>{html.escape(s.title)}</h2>{"".join(_html_block(b) for b in s.blocks)}</section>'
                   for s in sections)
    return (f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>'
            f"<style>{_CSS}</style></head><body><h1>{html.escape(title)}</h1><nav>{nav}</nav>{body}</body></html>\n")


def _md_table(frame: pd.DataFrame) -> str:
    def cell(v) -> str:
        if v is None or (isinstance(v, float) and np.isnan(v)) or v is pd.NA:
            return ""
        return f"{v:.4g}" if isinstance(v, float) else str(v).replace("|", "\\|").replace("\n", " ")

    head = "| " + " | ".join(map(str, frame.columns)) + " |\n|" + "---|" * len(frame.columns) + "\n"
    return head + "".join("| " + " | ".join(cell(v) for v in row) + " |\n" for row in frame.itertuples(index=False))


def render_markdown(title: str, sections: list[Section]) -> str:
    parts = [f"# {title}\n"]
    for s in sections:
        parts.append(f"\n## {s.title}\n")
        for b in s.blocks:
            if isinstance(b, pd.DataFrame):
                parts.append("\n" + _md_table(b))
            elif isinstance(b, Image):
                parts.append(f"\n![{b.name}](figures/{b.name})\n")
            else:
                parts.append(f"\n{b}\n")
    return "".join(parts)


def write_report(out, title: str | None = None) -> Path:
    """Write `out/report.html`, `out/report.md` and `out/figures/*.png`; return the HTML path."""
    from .store import atomic_write_text

    out = Path(out)
    default_title, sections = build_sections(out)
    title = title or default_title
    figures = out / "figures"
    figures.mkdir(parents=True, exist_ok=True)
    for s in sections:
        for b in s.blocks:
            if isinstance(b, Image):
                (figures / b.name).write_bytes(b.png)
    atomic_write_text(out / "report.html", render_html(title, sections))
    atomic_write_text(out / "report.md", render_markdown(title, sections))
    return out / "report.html"
