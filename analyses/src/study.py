"""One shape for every study: a study declares its tables and their columns, checks its settings
before the model loads, measures, and writes its report sections; `run` owns the plumbing, once.

    @dataclass(frozen=True, kw_only=True, eq=False)
    class NormsMeasured(Measured):
        top: float  # what only the report reads: a typed field beside the tables, never a table

    class Norms(Study):
        name, title = "norms", "Head output norms"
        tables = (Table("norms", ("layer", "head", "norm")),)

        def measure(self, model, settings, stage):
            tokens = settings.data.tokens(model)
            norms = stage("norms", lambda: head_norms(model, tokens))
            return NormsMeasured(tables={"norms": norms}, top=float(norms["norm"].max()))

        def sections(self, settings, measured, record):
            return [Section("summary", "Summary").add(f"{len(measured['norms'])} heads; the largest {measured.top:.3f}.")]

    run(Norms(), model, "out/norms", StudySettings(model="attn-only-2l", data=StudyData.of(DataSpec("text"))))

As lm-evaluation-harness splits a task (which declares its outputs) from the one evaluator that writes
every task's results, `run` owns, for every study:

- the output folder (`store.OutputFolder`): checked before any work; a folder holding another study's
  or a sweep's results is refused unless `force` (which discards what interp wrote there, nothing
  else); a rerun of the same study replaces what interp wrote there before, whole; every file is
  claimed in the folder's manifest before it is written, under the folder's lock;
- the stage timer and its log lines (`stage(label, fn)`), whose seconds go into settings.json and
  the report;
- the tables: each declared `Table`, checked for its columns and written by `store.write_table`
  (parquet, CSV where pyarrow is missing: the same for every table, and never a failure after the
  work is done). `measure` returns them as `Measured.tables`; what only the study's `record` and
  `sections` read passes as typed fields of the study's own `Measured` subclass, never as a table
  (a name `tables` does not declare is refused);
- settings.json: `SHARED_KEYS` for every study (the study, the model, the data and its sha256, the RoPE
  scaling chosen at inference or null, where it computed, the versions, the seconds per stage), then the
  study's own (`Study.record`);
- the report (report.html, report.md, figures/): the study's sections, the time per stage, the data
  source and a RoPE scaling chosen at inference added to the first one.

`Study.check(cfg, settings)` is pure: it reads a config (no weights) and returns the settings to run,
with a default length fitted to the model (`fit_default`: said in one note) and anything that cannot
work refused in one line. The command line's side is `interp.commands.checks` (read the config, check,
then load); from Python, `run(study, model, out, study.checked(model.cfg, settings))`. A new study is one
file, its command, and its test (`tests/analyses/test_study_plugin.py` defines one; `tests/contract/test_study_commands.py`
holds every `Study` subclass it finds under `interp.analyses` to the contract).
"""

from __future__ import annotations

import dataclasses
import json
import platform
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, ClassVar, Mapping

import pandas as pd
import torch
from torch import Tensor

from interp.models.placement.choice import Placement
from interp.models.placement.device import compute_record, installed_version
from interp.errors import as_user_errors
from interp.models.rope.choice import as_hf, describe

from ._common import stages
from .document import Section, write_document
from .store import SETTINGS_KEYS, OutputError, OutputFolder, read_json_file, write_table
from interp.analyses.data import DataSpec, build_tokens, check_data, data_source, read_token_file, source_line

# What every settings.json interp writes holds, whatever wrote it (a study or the sweep).
SHARED_KEYS = ("study", "model", "data_description", "data_source", "rope_scaling", "compute", "versions", "seconds")


def versions() -> dict:
    """The versions a result was computed with (settings.json of every study and sweep)."""
    out = {"interp": installed_version("interp") or "unknown", "torch": torch.__version__, "pandas": pd.__version__,
           "python": platform.python_version()}
    if (transformers := installed_version("transformers")) is not None:
        out["transformers"] = transformers
    return out


@dataclass(frozen=True)
class Table:
    """A table a study writes: `name`.parquet (or .csv, `store.write_table`) holding at least `columns`.
    `optional`: written only when the study measured it (e.g. DuoAttention's curve, when gates were
    trained). `csv`: a .csv beside the parquet always (for readers without pyarrow)."""

    name: str
    columns: tuple[str, ...]
    optional: bool = False
    csv: bool = False


