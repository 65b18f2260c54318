"""How the shipped evaluation data was made: `python -m interp.analyses.evaldata.make [--out DIR]`.

Run once, on CPython 3.11.7 (the Python the zoo was trained with and the README's numbers were first
measured on), to write the files beside it and `manifest.json`. Every analysis reads the written
files (`interp.analyses.evaldata`), never the running Python's, so this is the only module that looks
at the local standard library: rerunning it on another Python writes other data (and other hashes),
which is why the files are committed and shipped, not rebuilt at install time.

  python-language-reference   `pydoc_data.topics.topics`, every topic sorted by name, joined by blank
                              lines (what `data` read from the running Python before): UTF-8 text.
  python-stdlib-heldout       the zoo's held-out split of the standard library's `.py` sources (every
                              20th file in sorted order, `training.load_corpus`): the files the zoo
                              never trained on, as bytes, in the container `evaldata.pack` writes.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import platform
import shutil
import sysconfig
from pathlib import Path

from . import HELDOUT, LANGUAGE_REFERENCE, LICENCE, MANIFEST, pack
from interp.models.zoo.training import load_corpus, stdlib_files

EVAL_EVERY = 20  # training.load_corpus's default: every 20th file is held out


def _gzip(data: bytes, path: Path) -> None:
    path.write_bytes(gzip.compress(data, compresslevel=9, mtime=0))  # mtime 0: the same bytes on every run


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=str(Path(__file__).parent), help="folder to write (default: this package)")
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    version = platform.python_version()
    stdlib = Path(sysconfig.get_paths()["stdlib"])

    from pydoc_data.topics import topics

    text = "\n\n".join(topics[k] for k in sorted(topics)).encode("utf-8")
    files = stdlib_files(stdlib)[::EVAL_EVERY]
    docs = [(f.relative_to(stdlib).as_posix(), f.read_bytes()) for f in files]
    corpus = load_corpus(stdlib, eval_every=EVAL_EVERY)
    assert [d.size for d in corpus.eval_docs] == [len(b) for _, b in docs]  # the same split as training's
    heldout = pack(docs)

    entries = []
    for name, data, source in (
        (LANGUAGE_REFERENCE, text,
         f"CPython {version} Lib/pydoc_data/topics.py: the `topics` dict, every topic sorted by name, joined by "
         "blank lines (UTF-8)"),
        (HELDOUT, heldout,
         f"CPython {version} Lib/**/*.py (site-packages excluded), sorted by relative path, every {EVAL_EVERY}th file: "
         f"the {len(docs)} files the zoo never trained on (its training corpus: sha256 {corpus.sha256}), as bytes"),
    ):
        file = f"{name}-{version}.{'txt' if name == LANGUAGE_REFERENCE else 'bin'}.gz"
        _gzip(data, out / file)
        entries.append({"name": name, "file": file, "sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data),
                        "licence": "PSF-2.0 (Python Software Foundation License Version 2; the text is in "
                                   f"{LICENCE} beside this file)", "source": source, "python": version})
    shutil.copyfile(stdlib / "LICENSE.txt", out / LICENCE)
    (out / MANIFEST).write_text(json.dumps({"format": 1, "data": entries}, indent=2) + "\n")
    for e in entries:
        print(f"{e['name']}: {e['file']} ({(out / e['file']).stat().st_size:,} bytes; {e['bytes']:,} unpacked), "
              f"sha256 {e['sha256']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
