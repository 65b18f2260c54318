"""Sweeps: chosen analyses over every checkpoint of one or more training runs, resumably.

    from interp.analyses.atlas.sweep import SweepSettings, sweep
    result = sweep(["attn-only-2l"], "out/attn-only-2l")
    result.table    # run, checkpoint, step, analysis, layer, head, metric, value

The unit of work and of resumption is one (checkpoint, analysis) pair; the unit of scheduling is
one checkpoint with all its pending analyses (`CheckpointTask`), so a worker loads each model once.
Each finished pair is written as its own small file the moment it arrives (`ResultStore`), and the
parts are merged into `results.parquet`/`results.csv` as checkpoints finish and at the end. A
sweep killed at any point and started again with the same settings recomputes nothing finished.

A finished part stands only while its checkpoint holds the weights it was computed from. Each checkpoint's
fingerprint (`fingerprints`) is kept with a stamp of its files; a resumed sweep loads again a checkpoint whose
files changed since (or whose fingerprint is missing or malformed), and one whose weights are not those its parts
were computed from has them recomputed, said in one line per checkpoint.

A checkpoint that fails to load (truncated or corrupt weights), an analysis that raises, or one
whose numbers are not all finite (NaN or inf is an error, never a result) is recorded in
`errors.json`, shown in the summary and the report, and skipped; the sweep goes on, and a later
sweep retries it.

The output folder is checked before anything is loaded (`OutputFolder`): a file, a folder that
cannot be written, a non-empty folder interp did not create, or one another sweep is writing to is
refused in one line; interp writes and, with `force`, removes only the files it created there.
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import json
import os
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Literal, Sequence

import pandas as pd
import torch

from .._common import auto_tqdm
from .executors import ExecutorSettings, make_executor
from .fingerprints import Kept, checkpoints_of, files_stamp, findings, fingerprint, kept
from .registry import ANALYSES, Context, as_output, resolve_analyses
from .report import write_report
from interp.models.formats import checkpoint  # checkpoint.load_checkpoint looked up at call time: tests monkeypatch it
from interp.models.formats.checkpoint import CheckpointError, check_placement, is_wrapped, read_config, rope_scaling_for
from interp.models.placement.choice import Placement
from interp.models.placement.device import compute_record
from interp.models.rope.choice import as_hf, choose, rope_spec
from interp.models.formats.folder import refuse_code_in
from interp.models.runs.names import resolve_run
from interp.models.runs.discover import Checkpoint, Run
from ..store import LOAD, NonFiniteResult, OutputError, ResultStore, read_json_file
from ..study import versions
from ..data import DataSpec, build_tokens, check_data, data_clash, data_source, prebuild_tokens, resolve_kind

DEFAULT_ANALYSES = ("induction", "previous_token", "duplicate_token", "sinks", "viewer", "streaming", "composition",
                    "ablation", "pruning", "importance")
# `interp analyze`: the head atlas of one model, sized for a real one (no per-head exact ablation)
ATLAS_ANALYSES = ("induction", "previous_token", "duplicate_token", "sinks", "viewer", "streaming", "composition",
                  "pruning")
EXPENSIVE_ON = ("last", "all")
_COLLECT_ABOVE_BYTES = 64 * 2**20


class SettingsMismatch(RuntimeError):
    """The output folder holds results computed with other settings."""


@dataclass(frozen=True)
class SweepSettings:
    """What the numbers in a sweep folder mean; `settings.json` holds these, and a rerun must match.

    analyses     names from `interp.analyses.atlas.registry.ANALYSES`.
    data         the tokens every checkpoint sees (`DataSpec`; kind "auto" picks the zoo corpus
                 for byte-level zoo models and repeated random tokens otherwise).
    expensive_on "last": analyses marked expensive (ablation, pruning, importance: a forward pass
                 per head or more) run on the last checkpoint of each run only; "all": everywhere.
    device       where models run (None: CUDA when available); not part of the results' meaning.
    offload      None, "disk" or "cpu": each model loaded layer by layer (`interp.models.placement.offload`): the
                 same numbers, so not part of the results' meaning either.
    device_map   None, "auto" or {layer or unit: device} (or the command line's LAYERS:DEVICE,...): each model's
                 blocks split over devices (`interp.models.placement.device_map`); the same numbers, not part of the
                 results' meaning. device, offload and device_map are one choice, `placement`
                 (`interp.models.placement.choice.Placement`), checked when the settings are made.
    rope_scaling a RoPE scaling every model runs with, in place of its own (`interp.models.rope.choice`:
                 transformers' dict, or any spelling `rope_spec` reads; None: each checkpoint's own);
                 its original length, when not given, is each model's trained context.

    Settings are checked here, once, when they are made (the CLI makes them before it resolves a name
    or loads a model; `sweep()` remakes them when it settles data kind "auto"): unknown analyses,
    `expensive_on`, and the data (`check_data`: the file exists and holds usable token ids, the
    text is long enough).
    """

    analyses: tuple[str, ...] = DEFAULT_ANALYSES
    data: DataSpec = field(default_factory=DataSpec)
    expensive_on: Literal["last", "all"] = "last"
    device: str | None = None
    offload: str | None = None
    device_map: str | dict | None = None
    extrapolate: bool = False  # allow --seq-len past a rotary model's trained context (n_ctx); marked in the report
    rope_scaling: dict | None = None

    def __post_init__(self) -> None:
        resolve_analyses(self.analyses)  # raises on unknown names
        self.placement  # noqa: B018 - made to be checked: a device this machine lacks, a map beside an offload, ...
        if self.rope_scaling is not None:  # any spelling, kept as transformers' dict (settings.json's)
            object.__setattr__(self, "rope_scaling", rope_spec(self.rope_scaling))
        if self.expensive_on not in EXPENSIVE_ON:
            raise ValueError(f"expensive_on must be one of {EXPENSIVE_ON}, got {self.expensive_on!r}")
        check_data(self.data)  # kind "auto" is checked once settled (`_resolve_data` remakes the settings)

    @property
    def placement(self) -> Placement:
        """Where each model's weights go: device, offload and device_map as one value."""
        return Placement(self.device, self.offload, self.device_map)

    def meaning(self) -> dict:
        """The part of the settings results depend on (compared against an existing folder)."""
        meaning = {"data": self.data.to_dict(), "expensive_on": self.expensive_on, "rope_scaling": self.rope_scaling,
                   "params": {a: dict(ANALYSES[a].params) for a in self.analyses}}
        return json.loads(json.dumps(meaning))  # as settings.json will hold it (tuples become lists)


@dataclass(frozen=True)
class CheckpointTask:
    """One checkpoint and the analyses still to run on it: what a worker receives."""

    checkpoint: Checkpoint
    analyses: tuple[str, ...]
    data: DataSpec
    placement: Placement  # `SweepSettings.placement`: its device resolved by the worker, on its machine
    tokens: object = None  # the data, when the driver could build it once for all (`prebuild_tokens`)
    rope_scaling: dict | None = None  # `SweepSettings.rope_scaling`
    expected: str | None = None  # the kept fingerprint's hash: the weights its finished parts were computed from
    redo: tuple[str, ...] = ()  # its analyses with finished parts: run again when the weights are not `expected`
    files: tuple = ()  # `fingerprints.files_stamp` of the checkpoint when planned, kept beside its fingerprint


@dataclass(frozen=True)
class PartEvent:
    checkpoint: Checkpoint
    analysis: str
    rows: pd.DataFrame
    seconds: float
    extra: dict | None = None  # JSON the analysis keeps beside its rows (`registry.Output`)


@dataclass(frozen=True)
class FingerprintEvent:
    checkpoint: Checkpoint
    fingerprint: dict  # `fingerprints.fingerprint` of the weights as loaded
    n_analyses: int = 0  # none of the pending analyses: the progress counts parts and errors
    stale: tuple[str, ...] = ()  # finished analyses run again: the weights are not those they were computed from


@dataclass(frozen=True)
class ErrorEvent:
    checkpoint: Checkpoint
    analysis: str  # LOAD when the checkpoint did not load: none of its analyses ran
    error: str
    message: str
    n_analyses: int = 1  # how many pending analyses this error accounts for


@dataclass
class SweepResult:
    out: Path
    table: pd.DataFrame
    errors: list[dict]
    n_run: int
    n_skipped: int
    seconds: float
    report: Path | None = None
    integrity: list[str] = field(default_factory=list)  # `fingerprints.findings`: identical or misplaced checkpoints


# ---- the worker side -------------------------------------------------------------------------
def run_checkpoint(task: CheckpointTask) -> Iterator[PartEvent | ErrorEvent]:
    """Load one checkpoint, run each pending analysis on it, yield one event per analysis."""
    ckpt = task.checkpoint
    placement = task.placement.resolved()  # a device this machine lacks: raised, as for the whole sweep
    try:
        model = checkpoint.load_checkpoint(ckpt.path, rope_scaling=task.rope_scaling, placement=placement)
        tokens = build_tokens(task.data, model, task.tokens).to(model.device)
    except Exception as e:  # noqa: BLE001 - any failure to load is reported, and the sweep goes on
        yield ErrorEvent(ckpt, LOAD, type(e).__name__, str(e), n_analyses=len(task.analyses))
        return
    fp = fingerprint(model)
    changed = task.expected is not None and fp["weights"] != task.expected
    stale = tuple(a for a in task.redo if a in ANALYSES) if changed else ()
    yield FingerprintEvent(ckpt, fp, stale=stale)
    ctx = Context(model=model, tokens=tokens, data=task.data, checkpoint=ckpt)
    try:
        for name in dict.fromkeys((*task.analyses, *stale)):
            start = time.perf_counter()
            try:
                result = as_output(ANALYSES[name].run(ctx))  # analyzers set their own grad mode (importance needs gradients)
            except Exception as e:  # noqa: BLE001 - one analysis failing must not stop the others
                if isinstance(e, NonFiniteResult):  # not a bug in the code: no traceback, say where
                    message = f"{name} at {ckpt.run}/{ckpt.name}: {e}"
                else:
                    message = f"{e}\n{traceback.format_exc(limit=-3)}"
                yield ErrorEvent(ckpt, name, type(e).__name__, message)
                continue
            yield PartEvent(ckpt, name, result.rows.reset_index(drop=True), time.perf_counter() - start, result.extra)
    finally:
        size = sum(t.numel() * t.element_size() for t in model.parameters())
        cuda = model.device.type == "cuda"
        del ctx, model
        # The model holds reference cycles, so only the cycle collector frees it. A full collection
        # costs ~0.5 s with torch's modules imported: worth it to hold one big model at a time, not
        # for the small ones, which the generational collector reclaims soon enough.
        if size > _COLLECT_ABOVE_BYTES or cuda:
            gc.collect()
            if cuda:
                torch.cuda.empty_cache()


# ---- the driver ------------------------------------------------------------------------------
def plan(runs: Sequence[Run], settings: SweepSettings, done: set,
         wrapped: frozenset = frozenset(), prints: Kept | None = None) -> tuple[list[CheckpointTask], int]:
    """The checkpoint tasks still to do, and how many (checkpoint, analysis) pairs are already done.
    Runs named in `wrapped` (models transformers runs, `interp.models.wrapped`) skip native-only analyses.

    Finished parts stand only while their checkpoint holds the weights they were computed from: every task
    carries the kept fingerprint's hash (`prints`, `fingerprints.kept`) and the analyses with parts, which its
    worker runs again when the weights it loads are other. A checkpoint whose parts are all finished is loaded
    again, to check, when its fingerprint is not trusted: missing, malformed, from an older interp, or taken
    from other files than it has now (`fingerprints.files_stamp`)."""
    prints = prints or Kept()
    stored = {(p["run"], p["checkpoint"]): p for p in prints.stored()}
    trusted = {(p["run"], p["checkpoint"]) for p in prints.prints}
    finished: dict[tuple[str, str], list[str]] = {}
    for run_name, ckpt_name, analysis in sorted(done):
        finished.setdefault((run_name, ckpt_name), []).append(analysis)
    tasks, skipped = [], 0
    for run in runs:
        last = run.checkpoints[-1]
        for ckpt in run.checkpoints:
            key = (run.name, ckpt.name)
            wanted = [a for a in settings.analyses
                      if (not ANALYSES[a].expensive or settings.expensive_on == "all" or ckpt == last)
                      and not (ANALYSES[a].native_only and run.name in wrapped)]
            pending = tuple(a for a in wanted if (run.name, ckpt.name, a) not in done)
            skipped += len(wanted) - len(pending)
            files = files_stamp(ckpt.path)
            record = stored.get(key)
            checked = key in trusted and record["files"] == files
            if pending or (finished.get(key) and not checked):
                tasks.append(CheckpointTask(ckpt, pending, settings.data, settings.placement,
                                            rope_scaling=settings.rope_scaling,
                                            expected=record["weights"] if record else None,
                                            redo=tuple(finished.get(key, ())), files=tuple(map(tuple, files))))
    return tasks, skipped


def _check_settings(store: ResultStore, settings: SweepSettings, runs: Sequence[Run], force: bool) -> dict:
    """Compare with the folder's settings.json; return the settings to write (runs and analyses accumulate).
    `force` discards what interp wrote in the folder (only that: `OutputFolder.discard`)."""
    record = {"study": "sweep", "model": ", ".join(r.name for r in runs), "analyses": list(settings.analyses),
              **settings.meaning(),
              "data_description": settings.data.describe(), "data_source": data_source(settings.data),
              "runs": {r.name: {"source": r.source, "checkpoints": [c.name for c in r.checkpoints],
                                **_run_facts(r, settings)} for r in runs},
              "versions": versions(), "compute": compute_record(settings.device), "seconds": {}}
    if force:
        store.folder.discard()
        return record
    fix = "restore it, or pass --force to discard the results interp wrote in this folder"
    old = store.read_json("settings.json", fix=fix)
    if old is None:
        return record
    if not isinstance(old, dict):
        raise OutputError(f"{store.out / 'settings.json'} is not interp's settings (a JSON object): {fix}")
    if clash := data_clash(old, record["data_source"]):  # never rows of two data sources in one table
        raise SettingsMismatch(f"{store.out} {clash}: use another --out folder, or pass --force to discard the old "
                               "results")
    old_meaning = {k: old.get(k) for k in ("data", "expensive_on", "rope_scaling")}
    new_meaning = {k: record[k] for k in ("data", "expensive_on", "rope_scaling")}
    clash = [a for a in settings.analyses if a in old.get("params", {}) and old["params"][a] != record["params"][a]]
    if old_meaning != new_meaning or clash:
        diff = {k: (old_meaning[k], new_meaning[k]) for k in old_meaning if old_meaning[k] != new_meaning[k]}
        diff.update({f"params.{a}": (old["params"][a], record["params"][a]) for a in clash})
        raise SettingsMismatch(
            f"{store.out} holds results computed with other settings: "
            + "; ".join(f"{k}: was {a}, now {b}" for k, (a, b) in diff.items())
            + ". Use another --out folder, rerun with the old settings, or pass --force to discard the old results."
        )
    if old.get("versions") != record["versions"]:
        print(f"note: {store.out} was started with {old.get('versions')}, continuing with {record['versions']}")
    record["analyses"] = list(dict.fromkeys([*old.get("analyses", []), *settings.analyses]))
    record["params"] = {**old.get("params", {}), **record["params"]}
    record["runs"] = {**old.get("runs", {}), **record["runs"]}
    record["model"] = ", ".join(record["runs"])
    return record


def sweep(
    runs: Sequence[str | Run],
    out,
    settings: SweepSettings | None = None,
    executor: ExecutorSettings | None = None,
    *,
    force: bool = False,
    last_only: bool = False,
    progress: bool = True,
    report: bool = True,
    merge_every: float = 5.0,
    log=print,
    on_part: Callable[[int], None] | None = None,
) -> SweepResult:
    """Run `settings.analyses` over every checkpoint of `runs` into the folder `out` (see module doc);
    with `last_only`, over the last checkpoint of each (a single model is a run of one checkpoint).
    A run is a `Run` or any name `interp.models.runs.names.resolve_run` resolves (a folder, a zoo name, a
    .gguf file, a real-model short name, a Hub repo id).
    `on_part(n)` is called after each result part is written (n parts so far)."""
    tqdm = auto_tqdm()
    settings = settings or SweepSettings()
    executor = executor or ExecutorSettings()
    start = time.perf_counter()
    store = ResultStore(out)
    store.folder.check()  # a file, a foreign or unwritable folder: refused before anything is resolved
    found = [resolve_run(r, last_only=last_only) for r in runs]  # plan: every name resolved, once, up front
    names = [r.name for r in found]
    if len(set(names)) != len(names):
        raise ValueError(f"two runs share a name ({names}); give each run folder a distinct name")
    settings = _resolve_data(settings, found)
    check_up_front(settings, found)
    for name in settings.analyses:  # analyses at their own length, said once
        own = ANALYSES[name].max_len
        if own is not None and settings.data.seq_len > own:
            log(f"note: {name} runs on pieces of {own} tokens of the {settings.data.seq_len}-token sequences (its own "
                "length; recorded in its rows and report section)")
    wrapped = frozenset(r.name for r in found if _wrapped(r))
    skip = [a for a in settings.analyses if ANALYSES[a].native_only]
    if wrapped and skip:
        log(f"note: {', '.join(skip)} need interp's own implementation of the model; skipped for "
            f"{', '.join(sorted(wrapped))} (wrapped: transformers runs it, interp hooks its attention)")
    with store.writing():  # created, locked against a second sweep, its manifest started
        record = _check_settings(store, settings, found, force)
        store.read_json("timing.json")  # damaged: said now, in one line, not after the work
        store.write_json("settings.json", record)
        prints = kept(store.out, record["runs"])
        for line in prints.malformed:
            log(f"note: {line}: not a fingerprint interp wrote; ignored (taken again if it stands for a checkpoint of "
                "this sweep)")
        if prints.orphans:
            log(f"note: fingerprints ignored, of checkpoints not in this folder's runs: {checkpoints_of(prints.orphans)}")
        tasks, skipped = plan(found, settings, store.done(), wrapped, prints)
        if again := sum(1 for t in tasks if not t.analyses):
            log(f"note: {again} checkpoint(s) with every result finished are loaded again to check their weights (their "
                "fingerprint is missing, malformed, from an older interp, or their files changed since it was taken); "
                "their results are recomputed only where the weights are not those they were computed from")
        store.start({r.name: [a for a in settings.analyses if r.name not in wrapped or a not in skip] for r in found})
        store.claim_tasks((t.checkpoint.run, t.checkpoint.name, a) for t in tasks for a in (*t.analyses, LOAD))
        if tasks and (tokens := prebuild_tokens(settings.data)) is not None:
            tasks = [dataclasses.replace(t, tokens=tokens) for t in tasks]
        result = _run_tasks(store, found, settings, tasks, skipped, executor, start, tqdm, progress, merge_every, log,
                            on_part)
        record["seconds"] = {"sweep": round(result.seconds, 2)}  # this invocation's (every one: timing.json)
        store.write_json("settings.json", record)
        log(summary(result, found))
        if report:
            result.report = write_report(store.out)
            log(f"report: {result.report} (and report.md)")
    return result


def _run_tasks(store, found, settings, tasks, skipped, executor, start, tqdm, progress, merge_every, log,
               on_part) -> SweepResult:
    """Run `tasks`, writing each event as it arrives; merge as checkpoints finish and at the end."""
    n_pairs = sum(len(t.analyses) for t in tasks)
    n_ckpts = sum(len(r.checkpoints) for r in found)
    log(f"sweep: {len(found)} run(s), {n_ckpts} checkpoint(s), analyses {','.join(settings.analyses)}; "
        f"{n_pairs} task(s) to run, {skipped} already done -> {store.out}")

    n_run, last_merge, complete = 0, time.perf_counter(), False
    remaining = {(t.checkpoint.run, t.checkpoint.name): len(t.analyses) for t in tasks}
    by_key = {(t.checkpoint.run, t.checkpoint.name): t for t in tasks}
    ex = make_executor(executor) if tasks else None
    bar = tqdm(total=n_pairs, unit="task", desc="sweep", disable=not progress or not tasks, dynamic_ncols=True)
    try:
        for event in ex.run(run_checkpoint, tasks) if ex else ():
            c = event.checkpoint
            if isinstance(event, FingerprintEvent):
                task = by_key[(c.run, c.name)]
                store.clear_load_error(c.run, c.name)  # it loaded this time
                if task.redo and task.expected not in (None, event.fingerprint["weights"]):
                    _drop_stale(store, task, event, log)
                    extra = len(event.stale)
                    bar.total += extra
                    remaining[(c.run, c.name)] += extra
                    skipped -= extra
                store.write_fingerprint(c.run, c.name, c.step, {**event.fingerprint, "path": c.path,
                                                                "files": [list(f) for f in task.files]})
                continue
            if isinstance(event, PartEvent):
                store.clear_load_error(c.run, c.name)  # it loaded this time
                try:
                    store.write_part(c.run, c.name, c.step, event.analysis, event.rows, event.seconds, event.extra)
                    n_run += 1
                    bar.set_postfix_str(f"{c.run}/{c.name} {event.analysis}", refresh=False)
                except NonFiniteResult as e:  # NaN or inf: an error of this task, never a result
                    event = ErrorEvent(c, event.analysis, type(e).__name__, str(e))
            if isinstance(event, ErrorEvent):
                store.write_error(c.run, c.name, c.step, event.analysis, event.error, event.message, c.path)
                bar.write(f"error: {c.run}/{c.name} {event.analysis}: {event.error}: {event.message.splitlines()[0]}")
            n = getattr(event, "n_analyses", 1)
            bar.update(n)
            key = (c.run, c.name)
            remaining[key] -= n
            if remaining[key] == 0 and time.perf_counter() - last_merge >= merge_every:
                store.merge()
                last_merge = time.perf_counter()
            if on_part is not None:
                on_part(n_run)  # e.g. a test that raises here, as if the sweep had been killed
        complete = True  # every task ran (or failed, said in errors.json); an exception leaves it partial
    finally:
        bar.close()
        if ex is not None:
            ex.close()
        table = store.merge(complete=complete)
        seconds = time.perf_counter() - start
        timing = store.read_json("timing.json", {"invocations": []})
        timing["invocations"].append({"started": time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(time.time() - seconds)),
                                      "seconds": round(seconds, 2), "executor": ex.description if ex else "none",
                                      "tasks_run": n_run, "tasks_skipped": skipped})
        store.write_json("timing.json", timing)
    runs = (store.read_json("settings.json") or {}).get("runs", {})
    return SweepResult(store.out, table, store.errors(), n_run, skipped, seconds,
                       integrity=findings(kept(store.out, runs, check_files=True).prints))