@dataclass(frozen=True, eq=False)
class StudyData:
    """The tokens a study reads, and their name. One of:

    - `spec`: a `data.DataSpec` (text, the zoo corpus, repeated random tokens), built for the model
      when the study runs. `default_length`: its seq_len is a command's default, so `fit_default` may
      shorten it to a model's context (a length asked for is never changed);
    - `ids` from `file`: token ids used as they are, one sequence per row (`from_file`);
    - `tokens` built already (`given`), with their `description` and `source` (None: not named)."""

    spec: DataSpec | None = None
    ids: Tensor | None = None
    file: str | None = None
    default_length: bool = False
    description: str | None = None
    source: dict | None = None

    @classmethod
    def of(cls, spec: DataSpec, *, default_length: bool = False) -> "StudyData":
        return cls(spec=spec, default_length=default_length)

    @classmethod
    def from_file(cls, path: str, rows: int | None = None) -> "StudyData":
        """Token ids from a .npy or .pt file ([n_seqs, seq_len]; a flat file is one sequence), its first
        `rows` rows when given. The file is named by sha256."""
        ids = read_token_file(path)
        ids = ids.reshape(1, -1) if ids.dim() == 1 else ids
        return cls(ids=ids if rows is None else ids[:rows], file=str(path))

    @classmethod
    def given(cls, tokens: Tensor, description: str = "", source: dict | None = None) -> "StudyData":
        return cls(ids=tokens, description=description, source=source)

    @property
    def length(self) -> int:
        """Tokens per sequence."""
        return int(self.ids.shape[1]) if self.ids is not None else self.spec.seq_len

    @property
    def rows(self) -> int:
        return int(self.ids.shape[0]) if self.ids is not None else self.spec.n_seqs

    def at_length(self, n: int) -> "StudyData":
        """The same text at sequences of `n` tokens (a spec only)."""
        return dataclasses.replace(self, spec=dataclasses.replace(self.spec, seq_len=n))

    def check(self, d_vocab: int | None = None) -> None:
        """Before any model loads: the text exists and is long enough (`check_data`), the token ids are
        inside a vocabulary of `d_vocab`."""
        if self.spec is not None:
            check_data(self.spec)
        elif self.file is not None and d_vocab is not None and int(self.ids.max()) >= d_vocab:
            raise ValueError(f"{self.file} holds token id {int(self.ids.max())}, outside the vocabulary [0, {d_vocab})")

    def tokens(self, model) -> Tensor:
        """[rows, length] token ids on the model's device."""
        if self.ids is not None:
            return self.ids.to(model.device)
        with as_user_errors(ValueError):  # text too short for the model's tokenizer, ...: said in one line
            return build_tokens(self.spec, model).to(model.device)

    def describe(self) -> str:
        if self.description is not None:
            return self.description
        if self.spec is not None:
            return self.spec.describe()
        return f"{self.rows} x {self.length} tokens from {self.file}"

    def named(self) -> dict | None:
        """`data.data_source`: what the tokens were read from, by sha256 (None: nothing read, or not named)."""
        if self.spec is not None:
            return data_source(self.spec)
        if self.file is not None:
            return data_source(DataSpec(kind="file", path=self.file))
        return self.source

    def says_source(self) -> bool:
        """Whether the report names the source (given tokens without one are the caller's to name)."""
        return self.spec is not None or self.file is not None or self.source is not None


@dataclass(frozen=True, kw_only=True, eq=False)
class StudySettings:
    """What every study's settings hold (a study's own settings subclass this, kw_only).

    model     the name the report and settings.json give the model
    data      the tokens it reads (`StudyData`; None for a study that reads none)
    device    where the command loads the model (memory is checked there before loading)
    offload   None, "disk" or "cpu": the model loaded layer by layer (`interp.models.placement.offload`)
    device_map None, "auto" or the command line's LAYERS:DEVICE,...: the blocks split over devices
              (`interp.models.placement.device_map`); memory is checked on each
    progress  progress bars: None on a terminal only, False never

    device, offload and device_map are one choice, `placement` (`interp.models.placement.choice.Placement`),
    checked when the settings are made (one line: a device this machine lacks, a map beside an offload)."""

    model: str = "model"
    data: StudyData | None = None
    device: str | None = None
    offload: str | None = None
    device_map: str | dict | None = None
    progress: bool | None = None

    def __post_init__(self) -> None:
        self.placement  # noqa: B018 - made to be checked

    @property
    def placement(self) -> Placement:
        """Where the model's weights go: device, offload and device_map as one value."""
        return Placement(self.device, self.offload, self.device_map)


