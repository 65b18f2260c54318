"""The on-disk state of a sweep: one small file per finished (checkpoint, analysis), merged into a table.

    DIR/settings.json            what the results mean (analyses, data spec, parameters, versions)
    DIR/parts/<run>/<ckpt>/<analysis>.json        rows of one finished (checkpoint, analysis)
    DIR/parts/<run>/<ckpt>/<analysis>.error.json  why it failed (`load` when the checkpoint did not load)
    DIR/results.parquet, results.csv              every part, one tidy table
    DIR/errors.json                               every error file, one list
    DIR/timing.json                               wall time of each sweep invocation
    DIR/fingerprints/<run>/<ckpt>.json            the checkpoint's weights' hash and sketch (`atlas.fingerprints`)
    DIR/fingerprints.csv                          every fingerprint's hash, one table
    DIR/progress.json                             whether the sweep completed, what it planned per run, and the
                                                  rows of the merged table (written after both files of it)
    DIR/.interp-manifest.json                     every path interp wrote here (`OutputFolder`)
    DIR/.interp-lock                              held (flock) by the one process writing here

Every file is written to a temporary name and moved into place with `os.replace`, so a sweep
killed at any moment leaves each file either absent or whole: a part that exists is finished and
is never recomputed; an error is retried by the next sweep (the file may have been repaired).

Researchers point --out at folders they care about, so interp writes only paths it created and
removes nothing else (`OutputFolder`), and a part holds finite numbers only: NaN or inf is an
error of that (checkpoint, analysis), never a result (`NonFiniteResult`).
"""

from __future__ import annotations

import errno
import glob
import json
import math
import os
import re
import warnings
import zlib
from contextlib import contextmanager
from pathlib import Path, PurePosixPath
from typing import Callable, Iterable, Iterator

import numpy as np
import pandas as pd

from interp.errors import UserError

try:
    import fcntl
except ImportError:  # not POSIX: no lock (two sweeps into one folder are then the user's to avoid)
    fcntl = None

COLUMNS = ("run", "checkpoint", "step", "analysis", "layer", "head", "metric", "value")
DTYPES = {
    "run": "string", "checkpoint": "string", "step": "Int64", "analysis": "string",
    "layer": "Int64", "head": "Int64", "metric": "string", "value": "float64",
}
ROW_FIELDS = ("layer", "head", "metric", "value")  # what an analysis produces; the rest is the task's key
LOAD = "load"  # the analysis name an error carries when the checkpoint itself could not be loaded
MANIFEST = ".interp-manifest.json"
LOCK = ".interp-lock"
PROGRESS = "progress.json"
SWEEP_FILES = ("settings.json", "results.parquet", "results.csv", "errors.json", "timing.json", "report.html",
               "report.md", PROGRESS, "fingerprints.csv")
# The keys every settings.json interp has written holds: how a sweep folder from before manifests is recognised.
SETTINGS_KEYS = frozenset({"analyses", "data", "expensive_on", "params", "runs"})


class OutputError(UserError, ValueError):
    """The output folder cannot be used as asked (a file, not writable, someone else's, in use by another
    sweep, or holding a damaged file). The message is one line: what is wrong and what to do."""


class NonFiniteResult(ValueError):
    """An analysis produced NaN or inf. That is an error of the (checkpoint, analysis), never a result:
    a NaN would sort last in a ranking, vanish from a max and print as a headline."""


def atomic_write_text(path: Path, text: str) -> None:
    _atomic_write(path, text.encode())


def atomic_write_bytes(path: Path, data: bytes) -> None:
    _atomic_write(path, data)


