"""The report of a sweep folder: `report.html` (self-contained, opens offline) and `report.md` (the
same sections; PNGs in `figures/`).

Sections, in order (HTML ids in brackets): summary [summary], errors and skipped checkpoints
[errors], head scores at the last checkpoint [heatmaps], then the sections each registered analysis
declares (`analyses/src/atlas/registry/`, in registration order): first those across checkpoints (`across`:
induction's small multiples [small-multiples] and curves against training step with the phase
change [curves]), then their own (sinks, ablation, pruning, attribution, ...), and settings
[settings]. This module knows no analysis by name: the head-score figure takes every metric
declared `heatmap`, the summary every `headline` metric plus the facts an analysis adds (`headline`:
induction's ICL score and phase change). Sections without data are left out: an analysis that was
not run, and the across-checkpoint sections of a single checkpoint (`interp analyze`), whose report
is titled "head atlas". With several runs, per-run sections repeat per run.

Only finite numbers reach a table, figure or sentence: a sweep never stores NaN or inf, and results
written before that rule (`load_results`, `ResultStore.errors`) are left out and listed as errors.
Run and checkpoint names are escaped where they enter Markdown (`md_escape`).
"""

from __future__ import annotations

import json
import time
import warnings
from pathlib import Path

import pandas as pd

from .. import plots
from ..document import Section, head_name, md_escape, write_document
from .registry import ANALYSES, RunView, metrics
from .registry.induction import phase_change  # noqa: F401 - public here since the report first computed it
from ..store import PartialResults, ResultStore, slug, load_results
from .fingerprints import analyse, findings, kept
from ..data import source_line
from interp.models.rope.choice import describe

_FIXED_HEAD = (("summary", "Summary"), ("errors", "Errors and skipped checkpoints"), ("integrity", "Checkpoint integrity"))
_HEATMAPS = ("heatmaps", "Head scores at the last checkpoint")
SECTION_IDS = tuple([i for i, _ in _FIXED_HEAD] + [_HEATMAPS[0]]
                    + [s.id for a in ANALYSES.values() for s in a.across]
                    + [a.section.id for a in ANALYSES.values() if a.section] + ["settings"])


# ---- numbers the report derives ----------------------------------------------------------------
def _last(table: pd.DataFrame) -> pd.DataFrame:
    """Rows of the last checkpoint (by step) that has them, per metric."""
    if table.empty:
        return table
    order = table.assign(_k=table["step"].fillna(-1))
    return order[order["_k"] == order.groupby("metric")["_k"].transform("max")].drop(columns="_k")


def _top_head(last: pd.DataFrame, metric: str, final_step=None) -> str | None:
    """The best head of `metric` and its score; "at step N" when that is not the run's last step (the
    metric failed at the later checkpoints)."""
    m = last[(last["metric"] == metric) & last["layer"].notna()]
    if m.empty:
        return None
    r = m.loc[m["value"].idxmax()]
    earlier = pd.notna(r["step"]) and pd.notna(final_step) and r["step"] != final_step
    return f"{head_name(r['layer'], r['head'])} ({r['value']:.3f})" + (f" at step {int(r['step'])}" if earlier else "")


def _ranked(last: pd.DataFrame, names: list[str], top: int = 10) -> pd.DataFrame | None:
    """The `top` heads per metric, named L{layer}H{head} with their score, one column per metric."""
    cols = {}
    for m in names:
        part = last[(last["metric"] == m) & last["layer"].notna()].nlargest(top, "value")
        cols[m] = [f"{head_name(r.layer, r.head)} ({r.value:.3f})" for r in part.itertuples()]
    if not cols:
        return None
    n = max(len(c) for c in cols.values())
    return pd.DataFrame({"rank": range(1, n + 1), **{m: c + [""] * (n - len(c)) for m, c in cols.items()}})