@dataclass(frozen=True, kw_only=True, eq=False)
class Measured:
    """What `Study.measure` returns. `tables`: {declared table name: DataFrame}, what `run` writes (an
    optional table may be absent); `measured[name]` reads one. What only the study's `record` and `sections`
    read (the task, the heads a ranking named, a circuit) is a typed field of the study's own subclass
    (a frozen, kw_only dataclass), never a key of `tables`. A study whose report reads its tables alone
    may return the dict of them."""

    tables: Mapping[str, pd.DataFrame]

    def __getitem__(self, name: str) -> pd.DataFrame:
        return self.tables[name]

    def get(self, name: str) -> pd.DataFrame | None:
        """An optional table, or None when it was not measured."""
        return self.tables.get(name)


class Study:
    """A study: its `name` (settings.json, log lines), `title` (the report's), its `tables`, and four
    methods; `run` does the rest. See the module docstring."""

    name: ClassVar[str] = "study"
    title: ClassVar[str] = "Study"
    tables: ClassVar[tuple[Table, ...]] = ()

    def check(self, cfg, settings) -> tuple[StudySettings, list[str]]:
        """Pure, before the model loads: `settings` against the model's config `cfg` (read without
        weights). Returns the settings to run and notes (one line each, e.g. a default length fitted
        to the model); raises ValueError (one line) for settings that cannot work."""
        return settings, []

    def measure(self, model, settings, stage: Callable) -> Measured | Mapping[str, pd.DataFrame]:
        """A `Measured` (the study's subclass): a DataFrame for every declared table (an optional one may be
        absent) and, as typed fields, what only the report reads; or the dict of the tables alone.
        `stage(label, fn)` runs and times a step."""
        raise NotImplementedError

    def record(self, settings, measured: Measured) -> dict:
        """The study's own entries of settings.json (JSON values), beside `SHARED_KEYS`."""
        return {}

    def sections(self, settings, measured: Measured, record: dict) -> list[Section]:
        """The report's sections; `record` is settings.json's content."""
        raise NotImplementedError

    def checked(self, cfg, settings):
        """`check` for a caller in Python (a notebook, a test): the settings to run, against the model's
        config `cfg`; a refusal raised as one `UserError` line, as the command says it. Its notes (a default
        length fitted to the model) are the command's to print: `check` returns them."""
        with as_user_errors(ValueError):
            return self.check(cfg, settings)[0]

    # Why the study needs the whole model on one device, when it does (None: it runs split by a `device_map`)
    one_device: ClassVar[str | None] = None

    def uses_kv_cache(self, settings) -> bool:
        """Whether the study, with these settings, reads interp's KV cache (decoding, cache policies): refused on
        a model split over several devices (`interp.models.placement.device_map`), whose cache would be on one."""
        return False

    def files(self) -> str:
        """What `run` writes, in words (the command's last line)."""
        return ", ".join(["report.md", *(f"{t.name}.*" for t in self.tables)])


# ---- the output folder ---------------------------------------------------------------------------
def folder_owner(folder: OutputFolder) -> str | None:
    """What wrote the results in `folder`: the study named in its settings.json, "sweep" for a sweep
    folder, "" for a study's folder from before settings.json named the study, None for no results."""
    f = folder.path / "settings.json"
    if not f.is_file() or (folder.manifest.exists() and not folder.owns("settings.json")):
        return None  # (without a manifest, `OutputFolder.check` let it pass: a sweep folder from before manifests)
    record = read_json_file(f, "interp's settings.json", "pick another --out folder, or pass --force")
    if not isinstance(record, dict):
        return ""
    if "study" in record:
        return str(record["study"])
    return "sweep" if SETTINGS_KEYS <= record.keys() else ""


def check_folder(study: Study, out, *, force: bool = False) -> OutputFolder:
    """The output folder, refused in one line before any work: a file, unwritable, someone else's
    (`OutputFolder.check`), holding another study's or a sweep's results without `force`, or holding a
    file interp did not write under a name the study writes (refused now, not after the work). The owner
    seen here is remembered: `_write` checks it again under the folder's lock."""
    folder = OutputFolder(out)
    folder.check()
    owner = folder_owner(folder)
    if owner and owner != study.name and not force:
        raise OutputError(f"{folder.path} holds {_whose(owner)}: pick another --out folder, or pass --force to "
                          "discard what interp wrote there")
    folder.refuse_others(*_study_files(study.tables))
    folder.owner_seen = owner
    return folder


def _whose(owner: str) -> str:
    return "a sweep's results" if owner == "sweep" else f"the results of the {owner} study"


def _study_files(tables) -> list[str]:
    """The fixed names a study writes (its figures are named by the report as it writes them)."""
    return ["settings.json", "report.md", "report.html",
            *(f"{t.name}.{ext}" for t in tables for ext in ("parquet", "csv"))]


