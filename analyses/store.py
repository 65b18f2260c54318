"""The on-disk state of a sweep: one small file per finished (checkpoint, analysis), merged into a table.

    DIR/settings.json            what the results mean (analyses, data spec, parameters, versions)
    DIR/parts/<run>/<ckpt>/<analysis>.json        rows of one finished (checkpoint, analysis)
    DIR/parts/<run>/<ckpt>/<analysis>.error.json  why it failed (`load` when the checkpoint did not load)
    DIR/results.parquet, results.csv              every part, one tidy table
    DIR/errors.json                               every error file, one list
    DIR/timing.json                               wall time of each sweep invocation

Every file is written to a temporary name and moved into place with `os.replace`, so a sweep
killed at any moment leaves each file either absent or whole: a part that exists is finished and
is never recomputed; an error is retried by the next sweep (the file may have been repaired).
"""

from __future__ import annotations

import json
import os
import re
import zlib
from pathlib import Path
from typing import Iterable

import pandas as pd

COLUMNS = ("run", "checkpoint", "step", "analysis", "layer", "head", "metric", "value")
DTYPES = {
    "run": "string", "checkpoint": "string", "step": "Int64", "analysis": "string",
    "layer": "Int64", "head": "Int64", "metric": "string", "value": "float64",
}
ROW_FIELDS = ("layer", "head", "metric", "value")  # what an analysis produces; the rest is the task's key
LOAD = "load"  # the analysis name an error carries when the checkpoint itself could not be loaded