def run_view(table: pd.DataFrame, run: str, several: bool, settings: dict, log_steps: bool = False,
             extras: list[dict] = ()) -> RunView:
    """What a report section sees of one run of a results table (`RunView`): its rows, the last
    checkpoint's extras per analysis, and the settings; `interp.view` draws sections from it too."""
    t = table[table["run"] == run]
    latest: dict = {}
    for e in sorted((e for e in extras if e["run"] == run), key=lambda e: -1 if e["step"] is None else e["step"]):
        latest[e["analysis"]] = e["extra"]  # the last checkpoint's wins
    last = _last(t)
    step = last["step"].dropna() if len(last) else pd.Series(dtype=float)
    return RunView(run, t, last, settings, f"{md_escape(run)}: " if several else "", slug(run),
                   f"step {int(step.max())}" if len(step) else "the last checkpoint", log_steps, latest)


# ---- sections ----------------------------------------------------------------------------------
def build_sections(out, log_steps: bool = False) -> tuple[str, list[Section]]:
    out = Path(out)
    store = ResultStore(out)
    settings = store.read_json("settings.json")
    if settings is None:
        raise FileNotFoundError(f"{out} is not a sweep folder (no settings.json): run `interp sweep ... --out {out}` first")
    table = _results(out)
    errors = store.errors()
    timing = store.read_json("timing.json", {"invocations": []})
    analyses = settings.get("analyses", [])
    runs = list(settings.get("runs", {})) or sorted(table["run"].dropna().unique())
    extras = store.extras()
    views = [run_view(table, run, len(runs) > 1, settings, log_steps, extras) for run in runs]
    single = all(len(settings.get("runs", {}).get(r, {}).get("checkpoints", [])) <= 1 for r in runs) and \
        table.groupby("run")["checkpoint"].nunique().le(1).all()
    sections = [_summary(settings, table, errors, timing, store, views), _errors(errors), _integrity(store, settings)]
    heatmaps = Section(*_HEATMAPS)
    ran = [a for a in ANALYSES.values() if a.name in analyses]
    across = [] if single else [(s, Section(s.id, s.title)) for a in ran for s in a.across]
    own = [(a.section, Section(a.section.id, a.section.title)) for a in ran if a.section]
    for v in views:
        _heatmaps(heatmaps, v, analyses)
        for spec, section in across + own:
            section.add(*spec.render(v))
    sections += [heatmaps] + [section for _, section in across + own]
    sections.append(Section("settings", "Settings").add(
        "The settings every result in this folder was computed with (`settings.json`).",
        "```\n" + json.dumps(settings, indent=2) + "\n```"))
    return f"{'head atlas' if single else 'interp sweep'}: {', '.join(runs)}", sections


def _compute_line(compute: dict | None) -> str:
    """Where the results were computed and with which statistics kernel (settings.json's `compute`)."""
    if not compute:
        return ""
    return (f" Computed on {md_escape(compute['device'])} ({md_escape(compute.get('device_name', ''))}, "
            f"{compute.get('threads')} threads); streaming statistics kernel: {compute.get('stats_backend')}.")


def _data_line(settings: dict) -> str:
    """The data every number here was computed on, by name and sha256 (settings.json's `data_source`)."""
    if "data_source" not in settings:
        return "Data source: not recorded (a folder from before interp named its data by sha256). "
    return md_escape(source_line(settings["data_source"])) + " "


def _rope_line(settings: dict) -> str:
    """The RoPE scaling the models ran with when one was chosen (settings.json's `rope_scaling`, settled per run
    in `runs`), in one sentence, or per run where their original lengths differ."""
    if settings.get("rope_scaling") is None:
        return ""
    runs = {run: info["rope_scaling"] for run, info in settings.get("runs", {}).items()
            if isinstance(info, dict) and info.get("rope_scaling")}
    said = {json.dumps(d, sort_keys=True) for d in runs.values()}
    if len(said) > 1:
        return "".join(f" {md_escape(run)}: {describe(d)}" for run, d in runs.items())
    return " " + describe(next(iter(runs.values())) if runs else settings["rope_scaling"])