def _write(folder: OutputFolder, frames: list[tuple[Table, pd.DataFrame]], record: dict, title: str,
           sections: list[Section]) -> Path:
    with folder.writing():
        # again, under the lock: a study started beside this one into the same folder may have written since
        owner, study = folder_owner(folder), record.get("study")
        if owner and owner not in (study, folder.owner_seen):
            raise OutputError(f"{folder.path} now holds {_whose(owner)}, written there while this {study} study ran: "
                              "nothing of this run was written and those results stay; rerun with another --out folder")
        folder.refuse_others(*_study_files([t for t, _ in frames]))
        if folder.paths():
            folder.discard()  # the same study's earlier results (or, with force, another's): replaced whole
        for table, frame in frames:
            write_table(folder, table.name, frame, csv=table.csv)
        folder.write_text("settings.json", json.dumps(record, indent=2) + "\n")
        return write_document(folder.path, title, sections, folder=folder)


def _measured(study: Study, measured: Measured | Mapping) -> Measured:
    """What `measure` returned, as a `Measured` (a dict is its tables alone)."""
    if isinstance(measured, Measured):
        return measured
    if isinstance(measured, Mapping):
        return Measured(tables=dict(measured))
    raise TypeError(f"study {study.name}: measure returned {type(measured).__name__}, not a Measured or a dict of "
                    "its tables")


def _frames(study: Study, measured: Measured) -> list[tuple[Table, pd.DataFrame]]:
    declared = {t.name for t in study.tables}
    stray = [k for k in measured.tables if k not in declared]
    if stray:
        raise ValueError(f"study {study.name} measured undeclared tables {stray}: declare them in its tables, "
                         "or pass what only the report reads as a typed field of the study's Measured subclass")
    frames = []
    for table in study.tables:
        frame = measured.tables.get(table.name)
        if frame is None:
            if not table.optional:
                raise ValueError(f"study {study.name} did not measure its table {table.name}")
            continue
        missing = [c for c in table.columns if c not in frame.columns]
        if missing:
            raise ValueError(f"study {study.name}: table {table.name} lacks its columns {missing}")
        frames.append((table, frame))
    return frames


def run(study: Study, model, out, settings: StudySettings, *, force: bool = False, log=print) -> Path:
    """Measure `study` on `model` with `settings` and write it all into the folder `out` (see the module
    docstring). Returns the report's path."""
    folder = check_folder(study, out, force=force)
    timings: dict[str, float] = {}
    data = settings.data
    source = data.named() if data is not None else None  # hashed before the work, as the data is read
    measured = _measured(study, study.measure(model, settings, stages(timings, log, prefix=study.name)))
    frames = _frames(study, measured)
    # the model's own word for it, however it was loaded (`interp.load(rope_scaling=)`, `rescale_rope_`)
    rope = as_hf(model.cfg.rope_scaling) if model.runtime.rope_chosen else None
    record = {"study": study.name, "model": settings.model,
              "data_description": data.describe() if data is not None else None, "data_source": source,
              **study.record(settings, measured), "rope_scaling": rope, "compute": compute_record(model.device),
              "versions": versions(), "seconds": {str(k): round(v, 2) for k, v in timings.items()}}
    sections = study.sections(settings, measured, record)
    sections[0].add("Time: " + ", ".join(f"{k} {v:.0f} s" for k, v in timings.items()) + "." if timings else None,
                    source_line(source) if data is not None and data.says_source() else None, describe(rope))
    return _write(folder, frames, record, f"{study.title}: {settings.model}", sections)


# ---- checks shared by the studies (pure) ---------------------------------------------------------------
def fit_default(data: StudyData, limit: int, flag: str = "--seq-len") -> tuple[StudyData, str | None]:
    """`data` at a length a model can read: a default length past `limit` becomes `limit`, said in one
    note; a length that was asked for is left for the study to refuse (or extrapolate)."""
    if data.spec is None or not data.default_length or data.length <= limit:
        return data, None
    return data.at_length(limit), fit_note(flag, data.length, limit, limit)


def fit_note(flag: str, default, used, n_ctx: int) -> str:
    """The one line that says a default was fitted to the model."""
    return f"note: {flag} {default} (the default) does not fit this model's context (n_ctx={n_ctx}): {flag} {used} used"


__all__ = ["SHARED_KEYS", "Measured", "Study", "StudyData", "StudySettings", "Table", "check_folder", "fit_default",
           "run", "versions"]