def atomic_write_text(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _slug(name: str) -> str:
    """A file-name-safe form of `name`; a hash keeps two names that slug alike apart."""
    safe = re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("._") or "_"
    return safe if safe == name else f"{safe}-{zlib.crc32(name.encode()):08x}"


def empty_table() -> pd.DataFrame:
    return pd.DataFrame({c: pd.Series(dtype=t) for c, t in DTYPES.items()})


def as_table(frame: pd.DataFrame) -> pd.DataFrame:
    """`frame` with exactly COLUMNS, in order, typed (nullable Int layer/head/step), sorted."""
    out = frame.reindex(columns=list(COLUMNS)).astype(DTYPES)
    return out.sort_values(["run", "step", "checkpoint", "analysis", "metric", "layer", "head"],
                           na_position="first", kind="stable").reset_index(drop=True)


class ResultStore:
    """Reads and writes a sweep directory (layout above)."""

    def __init__(self, out) -> None:
        self.out = Path(out)
        self.parts = self.out / "parts"

    # ---- per-task files ----------------------------------------------------------------------
    def _path(self, run: str, checkpoint: str, analysis: str, suffix: str) -> Path:
        return self.parts / _slug(run) / _slug(checkpoint) / f"{_slug(analysis)}{suffix}"

    def write_part(self, run: str, checkpoint: str, step: int | None, analysis: str, rows: pd.DataFrame, seconds: float) -> None:
        """Persist one finished (checkpoint, analysis); clears an earlier error of the same task."""
        missing = set(ROW_FIELDS) - set(rows.columns)
        if missing:
            raise ValueError(f"analysis {analysis!r} returned rows without columns {sorted(missing)}")
        cols = {c: [None if pd.isna(v) else (v if c == "metric" else (float(v) if c == "value" else int(v)))
                    for v in rows[c].tolist()] for c in ROW_FIELDS}
        record = {"run": run, "checkpoint": checkpoint, "step": step, "analysis": analysis,
                  "seconds": round(seconds, 4), "rows": cols}
        if rows.attrs.get("extra") is not None:  # JSON an analysis keeps beside its rows (e.g. the viewer's sample)
            record["extra"] = rows.attrs["extra"]
        atomic_write_text(self._path(run, checkpoint, analysis, ".json"), json.dumps(record))
        self._path(run, checkpoint, analysis, ".error.json").unlink(missing_ok=True)

    def write_error(self, run: str, checkpoint: str, step: int | None, analysis: str, error: str, message: str, path: str = "") -> None:
        record = {"run": run, "checkpoint": checkpoint, "step": step, "analysis": analysis,
                  "error": error, "message": message, "path": path}
        atomic_write_text(self._path(run, checkpoint, analysis, ".error.json"), json.dumps(record, indent=1))

    def clear_load_error(self, run: str, checkpoint: str) -> None:
        self._path(run, checkpoint, LOAD, ".error.json").unlink(missing_ok=True)

    def _records(self, pattern: str) -> Iterable[dict]:
        if not self.parts.is_dir():
            return
        for f in sorted(self.parts.glob(f"*/*/{pattern}")):
            if f.name.endswith(".error.json") != pattern.endswith(".error.json"):
                continue
            try:
                yield json.loads(f.read_text())
            except (json.JSONDecodeError, OSError) as e:  # cannot happen with atomic writes; say so if it does
                raise RuntimeError(f"{f} is unreadable ({e}); delete it and rerun the sweep to recompute it") from None

    def part_records(self) -> list[dict]:
        return list(self._records("*.json"))

    def errors(self) -> list[dict]:
        return list(self._records("*.error.json"))

    def done(self) -> set[tuple[str, str, str]]:
        """(run, checkpoint, analysis) of every finished task."""
        return {(r["run"], r["checkpoint"], r["analysis"]) for r in self.part_records()}

    # ---- merged outputs ----------------------------------------------------------------------
    def table(self) -> pd.DataFrame:
        """Every part's rows as one tidy table (COLUMNS)."""
        frames = []
        for r in self.part_records():
            rows = pd.DataFrame(r["rows"])
            if rows.empty:
                continue
            for key in ("run", "checkpoint", "step", "analysis"):
                rows[key] = r[key]
            frames.append(rows)
        return as_table(pd.concat(frames, ignore_index=True)) if frames else empty_table()

    def merge(self) -> pd.DataFrame:
        """Write results.parquet (when pyarrow is installed), results.csv and errors.json; return the table."""
        table = self.table()
        self.out.mkdir(parents=True, exist_ok=True)
        tmp = self.out / f".results.csv.{os.getpid()}.tmp"
        table.to_csv(tmp, index=False)
        os.replace(tmp, self.out / "results.csv")
        try:
            import pyarrow  # noqa: F401
        except ImportError:
            pass
        else:
            tmp = self.out / f".results.parquet.{os.getpid()}.tmp"
            table.to_parquet(tmp, index=False)
            os.replace(tmp, self.out / "results.parquet")
        atomic_write_text(self.out / "errors.json", json.dumps(self.errors(), indent=1))
        return table

    def extras(self) -> list[dict]:
        """The `extra` payloads of finished tasks: [{run, checkpoint, step, analysis, extra}]."""
        return [{k: r[k] for k in ("run", "checkpoint", "step", "analysis", "extra")}
                for r in self.part_records() if r.get("extra") is not None]

    def seconds(self) -> pd.DataFrame:
        """Compute time of every finished task: [run, checkpoint, step, analysis, seconds]."""
        recs = [{k: r[k] for k in ("run", "checkpoint", "step", "analysis", "seconds")} for r in self.part_records()]
        return pd.DataFrame(recs, columns=["run", "checkpoint", "step", "analysis", "seconds"])

    # ---- settings and timing -----------------------------------------------------------------
    def read_json(self, name: str, default=None):
        f = self.out / name
        return json.loads(f.read_text()) if f.is_file() else default

    def write_json(self, name: str, value) -> None:
        atomic_write_text(self.out / name, json.dumps(value, indent=2))


def load_results(out) -> pd.DataFrame:
    """The results table of a sweep directory: results.parquet, else results.csv, else merged from parts."""
    out = Path(out)
    if (out / "results.parquet").is_file():
        try:
            return as_table(pd.read_parquet(out / "results.parquet"))
        except ImportError:
            pass
    if (out / "results.csv").is_file():
        return as_table(pd.read_csv(out / "results.csv"))
    return ResultStore(out).table()