def _drop_stale(store: ResultStore, task: CheckpointTask, event: FingerprintEvent, log) -> None:
    """The weights of `task`'s checkpoint are not those its finished parts were computed from: remove those parts
    (a sweep killed while recomputing them then recomputes the rest) and say so in one line."""
    c = event.checkpoint
    for analysis in task.redo:
        store.remove_part(c.run, c.name, analysis)
    gone = [a for a in task.redo if a not in event.stale]
    log(f"{c.run}/{c.name}: its weights are not those its results were computed from (fingerprint "
        f"{task.expected[:12]}, now {event.fingerprint['weights'][:12]}): "
        + (f"recomputing {', '.join(event.stale)}" if event.stale else "")
        + (f"{'; ' if event.stale else ''}dropped {', '.join(gone)} (no longer registered analyses)" if gone else ""))


def summary(result: SweepResult, runs: Sequence[Run]) -> str:
    lines = [f"done in {result.seconds:.1f} s: {result.n_run} task(s) run, {result.n_skipped} already done, "
             f"{len(result.table)} rows in {result.out / 'results.csv'}"]
    for r in runs:
        steps = [c.step for c in r.checkpoints if c.step is not None]
        span = f", steps {min(steps)}..{max(steps)}" if steps else ""
        lines.append(f"  run {r.name}: {len(r.checkpoints)} checkpoint(s){span}")
    if result.errors:
        lines.append(f"  {len(result.errors)} error(s) (skipped; details in {result.out / 'errors.json'}):")
        for e in result.errors:
            lines.append(f"    {e['run']}/{e['checkpoint']} {e['analysis']}: {e['error']}: {e['message'].splitlines()[0][:200]}")
    lines += [f"  checkpoint integrity: {line}" for line in result.integrity]
    return "\n".join(lines)