def _summary(settings, table, errors, timing, store, views: list[RunView]) -> Section:
    s = Section("summary", "Summary")
    if partial := table.attrs.get("partial"):
        s.add(f"**{partial.capitalize()}: this sweep did not complete** (killed, interrupted or still running), so "
              "nothing here is final: the table holds the checkpoints that finished. Rerun `interp sweep` with this "
              "--out to finish it; nothing finished is recomputed.")
    run_rows = []
    for v in views:
        run = v.run
        steps = v.table["step"].dropna()
        listed = settings.get("runs", {}).get(run, {})
        run_rows.append({"run": run, "source": listed.get("source", ""),
                         "checkpoints": len(listed.get("checkpoints", [])) or v.table["checkpoint"].nunique(),
                         "with results": v.table["checkpoint"].nunique(),
                         "steps": f"{int(steps.min())}..{int(steps.max())}" if len(steps) else ""})
    wall = sum(i["seconds"] for i in timing.get("invocations", []))
    compute = store.seconds()
    skipped = sorted({md_escape(f"{e['run']}/{e['checkpoint']}") for e in errors if e["analysis"] == "load"})
    expensive = [a for a in settings.get("analyses", []) if a in ANALYSES and ANALYSES[a].expensive]
    past = {run: info["extrapolated_past"] for run, info in settings.get("runs", {}).items()
            if isinstance(info, dict) and info.get("extrapolated_past")}
    extrapolated = "".join(f" EXTRAPOLATED: {md_escape(run)} was run on {settings['data']['seq_len']}-token sequences, "
                           f"past its trained context of {n:,} tokens (--extrapolate); its numbers describe a model "
                           "used beyond what it was trained on." for run, n in past.items())
    s.add(f"Analyses: {', '.join(settings.get('analyses', []))}. Data: {md_escape(settings.get('data_description', ''))}."
          + extrapolated + _rope_line(settings)
          + (f" {', '.join(expensive).capitalize()} ran on "
             f"{'every checkpoint' if settings.get('expensive_on') == 'all' else 'the last checkpoint of each run'}."
             if expensive else "") + _compute_line(settings.get("compute")),
          pd.DataFrame(run_rows),
          f"Errors: {len(errors)}" + (f"; checkpoints skipped (could not be loaded): {', '.join(skipped)}" if skipped else "")
          + f". Time taken: {wall:.1f} s wall over {len(timing.get('invocations', []))} sweep invocation(s), "
          f"{compute['seconds'].sum():.1f} s of analysis compute. Results: {len(table)} rows in results.parquet / results.csv.")
    if not compute.empty:
        s.add(compute.groupby("analysis", as_index=False)
              .agg(tasks=("seconds", "size"), seconds=("seconds", "sum"), per_task=("seconds", "mean")).round(2))
    for line in _headlines(views, markdown=True, partial=table.attrs.get("partial")):
        s.add(line)
    for line in integrity_lines(store.out, settings):
        s.add(f"**{md_escape(line)}** (see Checkpoint integrity)")
    for v in views:
        windows = settings.get("runs", {}).get(v.run, {}).get("layer_windows")
        line = _layer_kinds(v, windows)
        if line:
            s.add(line, _layer_kind_table(v, windows))
    missing = [a for a in ANALYSES if a not in settings.get("analyses", []) and ANALYSES[a].section]
    if missing:
        s.add("Not run here (add to --analyses): " + ", ".join(f"`{a}`" for a in missing) + ".")
    s.add(_data_line(settings) + f"Versions: {', '.join(f'{k} {v}' for k, v in settings.get('versions', {}).items())}. "
          f"Report written {time.strftime('%Y-%m-%d %H:%M:%S')}.")
    return s


