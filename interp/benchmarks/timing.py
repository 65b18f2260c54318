"""Timing and table helpers shared by the benchmarks."""

from __future__ import annotations

import contextlib
import gc
import platform
import statistics
import time
from typing import Callable, Sequence

import torch


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
    import interp

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


def compare_times(
    fns: dict[str, Callable[[], object]],
    repeats: int = 5,
    warmup: int = 1,
    budget: float | None = None,
    min_repeats: int = 2,
) -> tuple[dict[str, float], int]:
    """Median wall time of each `fns[name]()` in seconds, and the number of timed rounds.

    The implementations run interleaved, one round at a time (a round runs each once, its order
    rotated every round), so that a change in the machine's load hits all of them alike and their
    ratios stay meaningful on a shared machine. `warmup` untimed rounds come first. With `budget`
    (seconds), the number of timed rounds is what fits in it judging by the last warm-up round (or,
    without warm-up, the first timed round): at least `min_repeats`, at most `repeats`."""
    names = list(fns)
    round_time = 0.0
    for _ in range(warmup):
        start = time.perf_counter()
        for name in names:
            fns[name]()
        round_time = time.perf_counter() - start
    times: dict[str, list[float]] = {name: [] for name in names}
    rounds, r = repeats, 0
    while r < rounds:
        order = names[r % len(names):] + names[: r % len(names)]
        for name in order:
            times[name].append(_timed(fns[name]))
        if r == 0 and not round_time:
            round_time = sum(ts[0] for ts in times.values())
        if r == 0 and budget is not None and round_time > 0 and budget < float("inf"):
            rounds = max(min(min_repeats, repeats), min(repeats, int(budget / round_time)))
        r += 1
    return {name: statistics.median(ts) for name, ts in times.items()}, rounds


def _timed(fn: Callable[[], object]) -> float:
    """One call's wall time, with Python's cyclic garbage collector paused during it (the young
    generations are collected first; a full collection takes ~1 s once transformers and
    TransformerLens are loaded, so it runs between sections, not between calls)."""
    gc.collect(1)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    with _gc_paused():
        t0 = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return time.perf_counter() - t0


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
    """(peak bytes that `fn()` added, its result).

    CUDA: `max_memory_allocated` above what was allocated before. CPU (Linux): the growth of the
    process's resident set, from its size before the call to its high-water mark during it; the mark
    (VmHWM) is reset first through /proc/self/clear_refs, freed heap is handed back to the OS
    (malloc_trim) and the cyclic garbage collector is paused during the call, so that the call
    cannot reuse memory an earlier one left behind. None where neither is available. What the
    result holds (e.g. a cache) counts: it is alive at the peak."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        out = fn()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base, out
    gc.collect(1)
    _malloc_trim()
    if not _reset_rss_peak():
        return None, fn()
    base = _proc_status("VmRSS")
    with _gc_paused():  # garbage that is still allocated cannot be handed to fn's allocations mid-call
        out = fn()
    return _proc_status("VmHWM") - base, out


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
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def available_bytes() -> int | None:
    """MemAvailable (Linux), or None."""
    try:
        return _meminfo("MemAvailable")
    except (OSError, KeyError):
        return None


def total_bytes() -> int | None:
    try:
        return _meminfo("MemTotal")
    except (OSError, KeyError):
        return None


def _meminfo(field: str) -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


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
