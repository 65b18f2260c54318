"""Timing and table helpers shared by the benchmarks."""

from __future__ import annotations

import contextlib
import functools
import gc
import platform
import statistics
import time
from typing import Callable, Sequence

import torch

from interp.models.placement.memory import meminfo


def median_time(fn: Callable[[], object], repeats: int = 5, warmup: int = 1) -> float:
    """Median wall time of `fn()` in seconds over `repeats` runs after `warmup` runs."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def format_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A Markdown table (readable in a terminal too)."""
    cells = [[_fmt(c) for c in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)]
    line = lambda r: "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |"  # noqa: E731
    return "\n".join([line(headers), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *(line(r) for r in cells)])


def _fmt(x: object) -> str:
    if isinstance(x, float):
        return f"{x:.3g}" if abs(x) < 1000 else f"{x:,.0f}"
    return str(x)


def machine_summary() -> str:
    import interp  # imported when the section runs: a section loads only what it measures

    parts = [
        f"{platform.processor() or platform.machine()}",
        f"{torch.get_num_threads()} threads",
        f"python {platform.python_version()}",
        f"torch {torch.__version__}",
        f"interp {interp.__version__}",
    ]
    try:
        import transformers

        parts.append(f"transformers {transformers.__version__}")
    except ImportError:
        pass
    if torch.cuda.is_available():
        parts.append(torch.cuda.get_device_name())
    return ", ".join(parts)


# ---- several implementations timed side by side ---------------------------------------------


CLOCKS: dict[str, Callable[[], float]] = {
    "wall": time.perf_counter,
    # CPU time of this process (all its threads, user + system): what the OS gave *us*. On a shared,
    # oversubscribed machine the wall clock also counts the time slices other jobs got; with one
    # torch thread, CPU time is close to the wall time an idle machine would show.
    "cpu": time.process_time,
}


def default_clock(device: str | torch.device = "cpu", threads: int | None = None) -> str:
    """"cpu" for single-threaded CPU runs (steady under load), else "wall" (GPU work, or several
    threads whose CPU time would add up rather than overlap)."""
    threads = torch.get_num_threads() if threads is None else threads
    return "cpu" if torch.device(device).type == "cpu" and threads == 1 else "wall"


def clock_fn(clock: str) -> Callable[[], float]:
    """The CLOCKS function called `clock` ("auto": `default_clock()`)."""
    return CLOCKS[default_clock() if clock == "auto" else clock]


def compare_times(
    fns: dict[str, Callable[[], object]],
    repeats: int = 5,
    warmup: int = 1,
    budget: float | None = None,
    min_repeats: int = 2,
    clock: str = "wall",
    focus: Sequence[str] | None = None,
) -> tuple[dict[str, float], int]:
    """Median time of each `fns[name]()` in seconds (on `clock`, a CLOCKS name), and the number of
    timed rounds.

    The implementations run interleaved, one round at a time (a round runs each once, its order
    rotated every round), so that a change in the machine's load hits all of them alike and their
    ratios stay meaningful on a shared machine. `warmup` untimed rounds come first. With `budget`
    (seconds), the number of timed rounds is what fits in it judging by the last warm-up round (or,
    without warm-up, the first timed round): at least `min_repeats`, at most `repeats`.

    `focus` (default: all) names the implementations whose ratio is the headline: only they run in
    every round (and only their time counts against the budget); the others stop after
    `min_repeats` rounds."""
    names = list(fns)
    focus = names if focus is None else [n for n in names if n in focus]
    now = clock_fn(clock)
    warm: dict[str, float] = {}
    for _ in range(warmup):
        for name in names:
            start = now()
            fns[name]()
            warm[name] = now() - start
    times: dict[str, list[float]] = {name: [] for name in names}
    rounds, r = repeats, 0
    while r < rounds:
        active = [n for n in names if n in focus or r < min_repeats]
        order = active[r % len(active):] + active[: r % len(active)]
        for name in order:
            times[name].append(_timed(fns[name], now))
        if r == 0 and budget is not None and budget < float("inf"):
            round_time = sum((warm or {n: times[n][0] for n in names})[n] for n in focus)
            if round_time > 0:
                rounds = max(min(min_repeats, repeats), min(repeats, int(budget / round_time)))
        r += 1
    return {name: statistics.median(ts) for name, ts in times.items()}, rounds