def _atomic_write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _tmp_name(path)
    try:  # O_NOFOLLOW: a link planted under the temporary name is never written through
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_NOFOLLOW", 0), 0o644)
    except OSError as e:
        raise OutputError(f"cannot write {tmp}: {e.strerror}: remove it, or pick another --out folder") from None
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def _tmp_name(path: Path) -> Path:
    """Where `path` is written before it is moved into place; a link standing there is refused (a writer
    that opens by name would follow it out of the folder)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    if tmp.is_symlink():
        raise OutputError(f"{tmp} is a symbolic link where interp writes a temporary file: interp never writes "
                          "through a link; remove it, or pick another --out folder")
    return tmp


def read_json_file(path: Path, what: str = "a JSON file", fix: str = "delete it and rerun"):
    """The JSON in `path`; a damaged file is one line naming it (never a bare JSONDecodeError)."""
    try:
        return json.loads(Path(path).read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise OutputError(f"{path} is not {what} ({e}): it was changed outside interp; {fix}") from None


def nonfinite_rows(rows: pd.DataFrame) -> list[str]:
    """`L{layer}H{head} metric=value` (`L{layer} ...` per layer, `metric=...` per model) for each row of
    long rows whose value is NaN or infinite."""
    values = pd.to_numeric(pd.Series(rows["value"], dtype=object), errors="coerce").astype(float).to_numpy()
    bad = rows[~np.isfinite(values)]
    return [f"{_row_name(r.layer, r.head)}{r.metric}={v}" for r, v in zip(bad.itertuples(), values[~np.isfinite(values)])]


def _row_name(layer, head) -> str:
    if layer is None or pd.isna(layer):
        return ""
    return f"L{int(layer)}H{int(head)} " if head is not None and not pd.isna(head) else f"L{int(layer)} "


def nonfinite_message(analysis: str, where: str, bad: list[str], n_rows: int) -> str:
    shown = ", ".join(bad[:8]) + (f" and {len(bad) - 8} more" if len(bad) > 8 else "")
    return (f"{analysis} at {where} gave {len(bad)} non-finite value(s) of {n_rows}: {shown}; none of its rows were "
            "kept (NaN or inf is not a result: check the checkpoint's weights for NaN/inf)")


# ---- tables ----------------------------------------------------------------------------------------
def parquet_engine() -> bool:
    """Whether pandas can write parquet here (pyarrow, an optional dependency, is installed)."""
    try:
        import pyarrow  # noqa: F401 - the parquet engine pandas uses
    except ImportError:
        return False
    return True


def write_table(folder: "OutputFolder", name: str, frame: pd.DataFrame, *, csv: bool = False) -> list[str]:
    """The one table writer of every study and of the sweep: `name`.parquet where pyarrow is installed,
    else `name`.csv (the same rows; never a failure after the work is done); with `csv`, `name`.csv
    beside the parquet always (for readers without pyarrow). Each file is claimed in `folder` before
    it is written, written to a temporary name and moved into place. Returns the files written."""
    parquet = parquet_engine()
    files = ([f"{name}.csv"] if csv or not parquet else []) + ([f"{name}.parquet"] if parquet else [])
    folder.claim(*files)
    folder.path.mkdir(parents=True, exist_ok=True)
    for file in files:
        tmp = _tmp_name(folder.path / file)
        if file.endswith(".csv"):
            frame.to_csv(tmp, index=False)
        else:
            frame.to_parquet(tmp, index=False)
        os.replace(tmp, folder.path / file)
    return files


def read_table(out, name: str) -> pd.DataFrame:
    """The table `name` of a folder `write_table` wrote: its .parquet where pyarrow can read it, else its .csv."""
    out = Path(out)
    if (out / f"{name}.parquet").is_file() and parquet_engine():
        return pd.read_parquet(out / f"{name}.parquet")
    if (out / f"{name}.csv").is_file():
        return pd.read_csv(out / f"{name}.csv")
    raise FileNotFoundError(f"{out} holds no table {name} ({name}.parquet or {name}.csv)")


# ---- the output folder ---------------------------------------------------------------------------
_HELD: dict[str, list] = {}  # realpath -> [lock fd, depth]: a process re-enters its own lock (a sweep writes its report)


class OutputFolder:
    """A folder interp writes into, and the record of what it wrote there (`.interp-manifest.json`).

    A path is written only if interp created it: it is claimed (listed in the manifest, written
    atomically) *before* it is first written, and a path that exists unclaimed is refused; `discard`
    (--force) removes claimed paths only, and a claimed folder only once it is empty. So a listed path
    that is absent was never written, and a user's file is never deleted or overwritten. A non-empty
    folder without a manifest is someone else's and is refused outright (no --force overrides that),
    except a sweep folder from before manifests existed (`_legacy`), whose files of interp's layout
    are adopted. One process writes at a time: `writing()` holds `flock` on `.interp-lock`, which the
    OS releases when the process dies, so a killed sweep never leaves the folder locked.
    """

    def __init__(self, path, adopt: Callable[[Path], set[str] | None] | None = None) -> None:
        """`adopt`: for a folder another interp command wrote before manifests existed (a training run's
        folder), the paths of its own layout it holds, or None for any other folder; such a folder is
        adopted as a sweep folder from before manifests is (`_legacy`), its other files left alone."""
        self.path = Path(path)
        self.adopt = adopt
        self.manifest = self.path / MANIFEST
        self._read: tuple[tuple, frozenset] | None = None  # (the manifest's stat, its paths): read once per change
        self.owner_seen: str | None = None  # what held results here when a study checked the folder (`study`)

    # ---- is it ours? ---------------------------------------------------------------------------
    def check(self) -> None:
        """Refuse, writing nothing, a folder interp must not or cannot write into: among them a folder
        whose manifest or lock is a link, or whose manifest lists a path outside it (`paths`)."""
        p = self.path
        if p.exists() and not p.is_dir():
            raise OutputError(f"--out {p} is a file, not a folder: give a folder path (a new one is created)")
        if p.is_dir():
            for own in (MANIFEST, LOCK):
                _refuse_link(p / own)
            self.paths()  # every listed entry inside the folder, before anything is written or removed
            if not self.manifest.exists() and not self._legacy() and self._foreign_layout() is None:
                others = sorted(n for n in os.listdir(p) if n not in (MANIFEST, LOCK))
                if others:
                    shown = ", ".join(others[:3]) + (", ..." if len(others) > 3 else "")
                    raise OutputError(f"{p} already holds files interp did not write ({shown}): pick another --out "
                                      "folder, a new or empty one (--force never discards files interp did not write)")
            writable = p
        else:
            writable = next(a for a in p.absolute().parents if a.exists())
            if not writable.is_dir():
                raise OutputError(f"--out {p}: {writable} is a file, not a folder")
        if not os.access(writable, os.W_OK | os.X_OK):
            raise OutputError(f"cannot write to {writable} (permission denied): choose a folder you can write to")

    def _legacy(self) -> dict | None:
        """The settings of a sweep folder written before manifests existed: its settings.json is a JSON
        object with the keys every interp settings.json has (a user's own settings.json does not). Such a
        folder is still resumable; only the files that interp's layout names are adopted (`_adopted`)."""
        f = self.path / "settings.json"
        if not f.is_file():
            return None
        settings = read_json_file(f, "interp's settings.json", f"pick another --out folder ({self.path} has no record "
                                  "of what interp wrote there)")
        return settings if isinstance(settings, dict) and SETTINGS_KEYS <= settings.keys() else None

    def _foreign_layout(self) -> set[str] | None:
        return self.adopt(self.path) if self.adopt is not None and self.path.is_dir() else None

    def _adopted(self) -> set[str]:
        """What a pre-manifest sweep folder holds of interp's own layout: the fixed files, the part files
        and their folders, and the report's figures (named after the settings' runs)."""
        p, settings = self.path, self._legacy() or {}
        paths = {name for name in SWEEP_FILES if (p / name).is_file()}
        for part in [*p.glob("parts/*/*/*.json"), *p.glob("fingerprints/*/*.json")]:
            rel = part.relative_to(p).as_posix()
            paths.update([rel, *_parents(rel)])
        runs = list(settings.get("runs", {}))
        prefixes = tuple({f"{r.replace('/', '_')}_" for r in runs} | {f"{slug(r)}_" for r in runs})
        for fig in p.glob("figures/*.png"):
            if prefixes and fig.name.startswith(prefixes):
                paths.update([f"figures/{fig.name}", "figures/"])
        return paths

    # ---- writing -------------------------------------------------------------------------------
    @contextmanager
    def writing(self) -> Iterator["OutputFolder"]:
        """Check the folder, create it, hold its lock, and start (or adopt) its manifest."""
        self.check()
        with self.lock():
            if not self.manifest.exists():
                adopted = self._adopted() if self._legacy() else (self._foreign_layout() or set())
                for rel in adopted:
                    self._inside(rel)  # a pre-manifest folder's parts/ may be a link out of it
                self._save(adopted)
            yield self

    @contextmanager
    def lock(self) -> Iterator[None]:
        """Hold `.interp-lock` (flock, released by the OS when the process dies); refuse when another
        process holds it. Re-entrant within one process."""
        key = os.path.realpath(self.path)
        if key not in _HELD:
            _HELD[key] = [self._acquire(), 0]
        _HELD[key][1] += 1
        try:
            yield
        finally:
            _HELD[key][1] -= 1
            if _HELD[key][1] == 0:
                fd = _HELD.pop(key)[0]
                if fd is not None:
                    os.close(fd)  # releases the flock

    def _acquire(self) -> int | None:
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            _refuse_link(self.path / LOCK)  # O_NOFOLLOW below closes the gap between this look and the open
            fd = os.open(self.path / LOCK, os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0), 0o644)
        except OSError as e:
            if e.errno == errno.ELOOP:
                _refuse_link(self.path / LOCK, always=True)
            raise OutputError(f"cannot write to {self.path}: {e.strerror}: choose a folder you can write to") from None
        if fcntl is None:
            return fd
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            pid = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise OutputError(f"another sweep (pid {pid}) is writing to {self.path}: wait for it to finish, "
                              "or use another --out folder") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        return fd

    def paths(self) -> set[str]:
        """Every path listed as interp's (folders end in "/"). The file is the truth (another `OutputFolder`
        of this folder in this process may have written it); it is parsed again only when it changed."""
        try:
            st = self.manifest.lstat()
        except FileNotFoundError:
            return set()
        key = (st.st_ino, st.st_mtime_ns, st.st_size)
        if self._read is None or self._read[0] != key:
            _refuse_link(self.manifest)
            record = read_json_file(self.manifest, "interp's manifest", "pick another --out folder")
            if not isinstance(record, dict) or not isinstance(record.get("paths"), list):
                raise OutputError(f"{self.manifest} is not interp's manifest: pick another --out folder")
            root = os.path.realpath(self.path)
            for rel in record["paths"]:
                self._inside(rel, root, listed=True)
            self._read = (key, frozenset(record["paths"]))
        return set(self._read[1])

    def _inside(self, rel, root: str | None = None, *, listed: bool = False) -> None:
        """Refuse `rel` unless it names a path inside the folder: relative, no `..`, and resolving (links
        followed) to the folder itself or below it. A manifest is a file anyone sharing the folder can
        edit; an entry such as `../notes.txt`, `/home/me/.bashrc` or `figures/x` through a link named
        `figures` would otherwise be removed by `discard` or written by `write_text`."""
        ok = isinstance(rel, str) and rel not in ("", ".", "./") and "\0" not in rel
        if ok:
            pure = PurePosixPath(rel)
            ok = not pure.is_absolute() and ".." not in pure.parts and "\\" not in rel
        if ok:
            root = root or os.path.realpath(self.path)
            real = os.path.realpath(self.path / rel)
            ok = real != root and real.startswith(root.rstrip(os.sep) + os.sep)
        if not ok:
            where = f"{self.manifest} lists {rel!r}" if listed else f"{self.path / str(rel)}"
            raise OutputError(f"{where}, which is outside {self.path} (a path with .., an absolute path, or a "
                              "symbolic link out of the folder): interp touched nothing; remove that "
                              + ("entry" if listed else "link") + ", or pick another --out folder")

    def _save(self, paths: set[str]) -> None:
        atomic_write_text(self.manifest, json.dumps({"written_by": "interp", "paths": sorted(paths)}, indent=0))

    def refuse_others(self, *rels: str, paths: set[str] | None = None) -> None:
        """Refuse files among `rels` that exist and are not interp's."""
        paths = self.paths() if paths is None else paths
        for rel in rels:
            if rel not in paths and not rel.endswith("/") and (self.path / rel).exists():
                raise OutputError(f"{self.path / rel} exists and was not written by interp: move it away, "
                                  "or pick another --out folder")

    def claim(self, *rels: str) -> None:
        """List `rels` (relative paths, folders ending in "/") as interp's just before they are first
        written; a file that exists and is not listed is someone else's: refused."""
        paths = self.paths()
        root = os.path.realpath(self.path)
        for rel in rels:
            if rel not in paths:
                self._inside(rel, root)
        self.refuse_others(*rels, paths=paths)
        new = set()
        for rel in rels:
            if rel in paths or (rel.endswith("/") and (self.path / rel).exists()):
                continue  # ours already; or someone else's folder: written into, never claimed (or removed)
            new.add(rel)
            new.update(d for d in _parents(rel) if d not in paths and not (self.path / d).exists())
        if new:
            self._save(paths | new)

    def owns(self, rel: str) -> bool:
        return rel in self.paths()

    def write_text(self, rel: str, text: str) -> None:
        self.claim(rel)
        atomic_write_text(self.path / rel, text)

    def write_bytes(self, rel: str, data: bytes) -> None:
        self.claim(rel)
        atomic_write_bytes(self.path / rel, data)

    def remove(self, rel: str) -> None:
        """Delete `rel` if interp wrote it (it stays listed: interp may write it again)."""
        if (self.path / rel).exists() and self.owns(rel):
            (self.path / rel).unlink()

    def discard(self) -> None:
        """--force: remove every file interp wrote here (and its leftover temporary files), then its
        folders that are left empty. Nothing unlisted is touched."""
        paths = self.paths()
        folders = sorted((r for r in paths if r.endswith("/")), key=lambda r: r.count("/"), reverse=True)
        for rel in paths - set(folders):
            f = self.path / rel
            f.unlink(missing_ok=True)
            for tmp in glob.glob(glob.escape(str(f.parent / f".{f.name}.")) + "*.tmp"):
                Path(tmp).unlink(missing_ok=True)
        for rel in folders:
            try:
                (self.path / rel).rmdir()
            except OSError:  # absent, or holds files interp did not write
                pass
        self._save({r for r in folders if (self.path / r).is_dir()})


