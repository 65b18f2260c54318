"""The evaluation data that ships with interp, pinned by sha256: the same bytes on every Python.

The analyses' default data used to come from the running Python (the zoo's held-out files from its
standard library, the real-model text from its `pydoc_data.topics`), and both differ between Python
versions, so every number moved with the interpreter. They are now files in this folder, taken once
from CPython 3.11.7 by `make.py` (which says how), listed in `manifest.json` with a name, a sha256
of their unpacked bytes, a source and a licence line (CPython's files are under the PSF licence,
`LICENSE-PSF.txt`):

  python-language-reference   the Python Language Reference (`pydoc_data.topics`, every topic by name,
                              blank lines between): the default text of the atlas, sweeps and KV studies
                              on real models, and the needle task's haystack (`language_reference()`)
  python-stdlib-heldout       the zoo's 90 held-out standard-library files (`heldout_docs()`), byte ids
                              for `training.eval_windows`: the default data of sweeps of the zoo

    from interp.analyses import evaldata
    evaldata.language_reference()[:40]      # text, read and checked once per process
    evaldata.source(evaldata.LANGUAGE_REFERENCE)   # {'name': ..., 'sha256': ..., 'licence': ..., ...}

Each file is checked against its sha256 the first time it is read in a process; a file that is
missing, unreadable or fails its hash is a broken install (`BrokenInstall`, one line naming the file
and how to reinstall), never silently other data. `sha256_file(path)` names a user's own data file
the same way (read in pieces: memory stays flat on a large file).
"""

from __future__ import annotations

import functools
import gzip
import hashlib
import json
import zlib
from pathlib import Path
from typing import Sequence

import numpy as np

from interp.errors import UserError

HERE = Path(__file__).resolve().parent
MANIFEST = "manifest.json"
LICENCE = "LICENSE-PSF.txt"
LANGUAGE_REFERENCE = "python-language-reference"
HELDOUT = "python-stdlib-heldout"
REINSTALL = ("reinstall interp (pip install --force-reinstall --no-deps interp; in a clone: git restore analyses/src/evaldata, "
             "then pip install -e .)")


class BrokenInstall(UserError, OSError):
    """A shipped data file that is missing, unreadable or not the bytes its manifest pins."""


@functools.lru_cache(maxsize=1)
def manifest() -> dict[str, dict]:
    """{name: manifest entry (name, file, sha256, bytes, licence, source, python)}."""
    path = HERE / MANIFEST
    try:
        entries = json.loads(path.read_text())["data"]
        return {e["name"]: dict(e) for e in entries}
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise BrokenInstall(f"{path} is missing or damaged ({type(e).__name__}); {REINSTALL}") from None


def source(name: str) -> dict:
    """What names shipped data `name` in results: {name, sha256, licence, source}. The file is checked
    against its sha256 first, so a name given is a name that holds."""
    read_bytes(name)
    entry = _entry(name)
    return {k: entry[k] for k in ("name", "sha256", "licence", "source")}


def _entry(name: str) -> dict:
    entries = manifest()
    if name not in entries:
        raise KeyError(f"no shipped data named {name!r}; there is {', '.join(sorted(entries))}")
    return entries[name]


@functools.lru_cache(maxsize=None)
def read_bytes(name: str) -> bytes:
    """The unpacked bytes of shipped data `name`, checked against the manifest's sha256 (once per process)."""
    entry = _entry(name)
    path = HERE / entry["file"]
    try:
        data = gzip.decompress(path.read_bytes())
    except (OSError, EOFError, zlib.error) as e:
        raise BrokenInstall(f"{path} cannot be read ({type(e).__name__}: {e}): the install is damaged; {REINSTALL}") \
            from None
    got = hashlib.sha256(data).hexdigest()
    if got != entry["sha256"]:
        raise BrokenInstall(f"{path} has sha256 {got[:12]}..., not the {entry['sha256'][:12]}... its manifest pins: "
                            f"the install is damaged; {REINSTALL}")
    return data


def language_reference() -> str:
    """The default real text: the Python Language Reference as shipped (about 466 KB)."""
    return _text()


@functools.lru_cache(maxsize=1)
def _text() -> str:
    return read_bytes(LANGUAGE_REFERENCE).decode("utf-8")


@functools.lru_cache(maxsize=1)
def heldout_docs() -> tuple[np.ndarray, ...]:
    """The zoo's held-out files as int16 byte ids (0..255), one array per file, in the training order."""
    return tuple(np.frombuffer(data, dtype=np.uint8).astype(np.int16) for _, data in unpack(read_bytes(HELDOUT)))


def heldout_names() -> list[str]:
    """The held-out files' paths relative to the standard library, in order."""
    return [name for name, _ in unpack(read_bytes(HELDOUT))]


# ---- the held-out container: a JSON line [[path, bytes], ...], then the files' bytes back to back ---------
def pack(docs: Sequence[tuple[str, bytes]]) -> bytes:
    header = json.dumps([[name, len(data)] for name, data in docs]).encode()
    return header + b"\n" + b"".join(data for _, data in docs)


def unpack(blob: bytes) -> list[tuple[str, bytes]]:
    cut = blob.index(b"\n")
    out, at = [], cut + 1
    for name, n in json.loads(blob[:cut]):
        out.append((name, blob[at:at + n]))
        at += n
    if at != len(blob):
        raise ValueError(f"the container holds {len(blob) - at} bytes past its last file")
    return out


def sha256_file(path: str | Path) -> str:
    """The sha256 of a file's bytes, read in 1 MiB pieces."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


__all__ = ["BrokenInstall", "HELDOUT", "LANGUAGE_REFERENCE", "heldout_docs", "heldout_names", "language_reference",
           "manifest", "read_bytes", "sha256_file", "source"]