def _timed(fn: Callable[[], object], now: Callable[[], float] = time.perf_counter) -> float:
    """One call's time on the clock `now`, with Python's cyclic garbage collector paused during it (the young
    generations are collected first; a full collection takes ~1 s once transformers and
    TransformerLens are loaded, so it runs between sections, not between calls)."""
    gc.collect(1)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    with _gc_paused():
        t0 = now()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return now() - t0


@contextlib.contextmanager
def _gc_paused():
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


# ---- peak memory -------------------------------------------------------------------------------


def peak_memory(fn: Callable[[], object], device: str | torch.device = "cpu") -> tuple[int | None, object]:
    """(peak bytes that `fn()` added, its result); see `measure_memory`."""
    box: list = []
    peak, _ = measure_memory(fn, device, keep=box.append)
    return peak, box[0]


def measure_memory(
    fn: Callable[[], object], device: str | torch.device = "cpu", keep: Callable[[object], object] | None = None,
) -> tuple[int | None, int | None]:
    """(peak bytes `fn()` added while it ran, bytes still held once its result is dropped).

    `keep(result)` runs before the result is dropped (to read what it holds). What the result holds
    (e.g. a cache) counts in the peak: it is alive at the end of the call. "Held" is what stays
    allocated after the caller lets go of the result: state a library keeps between calls.

    CUDA: `max_memory_allocated` / `memory_allocated` above what was allocated before. CPU (Linux):
    the process's resident set, from its size before the call to its high-water mark during it (VmHWM,
    reset through /proc/self/clear_refs). To make that the memory the call itself used, freed heap
    is handed back to the OS first (malloc_trim), the cyclic garbage collector is paused during the
    call, and glibc serves every allocation above 128 KiB by its own mmap during the call, so that
    freed memory leaves the resident set at once instead of lingering, depending on the allocator's
    history, for reuse (without this the same call measured +-30%). Afterwards glibc is left with a
    fixed 32 MiB threshold, the value its dynamic threshold climbs to in a long torch run. None where
    neither is available."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        out = fn()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
        if keep is not None:
            keep(out)
        del out
        gc.collect(1)
        return peak, torch.cuda.memory_allocated() - base
    gc.collect(1)
    with _exact_allocator():
        _malloc_trim()
        if not _reset_rss_peak():
            out = fn()
            if keep is not None:
                keep(out)
            return None, None
        base = _proc_status("VmRSS")
        with _gc_paused():  # garbage that is still allocated cannot be handed to fn's allocations mid-call
            out = fn()
        peak = _proc_status("VmHWM") - base
        if keep is not None:
            keep(out)
        del out
        gc.collect(1)
        _malloc_trim()
        return peak, max(0, _proc_status("VmRSS") - base)


_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc mallopt parameters


@contextlib.contextmanager
def _exact_allocator():
    libc = _libc()
    if libc is None:
        yield
        return
    libc.mallopt(_M_MMAP_THRESHOLD, 128 * 2**10)
    try:
        yield
    finally:
        libc.mallopt(_M_MMAP_THRESHOLD, 32 * 2**20)
        libc.mallopt(_M_TRIM_THRESHOLD, 64 * 2**20)


@functools.lru_cache(maxsize=None)
def _libc():
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt, libc.malloc_trim  # glibc only
        return libc
    except (OSError, AttributeError):
        return None


def _reset_rss_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # Linux >= 4.0: reset the peak resident set size (VmHWM) to the current one
        return _proc_status("VmHWM") > 0
    except OSError:
        return False


def _proc_status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def _malloc_trim() -> None:
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)


def available_bytes() -> int | None:
    """MemAvailable (Linux), or None."""
    return meminfo("MemAvailable")


def total_bytes() -> int | None:
    return meminfo("MemTotal")


def fmt_bytes(n: float | None) -> str:
    if n is None:
        return "n/a"
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}" if unit == "GiB" else f"{n / size:.0f} {unit}"
    return f"{n:.0f} B"


def versions() -> dict[str, str]:
    """Versions of the libraries the benchmarks compare (absent ones left out)."""
    from importlib import metadata

    out = {"python": platform.python_version(), "torch": torch.__version__}
    for dist in ("interp", "transformers", "transformer-lens", "triton"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            pass
    return out