def _refuse_link(path: Path, *, always: bool = False) -> None:
    """Refuse interp's own bookkeeping file (manifest, lock) when it is a symbolic link: opening it
    would read or overwrite whatever the link points at."""
    if always or path.is_symlink():
        raise OutputError(f"{path} is a symbolic link: interp never writes through a link (it would overwrite "
                          "what it points at); interp touched nothing; remove the link, or pick another --out folder")


def _parents(rel: str) -> list[str]:
    """The folders of a relative path, as claimed ("parts/", "parts/run/", ...)."""
    parts = rel.rstrip("/").split("/")[:-1]
    return ["/".join(parts[: i + 1]) + "/" for i in range(len(parts))]


def slug(name: str) -> str:
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
    """Reads and writes a sweep directory (layout above); writes go through its `OutputFolder`."""

    def __init__(self, out) -> None:
        self.out = Path(out)
        self.parts = self.out / "parts"
        self.folder = OutputFolder(self.out)

    @contextmanager
    def writing(self) -> Iterator["ResultStore"]:
        """Own the folder for writing (see `OutputFolder.writing`); a user's file named like one of the
        sweep's fixed files is refused now, before any work, not when it would be written."""
        with self.folder.writing():
            self.folder.refuse_others(*SWEEP_FILES)
            yield self

    # ---- per-task files ----------------------------------------------------------------------
    def _rel(self, run: str, checkpoint: str, analysis: str, suffix: str) -> str:
        return f"parts/{slug(run)}/{slug(checkpoint)}/{slug(analysis)}{suffix}"

    def _path(self, run: str, checkpoint: str, analysis: str, suffix: str) -> Path:
        return self.out / self._rel(run, checkpoint, analysis, suffix)

    def claim_tasks(self, keys: Iterable[tuple[str, str, str]]) -> None:
        """List the part and error files of (run, checkpoint, analysis) tasks as interp's, in one write of
        the manifest (rather than one per part). A checkpoint's load error is the task (run, checkpoint, LOAD)."""
        self.folder.claim(*(self._rel(run, ckpt, analysis, suffix) for run, ckpt, analysis in keys
                            for suffix in ((".error.json",) if analysis == LOAD else (".json", ".error.json"))))

    def write_part(self, run: str, checkpoint: str, step: int | None, analysis: str, rows: pd.DataFrame, seconds: float,
                   extra: dict | None = None) -> None:
        """Persist one finished (checkpoint, analysis), with the JSON `extra` it keeps beside its rows;
        clears an earlier error of the same task. Rows holding NaN or inf are refused
        (`NonFiniteResult`): they are an error, never a result."""
        missing = set(ROW_FIELDS) - set(rows.columns)
        if missing:
            raise ValueError(f"analysis {analysis!r} returned rows without columns {sorted(missing)}")
        if bad := nonfinite_rows(rows):
            raise NonFiniteResult(nonfinite_message(analysis, f"{run}/{checkpoint}", bad, len(rows)))
        cols = {c: [None if pd.isna(v) else (v if c == "metric" else (float(v) if c == "value" else int(v)))
                    for v in rows[c].tolist()] for c in ROW_FIELDS}
        record = {"run": run, "checkpoint": checkpoint, "step": step, "analysis": analysis,
                  "seconds": round(seconds, 4), "rows": cols}
        if extra is not None:  # e.g. the viewer's token sample and patterns
            record["extra"] = extra
        self.folder.write_text(self._rel(run, checkpoint, analysis, ".json"), json.dumps(record))
        self.folder.remove(self._rel(run, checkpoint, analysis, ".error.json"))

    def write_error(self, run: str, checkpoint: str, step: int | None, analysis: str, error: str, message: str, path: str = "") -> None:
        """Record why a task failed; a part of the same task (non-finite, from an older version) goes."""
        record = {"run": run, "checkpoint": checkpoint, "step": step, "analysis": analysis,
                  "error": error, "message": message, "path": path}
        self.folder.write_text(self._rel(run, checkpoint, analysis, ".error.json"), json.dumps(record, indent=1))
        self.folder.remove(self._rel(run, checkpoint, analysis, ".json"))

    def write_fingerprint(self, run: str, checkpoint: str, step: int | None, fingerprint: dict) -> None:
        """Keep a checkpoint's weights' fingerprint (`atlas.fingerprints.fingerprint`) in the results."""
        record = {"run": run, "checkpoint": checkpoint, "step": step, **fingerprint}
        self.folder.write_text(f"fingerprints/{slug(run)}/{slug(checkpoint)}.json", json.dumps(record))

    def fingerprints(self) -> list[dict]:
        """Every kept fingerprint file that reads as one (a JSON object with run, checkpoint, step and weights):
        [{run, checkpoint, step, weights, ...}]. `atlas.fingerprints.kept` judges them, naming the others."""
        folder = self.out / "fingerprints"
        records = []
        for f in sorted(folder.glob("*/*.json")) if folder.is_dir() else ():
            try:
                record = json.loads(f.read_text())
            except (OSError, ValueError, UnicodeDecodeError):
                continue
            if isinstance(record, dict) and {"run", "checkpoint", "step", "weights"} <= record.keys():
                records.append(record)
        return records

    def remove_part(self, run: str, checkpoint: str, analysis: str) -> None:
        """Forget a finished (checkpoint, analysis): its checkpoint's weights are not those it was computed from."""
        self.folder.remove(self._rel(run, checkpoint, analysis, ".json"))

    def clear_load_error(self, run: str, checkpoint: str) -> None:
        self.folder.remove(self._rel(run, checkpoint, LOAD, ".error.json"))

    def _records(self, pattern: str) -> Iterable[dict]:
        if not self.parts.is_dir():
            return
        for f in sorted(self.parts.glob(f"*/*/{pattern}")):
            if f.name.endswith(".error.json") != pattern.endswith(".error.json"):
                continue
            try:
                yield json.loads(f.read_text())
            except (ValueError, OSError) as e:  # cannot happen with atomic writes; say so if it does
                raise OutputError(f"{f} is unreadable ({e}); delete it and rerun the sweep to recompute it") from None

    def _all_parts(self) -> tuple[list[dict], list[dict]]:
        """Every part record: (finite, not finite). Earlier versions stored NaN (as null) and inf."""
        finite, stale = [], []
        for r in self._records("*.json"):
            (finite if all(v is not None and math.isfinite(v) for v in r["rows"]["value"]) else stale).append(r)
        return finite, stale

    def part_records(self) -> list[dict]:
        """Finished parts. A part holding NaN or inf (written before they were refused) is not a result:
        it is listed by `errors()` and recomputed by the next sweep."""
        return self._all_parts()[0]

    def errors(self, stale: list[dict] | None = None) -> list[dict]:
        """Every error file, and a `NonFiniteResult` error for each part holding NaN or inf (`stale`, when
        the caller has read the parts already)."""
        stale = self._all_parts()[1] if stale is None else stale
        return list(self._records("*.error.json")) + [
            {"run": r["run"], "checkpoint": r["checkpoint"], "step": r["step"], "analysis": r["analysis"],
             "error": NonFiniteResult.__name__, "path": "",
             "message": nonfinite_message(r["analysis"], f"{r['run']}/{r['checkpoint']}",
                                          nonfinite_rows(pd.DataFrame(r["rows"])), len(r["rows"]["value"]))}
            for r in stale]

    def done(self) -> set[tuple[str, str, str]]:
        """(run, checkpoint, analysis) of every finished task."""
        return {(r["run"], r["checkpoint"], r["analysis"]) for r in self.part_records()}

    # ---- merged outputs ----------------------------------------------------------------------
    def table(self, records: list[dict] | None = None) -> pd.DataFrame:
        """Every part's rows as one tidy table (COLUMNS)."""
        frames = []
        for r in self.part_records() if records is None else records:
            rows = pd.DataFrame(r["rows"])
            if rows.empty:
                continue
            for key in ("run", "checkpoint", "step", "analysis"):
                rows[key] = r[key]
            frames.append(rows)
        return as_table(pd.concat(frames, ignore_index=True)) if frames else empty_table()

    def merge(self, *, complete: bool = False) -> pd.DataFrame:
        """Write results.parquet (when pyarrow is installed), results.csv (`write_table`) and errors.json,
        both tables from one table; then progress.json, which says whether the sweep completed and how many
        rows the tables hold, so a reader never takes a table merged mid-sweep (or a csv and a parquet that a
        kill left one merge apart) for the finished one. Return the table."""
        finite, stale = self._all_parts()  # one read of the parts for both
        table = self.table(finite)
        write_table(self.folder, "results", table, csv=True)
        self.folder.write_text("errors.json", json.dumps(self.errors(stale), indent=1))
        prints = pd.DataFrame([{k: f[k] for k in ("run", "checkpoint", "step", "weights")} for f in self.fingerprints()],
                              columns=["run", "checkpoint", "step", "weights"])
        self.folder.write_text("fingerprints.csv", prints.to_csv(index=False))
        self.write_json(PROGRESS, {**self.read_json(PROGRESS, {}), "complete": complete, "rows": len(table)})
        return table

    def start(self, planned: dict[str, list[str]]) -> None:
        """Mark the sweep begun and not complete, with the analyses it runs on each run's checkpoints."""
        self.write_json(PROGRESS, {"complete": False, "planned": planned, "rows": None})

    def completion(self) -> tuple[int, int] | None:
        """(checkpoints finished, checkpoints planned) of a sweep that has not completed (killed, interrupted,
        or still running); None for a completed one, and for a folder from before progress.json. A checkpoint
        is finished when each analysis planned on its run has a part or an error, or it did not load."""
        progress = self.read_json(PROGRESS)
        if progress is None or progress.get("complete"):
            return None
        runs = (self.read_json("settings.json") or {}).get("runs", {})
        planned = progress.get("planned") or {}
        have: dict[tuple[str, str], set] = {}
        finite, stale = self._all_parts()  # one read of the parts for both
        for r in [*finite, *self.errors(stale)]:
            have.setdefault((r["run"], r["checkpoint"]), set()).add(r["analysis"])
        checkpoints = [(run, c) for run, info in runs.items() for c in info.get("checkpoints", [])]
        done = sum(1 for run, c in checkpoints
                   if LOAD in have.get((run, c), ()) or set(planned.get(run, ())) <= have.get((run, c), set()))
        return done, len(checkpoints)

    def extras(self) -> list[dict]:
        """The `extra` payloads of finished tasks: [{run, checkpoint, step, analysis, extra}]."""
        return [{k: r[k] for k in ("run", "checkpoint", "step", "analysis", "extra")}
                for r in self.part_records() if r.get("extra") is not None]

    def seconds(self) -> pd.DataFrame:
        """Compute time of every finished task: [run, checkpoint, step, analysis, seconds]."""
        recs = [{k: r[k] for k in ("run", "checkpoint", "step", "analysis", "seconds")} for r in self.part_records()]
        return pd.DataFrame(recs, columns=["run", "checkpoint", "step", "analysis", "seconds"])

    # ---- settings and timing -----------------------------------------------------------------
    def read_json(self, name: str, default=None, fix: str = "delete it and rerun"):
        f = self.out / name
        return read_json_file(f, f"interp's {name}", fix) if f.is_file() else default

    def write_json(self, name: str, value) -> None:
        self.folder.write_text(name, json.dumps(value, indent=2))