def _config_at(path: str):
    """A checkpoint's config, read once per sweep (a GGUF's metadata takes seconds to parse); a file
    changed since is read again."""
    try:
        stamp = os.stat(path).st_mtime_ns
    except OSError:
        stamp = None
    return _config_cached(path, stamp)


@functools.lru_cache(maxsize=64)
def _config_cached(path: str, stamp):
    return read_config(path)


def _wrapped(run: Run) -> bool:
    """Whether a run's model is one transformers runs (no native family for its model_type)."""
    try:
        return is_wrapped(str(run.checkpoints[-1].path))
    except (CheckpointError, FileNotFoundError, ValueError, KeyError, ImportError):
        return False


def _run_facts(run: Run, settings: SweepSettings) -> dict:
    """What settings.json records of a run's config, read without weights: {"layer_windows": [window or
    None per layer]} when its layers differ in attention window (Gemma's local and global layers, so the
    report can say where heads live), {"extrapolated_past": n_ctx} when it is analysed past its trained
    context (`--extrapolate`), and {"rope_scaling": transformers' dict} with the scaling it runs with when
    one was chosen (its original length settled); {} for none, or for a config that cannot be read."""
    try:
        cfg = _config_at(str(run.checkpoints[-1].path))
    except (CheckpointError, FileNotFoundError, ValueError, KeyError, ImportError):
        return {}
    windows, rope = cfg.windows(), settings.rope_scaling
    return {**({"layer_windows": windows} if len(set(windows)) > 1 else {}),
            **({"extrapolated_past": cfg.n_ctx} if settings.data.seq_len > cfg.n_ctx else {}),
            **({"rope_scaling": as_hf(choose(cfg, rope))} if rope is not None else {})}


