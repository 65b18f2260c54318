"""Run the chosen benchmark sections in one process, print each table as it is done, write the page.

    interp bench                                  # everything, full sizes, -> BENCHMARKS.md
    interp bench --quick --out /tmp/bench.md      # tiny sizes, seconds
    python -m interp.benchmarks.suite --sections forward,ablation --threads 1

The sections (`SECTIONS`, in page order) are functions `Options -> Section`; see each module.
"""

from __future__ import annotations

import datetime as _dt
import gc
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Callable, Sequence

import torch

from . import (ablation, atlas, caching, forward, generation, gpu, head_scan, kv_cache, kv_policies, long_context, patching,
               real_model, saes, scale, stats_kernel, window_bands, wrapped)
from interp.analyses.store import atomic_write_text
from interp.errors import UserError, check_threads

from .report import WRITTEN_BY, Options, Section, load_average, render
from .timing import default_clock

SECTIONS: dict[str, Callable[[Options], Section]] = {
    "forward": forward.section,
    "cache": caching.section,
    "long_context": long_context.section,
    "ablation": ablation.section,
    "generation": generation.section,
    "patching": patching.section,
    "real_model": real_model.section,
    "gemma3": real_model.gemma3_section,
    "scale": scale.section,
    "head_scan": head_scan.section,
    "kv_cache": kv_cache.section,
    "kv_policies": kv_policies.section,
    "window_bands": window_bands.section,
    "stats_kernel": stats_kernel.section,
    "wrapped": wrapped.section,
    "atlas": atlas.section,
    "saes": saes.section,
}
ALL = (*SECTIONS, "gpu")


def run(
    opts: Options,
    sections: Sequence[str] = ALL,
    *,
    out: str | Path | None = "BENCHMARKS.md",
    command: str = "interp bench",
    threads: int | None = None,
    echo: Callable[[str], None] = print,
    keep_going: bool = True,
) -> list[Section]:
    """Run `sections` (names from ALL), echo each as Markdown when done, write the page to `out`.

    A section that raises is reported (its traceback's last line) and, with keep_going, the rest run."""
    unknown = [s for s in sections if s not in ALL]
    if unknown:
        raise ValueError(f"unknown benchmark sections {unknown}; choose from {list(ALL)}")
    if out:
        check_page(Path(out))  # before any benchmark runs
    if check_threads(threads):
        torch.set_num_threads(threads)
    threads = torch.get_num_threads()
    if opts.clock == "auto":
        opts = opts.replace(clock=default_clock(opts.device, threads))
    started, t0, load = _dt.datetime.now(), time.perf_counter(), load_average()
    done: list[Section] = []
    for key in [s for s in ALL if s in sections]:
        echo(f"[interp bench] {key} ...")
        t = time.perf_counter()
        try:
            if key == "gpu":
                section = gpu.section(opts, SECTIONS, sections)
            else:
                section = SECTIONS[key](opts)
        except Exception as e:  # a benchmark that breaks must say so on the page, not hide
            if not keep_going:
                raise
            traceback.print_exc(file=sys.stderr)
            section = Section(key, key, skipped=f"failed: {type(e).__name__}: {e}")
        section.seconds = time.perf_counter() - t
        gc.collect()  # the section's models, in full, before the next one measures memory
        done.append(section)
        echo(section.markdown(level=2) + "\n")
    page = render(done, command=command, threads=threads, started=started, wall=time.perf_counter() - t0, options=opts,
                  load_at_start=load)
    if out:
        check_page(Path(out))  # again: the benchmarks took minutes, and a file may have appeared there meanwhile
        atomic_write_text(Path(out), page)
        echo(f"[interp bench] wrote {out} ({time.perf_counter() - t0:.0f} s)")
    return done


def check_page(out: Path) -> None:
    """The page `out` is interp bench's to write: not a link (it would overwrite what the link points at), not a
    folder, and either new or a page interp bench wrote (its `WRITTEN_BY` line); its folder exists and is writable.
    One line otherwise (a `UserError`), before any benchmark runs. The page is then written atomically."""
    if out.is_symlink():
        raise UserError(f"--out {out} is a symbolic link: interp bench never writes through a link (it would overwrite "
                        "what it points at); remove the link, or give another --out file")
    if out.is_dir():
        raise UserError(f"--out {out} is a folder: give the Markdown file to write, e.g. {out / 'BENCHMARKS.md'}")
    if out.exists():
        try:
            with open(out, encoding="utf-8", errors="replace") as f:
                head = f.read(4096)
        except OSError as e:
            raise UserError(f"cannot read {out} ({e.strerror}): give another --out file") from None
        if WRITTEN_BY not in head:
            raise UserError(f"{out} exists and was not written by interp bench: move it away, or give another --out "
                            "file (interp never overwrites a file it did not write)")
    folder = out.absolute().parent
    if not folder.is_dir():
        raise UserError(f"--out {out}: the folder {folder} does not exist")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise UserError(f"cannot write to {folder} (permission denied): give an --out file in a folder you can write to")


def main(argv: Sequence[str] | None = None) -> int:
    from interp.cli import main as cli_main  # imported when the section runs: a section loads only what it measures

    return cli_main(["bench", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    raise SystemExit(main())