def _layer_kinds(v: RunView, windows: list | None, top: int = 10) -> str | None:
    """Where a model with local (sliding-window) and global layers keeps its heads: for each headline
    metric, how many of its top heads sit in each kind of layer (read off `_layer_kind_table`)."""
    table = _layer_kind_table(v, windows, top) if windows else None
    if table is None:
        return None
    local = [l for l, w in enumerate(windows) if w is not None]
    glob = [l for l, w in enumerate(windows) if w is None]
    sizes = sorted({w for w in windows if w is not None})
    counts = {(r.score, r.layers): r.count for r in table.rename(columns={f"in the top {top}": "count"}).itertuples()}
    parts = [f"{m} {counts.get((m, 'local'), 0)} local, {counts.get((m, 'global'), 0)} global"
             for m in dict.fromkeys(table["score"]) if m != "sink_alpha"]
    if not parts:
        return None
    return (f"{md_escape(v.run)}: local layers (window {'/'.join(map(str, sizes))}) "
            f"{', '.join(map(str, local))}; global layers {', '.join(map(str, glob))}. Of the top {top} heads by "
            f"each score: " + "; ".join(parts) + f" ({len(local)} of {len(windows)} layers are local).")


def _layer_kind_table(v: RunView, windows: list, top: int = 10) -> pd.DataFrame | None:
    """Per headline score (and attention to the sink token), per kind of layer: how many of the top
    heads it holds, its best head and the mean score of its heads."""
    kinds = {l: ("local" if w is not None else "global") for l, w in enumerate(windows)}
    names = [m.name for m in metrics(lambda m: m.headline and m.per == "head")] + ["sink_alpha"]
    rows = []
    for m in names:
        part = v.last[(v.last["metric"] == m) & v.last["layer"].notna() & v.last["head"].notna()]
        if part.empty:
            continue
        part = part.assign(kind=[kinds.get(int(l), "?") for l in part["layer"]])
        best = set(part.nlargest(top, "value").index)
        for kind in ("local", "global"):
            k = part[part["kind"] == kind]
            if k.empty:
                continue
            b = k.loc[k["value"].idxmax()]
            rows.append({"score": m, "layers": kind, "heads": len(k), f"in the top {top}": len(best & set(k.index)),
                         "best head": f"L{int(b['layer'])}H{int(b['head'])} ({b['value']:.3f})",
                         "mean": round(float(k["value"].mean()), 4)})
    return pd.DataFrame(rows) if rows else None


def _headlines(views: list[RunView], markdown: bool = False, partial: str | None = None) -> list[str]:
    """One sentence per run with its headline facts (best heads, ICL score, phase change); plain text,
    or a Markdown paragraph (the run's name escaped). A sweep that did not complete says so first, and
    never calls its last finished checkpoint the last one."""
    headline = [m.name for m in metrics(lambda m: m.headline)]
    lines = []
    for v in views:
        final = v.table["step"].max() if len(v.table) else None
        facts = [f"{m} {h}" for m in headline if (h := _top_head(v.last, m, final))]
        for analysis in ANALYSES.values():  # facts an analysis adds (induction: the ICL score, the phase change)
            if analysis.headline is not None:
                facts += analysis.headline(v)
        if facts:
            name = md_escape(v.run) if markdown else v.run
            at = (f" ({partial}, not final): best heads at the latest finished checkpoint: " if partial
                  else ": best heads at the last checkpoint: ")
            lines.append(f"{name}{at}" + "; ".join(facts) + ".")
    return lines


def headline(out) -> str:
    """The summary's headline sentences of a sweep folder, as the README quotes them
    (`interp report DIR --headline`)."""
    store = ResultStore(Path(out))
    settings = store.read_json("settings.json")
    if settings is None:
        raise FileNotFoundError(f"{out} is not a sweep folder (no settings.json)")
    table = _results(out)
    runs = list(settings.get("runs", {})) or sorted(table["run"].dropna().unique())
    return "\n".join(_headlines([run_view(table, r, len(runs) > 1, settings) for r in runs],
                                partial=table.attrs.get("partial")) + integrity_lines(out, settings))


def integrity_lines(out, settings: dict) -> list[str]:
    """`checkpoint integrity: ...`, one line per finding of the folder's trusted fingerprints (`fingerprints`):
    the headline's and the summary's, beside the curves they call into doubt."""
    return [f"checkpoint integrity: {line}" for line in findings(kept(out, settings.get("runs"), check_files=True).prints)]