def check_up_front(settings: SweepSettings, runs: Sequence[Run]) -> None:
    """Refuse, before anything is loaded or written, settings that would fail on every checkpoint:
    a device this machine does not have or a placement a model cannot take (`settings.placement`, checked
    when the settings were made, and here against each run: `check_placement`), sequences longer than a learned
    position table, token ids outside the vocabulary, a RoPE scaling a model cannot take (no rotary positions,
    wrapped). Configs are read without weights; an unreadable one is left to the sweep, which reports that
    checkpoint and goes on."""
    placement = settings.placement
    needing = [a for a in settings.analyses if ANALYSES[a].gradients]
    if placement.offload is not None and needing:
        raise ValueError(f"--analyses {','.join(needing)} need(s) gradients through the model, which an offloaded model "
                         f"(--offload {placement.offload}) does not keep: leave them out, or run without --offload")
    kv = [a for a in settings.analyses if ANALYSES[a].kv_cache]
    spec = settings.data
    file_tokens = int(prebuild_tokens(spec).max()) if spec.kind == "file" else None
    for run in runs:
        for ckpt in run.checkpoints:  # code in a checkpoint folder never runs: refused, not skipped
            refuse_code_in(ckpt.path)
        try:
            cfg = _config_at(str(run.checkpoints[-1].path))
        except (CheckpointError, FileNotFoundError, ValueError, KeyError, ImportError):
            continue
        check_placement(run.checkpoints[-1].path, placement, cfg=cfg)  # a wrapped model, a map against its layers
        if kv:
            placement.refuse_split(cfg, f"--analyses {','.join(kv)} read(s) interp's KV cache, which holds every layer "
                                   "on one device", name=run.name)
        if settings.rope_scaling is not None:
            rope_scaling_for(run.checkpoints[-1].path, settings.rope_scaling, cfg=cfg)
        if cfg.positional in ("learned", "sinusoidal") and spec.seq_len > cfg.n_ctx:
            raise ValueError(f"--seq-len {spec.seq_len} is longer than {run.name}'s context (n_ctx={cfg.n_ctx}, "
                             f"{cfg.positional} positions): pass --seq-len {cfg.n_ctx} or less")
        if spec.seq_len > cfg.n_ctx and not settings.extrapolate:
            raise ValueError(f"--seq-len {spec.seq_len} is longer than {run.name}'s trained context (n_ctx={cfg.n_ctx}): "
                             f"pass --extrapolate to run past it (the report marks the numbers as extrapolated), or "
                             f"--seq-len {cfg.n_ctx} or less")
        placement.check_fits(cfg, spec.n_seqs, spec.seq_len)
        if file_tokens is not None and file_tokens >= cfg.d_vocab:
            raise ValueError(f"{spec.path} holds token id {file_tokens}, outside {run.name}'s vocabulary "
                             f"[0, {cfg.d_vocab})")


def _resolve_data(settings: SweepSettings, runs: Sequence[Run]) -> SweepSettings:
    """Settle `data.kind == "auto"` before anything is recorded, so settings.json names real data.
    Settings with a settled kind were checked when made; remade here, they check the data they now name."""
    kind = resolve_kind(settings.data.kind, [c.path for r in runs for c in r.checkpoints])
    if kind != settings.data.kind:
        settings = dataclasses.replace(settings, data=dataclasses.replace(settings.data, kind=kind))
    return settings


def load_settings(out) -> dict:
    f = Path(out) / "settings.json"
    if not f.is_file():
        raise FileNotFoundError(f"{out} is not a sweep folder (no settings.json)")
    return read_json_file(f, "interp's settings.json")


__all__ = ["ATLAS_ANALYSES", "CheckpointTask", "DEFAULT_ANALYSES", "SettingsMismatch", "SweepResult", "SweepSettings",
           "plan", "run_checkpoint", "sweep"]