class PartialResults(UserWarning):
    """The sweep of a folder did not complete: its table holds only the checkpoints that finished."""


def partial_note(done: int, total: int) -> str:
    return f"partial: {done} of {total} checkpoints"


def load_results(out) -> pd.DataFrame:
    """The results table of a sweep directory: results.parquet, else results.csv, else merged from parts.
    A (run, checkpoint, analysis) with a NaN or inf value (a table written before they were refused) is
    left out whole, as `ResultStore.errors` reports it. A sweep that did not complete (`completion`) is read
    from its parts, the only files a kill cannot leave stale, and said: `table.attrs["partial"]` is
    "partial: N of M checkpoints", with a `PartialResults` warning; so is a table whose row count is not
    the one progress.json recorded after writing it."""
    out = Path(out)
    store = ResultStore(out)
    progress = store.read_json(PROGRESS)
    if (left := store.completion()) is not None:
        table = store.table()
        table.attrs["partial"] = partial_note(*left)
        warnings.warn(f"{out}: {table.attrs['partial']} (the sweep did not complete; rerun `interp sweep` with this "
                      "--out to finish it)", PartialResults, stacklevel=2)
        return table
    table = _read_results(out)
    if table is None or (progress is not None and progress.get("rows") not in (None, len(table))):
        return store.table()  # absent, or not the table progress.json recorded: the parts are the truth
    return _finite_only(table)


def _read_results(out: Path) -> pd.DataFrame | None:
    """results.parquet, else results.csv, typed; None when neither exists."""
    table = None
    for name, read in (("results.parquet", pd.read_parquet), ("results.csv", pd.read_csv)):
        if table is None and (out / name).is_file():
            try:
                table = as_table(read(out / name))
            except ImportError:  # parquet without pyarrow: the csv has the same rows
                continue
            except Exception as e:  # noqa: BLE001 - pyarrow, pandas and the OS raise many kinds for a damaged file
                first = str(e).splitlines()[0] if str(e) else type(e).__name__
                raise OutputError(f"{out / name} is unreadable ({first}): delete it; the next `interp sweep` "
                                  "with this --out rebuilds it from parts/") from None
    return table


def _finite_only(table: pd.DataFrame) -> pd.DataFrame:
    bad = ~np.isfinite(table["value"].to_numpy(dtype=float, na_value=np.nan))
    if bad.any():
        keys = ["run", "checkpoint", "analysis"]
        drop = table.loc[bad, keys].drop_duplicates().assign(_bad=True)
        merged = table.merge(drop, on=keys, how="left")
        table = as_table(table[merged["_bad"].isna().to_numpy()])
    return table
