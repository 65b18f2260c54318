"""What every benchmark section takes (`Options`) and gives back (`Section`), and the Markdown page.

A section is a function `Options -> Section`; `interp.benchmarks.suite` runs the chosen ones in one
process and `render` writes them, with the machine, the versions, the thread count and the exact
command, into BENCHMARKS.md.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import os
import platform
from dataclasses import dataclass, field
from typing import Sequence

import torch

from .timing import format_table, fmt_bytes, total_bytes, versions


@dataclass(frozen=True)
class Options:
    """Sizes and repeat counts. `quick()` is the tiny configuration the tests run."""

    shapes: tuple[str, ...] = ("gpt2-small", "llama-small")  # forward, cache, generation
    seqs: tuple[int, ...] = (128, 512, 1024, 2048)  # forward
    batch: int = 1  # forward
    cache_seq: int = 512  # cache overhead
    long_seqs: tuple[int, ...] = (1024, 4096, 8192, 16384, 32768)  # long-context head detection
    long_layers: int = 2
    memory_limit_gib: float = 16.0  # "fits in" for the long-context table
    ablation_batch: int = 8
    ablation_seq: int = 128
    gen_batches: tuple[int, ...] = (1, 8)
    gen_prompt: int = 32
    gen_tokens: int = 32
    repeats: int = 5  # timed rounds at most (the median is reported)
    min_repeats: int = 2  # timed rounds at least
    warmup: int = 1  # untimed rounds first
    budget: float = 30.0  # seconds of timed rounds per table cell: fewer rounds for big cells
    device: str = "cpu"
    clock: str = "auto"  # "cpu" (process CPU time), "wall", or "auto": timing.default_clock
    quick: bool = False

    @classmethod
    def quick_config(cls, **overrides) -> "Options":
        tiny = dict(
            shapes=("gpt2-tiny", "llama-tiny"), seqs=(16, 64), cache_seq=32, long_seqs=(64, 256),
            ablation_batch=2, ablation_seq=32, gen_batches=(1, 2), gen_prompt=8, gen_tokens=4,
            repeats=1, min_repeats=1, budget=1.0, quick=True,
        )
        return cls(**{**tiny, **overrides})

    def replace(self, **changes) -> "Options":
        return dataclasses.replace(self, **changes)


@dataclass
class Table:
    caption: str
    headers: list[str]
    rows: list[list]

    def markdown(self) -> str:
        text = format_table(self.headers, self.rows) if self.rows else "_(no rows)_"
        return (f"**{self.caption}**\n\n" if self.caption else "") + text


@dataclass
class Section:
    """One section of the page: an explanation, tables, notes, and the lines for the headline."""

    key: str
    title: str
    intro: str = ""
    tables: list[Table] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    headline: list[str] = field(default_factory=list)
    seconds: float = 0.0
    skipped: str | None = None  # why the whole section did not run

    def markdown(self, level: int = 2) -> str:
        parts = [f"{'#' * level} {self.title}"]
        if self.skipped:
            parts.append(f"Skipped: {self.skipped}")
            return "\n\n".join(parts)
        if self.intro:
            parts.append(self.intro.strip())
        parts += [t.markdown() for t in self.tables]
        if self.notes:
            parts.append("\n".join(f"- {n}" for n in self.notes))
        parts.append(f"_Section wall time: {self.seconds:.0f} s._")
        return "\n\n".join(parts)


def machine_line() -> str:
    cpu = _cpu_model() or platform.processor() or platform.machine()
    mem = total_bytes()
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA device"
    ram = fmt_bytes(mem) + " RAM" if mem else "? RAM"
    return f"{cpu}, {os.cpu_count()} CPUs, {ram}, {platform.system()} {platform.release()}; {gpu}"


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def load_average() -> str:
    """The 1, 5 and 15 minute load averages ("" where unknown): how busy the shared machine was."""
    return _load()


def _load() -> str:
    try:
        return ", ".join(f"{x:.1f}" for x in os.getloadavg())
    except OSError:
        return ""


WRITTEN_BY = "Written by `interp bench`"  # the page's mark: `suite.check_page` overwrites only a page that has it
CLOCK_TEXT = {
    "cpu": "process CPU time (`time.process_time`), not wall time: on this shared machine the wall clock also "
           "counts the time slices other jobs get; with one torch thread, CPU time is what an idle machine's "
           "wall clock would show",
    "wall": "wall time (`time.perf_counter`, after `torch.cuda.synchronize()` on a GPU)",
}

HOW_TO_READ = """\
How to read these tables. Every comparison runs in one process on the same weights and the same
tokens: a `transformers` model built from a config with random weights (seeded, never downloaded),
converted to ours with `interp.from_hf` and wrapped by TransformerLens 4's `TransformerBridge`
(`interp.interop.bridge_from_hf`). Times (on the clock named above) are medians of interleaved
timed rounds (each round runs every implementation once, the order rotated each round) after an
untimed warm-up round; the number of rounds is given, and large cells get fewer (a time budget
per cell). The machine is shared and loaded, so absolute times are noisy: the ratios, taken
within one round-robin, are the headline. A ratio column `X / ours` is X's time divided by ours:
above 1, ours is faster. Peak memory is what one call added at its high point, its returned
output and cache included: on the CPU the growth of the process's resident set (Linux VmHWM,
reset before the call, with glibc returning freed memory at once so that the number does not
depend on the allocator's history), on a GPU `torch.cuda.max_memory_allocated`."""


def render(sections: Sequence[Section], *, command: str, threads: int, started: _dt.datetime, wall: float,
           options: Options, load_at_start: str = "") -> str:
    v = versions()
    sizes = ("--quick: tiny models, one round; the numbers are noise, the page only proves every section runs"
             if options.quick else "full")
    lines = [
        "# Benchmarks: interp side by side with TransformerLens and Hugging Face",
        "",
        f"_{WRITTEN_BY}; rerun the command below to regenerate it (do not edit by hand)._",
        "",
        f"- Command: `{command}`",
        f"- Date: {started.strftime('%Y-%m-%d %H:%M')} (total wall time {wall / 60:.1f} min)",
        f"- Machine: {machine_line()}",
        f"- Torch threads: {threads}",
        f"- Clock: {CLOCK_TEXT.get(options.clock, options.clock)}",
        f"- Load average (1, 5, 15 min) at start: {load_at_start or '?'}; at end: {_load() or '?'}",
        "- Versions: " + ", ".join(f"{k} {val}" for k, val in v.items()),
        f"- Sizes: {sizes}; forward seqs {list(options.seqs)}, long-context seqs {list(options.long_seqs)}; "
        f"at most {options.repeats} timed rounds (at least {options.min_repeats}), {options.budget:.0f} s of timed "
        "rounds per cell",
        "",
        HOW_TO_READ,
        "",
        "## Headline",
        "",
    ]
    heads = [h for s in sections for h in s.headline]
    lines += [f"- {h}" for h in heads] or ["- (no section produced a headline)"]
    lines.append("")
    for i, s in enumerate(sections, 1):
        s = dataclasses.replace(s, title=f"{i}. {s.title}")
        lines += [s.markdown(), ""]
    return "\n".join(line for line in lines if line is not None) + "\n"