def _results(out) -> pd.DataFrame:
    """`load_results`, whose partial note (`table.attrs["partial"]`) the report says itself."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PartialResults)
        return load_results(out)


def _integrity(store: ResultStore, settings: dict) -> Section:
    """Whether the checkpoints are what their steps say (`fingerprints`): identical weights, near-copies and
    which of them are the copies, steps out of place; and the fingerprint files that were not used, and why."""
    s = Section("integrity", "Checkpoint integrity")
    judged = kept(store.out, settings.get("runs"), check_files=True)
    notes = judged.notes()
    if not judged.prints and not notes:
        return s.add("No fingerprints: these checkpoints were analysed before interp kept them (a sweep keeps one "
                     "for each checkpoint it loads).")
    found = findings(judged.prints)
    s.add(*(f"**{md_escape(line)}**" for line in found) if found else
          [("Every checkpoint's" if not notes else "Of the fingerprints used here, every checkpoint's") + " weights "
           "differ from the others', none is a near-copy of another, and each one's distance to the final weights "
           "falls with its step as training goes."] if judged.prints else [])
    s.add(*(md_escape(line) for line in notes))
    to_final = {(r["run"], c): v for r in analyse(judged.prints) for c, v in r["to_final"].items()}
    frame = pd.DataFrame([{"run": p["run"], "checkpoint": p["checkpoint"], "step": p["step"],
                           "weights": p["weights"][:12],
                           "to the final": (f"{to_final[k]:.4g}" if (k := (p["run"], p["checkpoint"])) in to_final
                                            else "not compared")}
                          for p in sorted(judged.prints, key=lambda p: (p["run"], p["step"] is None, p["step"] or 0))])
    return s.add("Fingerprints (a hash over every tensor's bytes, and the distance of the weights to the run's last "
                 "genuine checkpoint's, from a count sketch of every value; taken as the sweep loaded the checkpoint; "
                 "fingerprints.csv):", frame)


def _errors(errors: list[dict]) -> Section:
    s = Section("errors", "Errors and skipped checkpoints")
    if not errors:
        return s.add("None: every checkpoint loaded and every analysis finished.")
    frame = pd.DataFrame(errors)[["run", "checkpoint", "analysis", "error", "message", "path"]]
    frame["message"] = frame["message"].map(lambda m: m.splitlines()[0][:300])
    return s.add("These were skipped (analysis `load`: the checkpoint itself could not be read, so none of its "
                 "analyses ran). A later `interp sweep` with the same --out retries them.", frame)


def _heatmaps(section: Section, v: RunView, analyses: list) -> None:
    """The head-score heatmaps, built from every metric declared `heatmap`."""
    heat = [m for m in metrics(lambda m: m.heatmap and m.per == "head", analyses) if m.name in set(v.last["metric"])]
    described = [a for a in analyses if a in ANALYSES and any(m in ANALYSES[a].metrics for m in heat)]
    section.add(
        f"{v.prefix}Layers (rows) x heads (columns) at {v.where}. "
        + " ".join(f"{a}: {ANALYSES[a].description}." for a in described)
        if heat else f"{v.prefix}No head scores: run previous_token, duplicate_token, induction or sinks (or see Errors).",
        _ranked(v.last, [m.name for m in heat]) if heat else None,
        v.figure(plots.head_heatmaps(v.last, [m.name for m in heat], f"{v.run} at {v.where}",
                                     {m.name: m.label or m.name for m in heat}), "heatmaps") if heat else None)



def write_report(out, title: str | None = None, log_steps: bool = False) -> Path:
    """Write `out/report.html`, `out/report.md` and `out/figures/*.png`; return the HTML path.
    `log_steps`: training-step axes on a symmetric-log scale (default linear). The files are claimed
    in the folder's manifest first, under its lock (a sweep still writing there is refused)."""
    default_title, sections = build_sections(out, log_steps)
    store = ResultStore(out)
    with store.writing():
        return write_document(out, title or default_title, sections, folder=store.folder)
