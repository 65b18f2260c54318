"""Benchmark: head statistics against the attention forward they instrument, and against a materialised pattern.

    interp bench --sections stats_kernel                          # the layer table (below)
    interp bench --sections stats_kernel --long-seqs 4096,16384

The section (`section`): per layer shape and length, side by side in one process, interleaved round by
round (`timing.compare_times`, medians): the layer's fused attention forward (`fused_attention`, SDPA;
a windowed layer in bands, as the model runs it), the statistics by the fused route (all seven, and
without `max`, whose row-max pass is the only part a fused kernel does not give), and by the old tiled
torch kernel (`backend="torch"`, the exact cross-check; it runs fewer rounds at long lengths, where a
loaded machine makes it minutes a call). Shapes: SmolLM2-135M's layer (9 query / 3 key-value heads of 64) and Gemma 3 270M's
(4 / 1 heads of 256): a local layer with its 512-token window, and the global layer.

The standalone script below (``python -m interp.benchmarks.stats_kernel``) times the statistics from a
materialised pattern against the streaming kernels, with the peak memory of each:

    python -m interp.benchmarks.stats_kernel                      # n = 1k, 4k, 16k, 64k
    python -m interp.benchmarks.stats_kernel --n 1024 4096 --heads 8 --d 128 --repeats 5
    python -m interp.benchmarks.stats_kernel --max-gib 12 --time-budget 300

Prints one table: for every n, the time and peak memory of

  (a) materialised: scores -> causal mask -> softmax -> pattern [batch, heads, n, n], then the
      statistics as sums of pattern * detection pattern (what a hook on ``hook_pattern`` does);
  (b) torch streaming: ``attention_stats(backend="torch")``;
  (c) triton streaming: ``attention_stats(backend="triton")``, only where a CUDA GPU is present.

Memory. On the CPU every cell runs in a fresh subprocess and reports the growth of its peak
resident set: ``ru_maxrss`` after the timed runs minus the resident set before them (inputs
already allocated, high-water mark reset), so cells cannot inherit each other's peaks. On CUDA it reports
``torch.cuda.max_memory_allocated`` minus the memory held before the timed runs.

Skips. The materialised cell is skipped when its estimated footprint (pattern plus one
same-sized temporary plus the n x n detection matrices, see :func:`materialised_bytes`)
exceeds ``--max-gib`` or 80% of the memory available now; any cell that runs past
``--time-budget`` seconds is stopped. The table says which and why.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time

import torch

from interp.kernels.attention import AttentionMask, fused_attention
from interp.kernels.stats import STAT_NAMES, Scoring, attention_stats
from . import entry
from .report import Options, Section, Table
from .timing import available_bytes, compare_times

GIB = 2**30
METHODS = ("materialised", "torch", "triton")

# --------------------------------------------------------------------------------------------
# The section: one attention layer's forward vs its statistics, per real layer shape
# --------------------------------------------------------------------------------------------

# name: (query heads, key-value heads, head dim, window)
LAYERS = {
    "SmolLM2-135M layer": (9, 3, 64, None),
    "Gemma 3 270M local layer": (4, 1, 256, 512),
    "Gemma 3 270M global layer": (4, 1, 256, None),
}
SECTION_SEQS = (4096, 16384)
NO_MAX = tuple(name for name in STAT_NAMES if name != "max")
OLD_ROUNDS_FROM = 8192  # from this length the old tiled kernel runs only `min_repeats` rounds (minutes a call on a loaded CPU)


def _layer_inputs(n: int, heads: int, kv_heads: int, d: int, device: str):
    gen = torch.Generator(device="cpu").manual_seed(n + 7 * heads + d)
    q = torch.randn(1, heads, n, d, generator=gen).to(device)
    k = torch.randn(1, kv_heads, n, d, generator=gen).to(device)
    v = torch.randn(1, kv_heads, n, d, generator=gen).to(device)
    half = torch.randint(0, 1000, (1, (n + 1) // 2), generator=gen)
    tokens = torch.cat([half, half], dim=1)[:, :n].to(device)  # repeated: duplicate and induction pairs exist
    return q, k, v, tokens


def _max_diff(a, b) -> float:
    """Max |a - b| over the statistics both have (distance relative to its largest value)."""
    worst = 0.0
    for name in STAT_NAMES:
        x, y = getattr(a, name), getattr(b, name)
        ok = ~(x.isnan() | y.isnan())
        if ok.any():
            d = float((x[ok] - y[ok]).abs().max())
            if name == "distance":
                d /= max(1.0, float(y[ok].abs().max()))
            worst = max(worst, d)
    return worst


def section(opts: Options) -> Section:
    seqs = (256, 1024) if opts.quick else SECTION_SEQS
    rows, ratios = [], {}
    for label, (heads, kv_heads, d, window) in LAYERS.items():
        for n in seqs:
            q, k, v, tokens = _layer_inputs(n, heads, kv_heads, d, opts.device)
            mask, scale = AttentionMask(n, n), d ** -0.5
            fns = {
                "sdpa": lambda: fused_attention(q, k, v, mask, Scoring(scale=scale, window=window)),
                "fused": lambda: attention_stats(q, k, tokens, Scoring(window=window), backend="fused"),
                "fused_no_max": lambda: attention_stats(q, k, tokens, Scoring(window=window), backend="fused", stats=NO_MAX),
                "tiled": lambda: attention_stats(q, k, tokens, Scoring(window=window), backend="torch"),
            }
            slow = n >= OLD_ROUNDS_FROM and not opts.quick
            times, rounds = compare_times(fns, repeats=opts.repeats, warmup=0 if slow else opts.warmup,
                                          budget=opts.budget, min_repeats=opts.min_repeats, clock=opts.clock,
                                          focus=["sdpa", "fused", "fused_no_max"] if slow else None)
            diff = _max_diff(fns["fused"](), fns["tiled"]())
            t = {name: times[name] for name in fns}
            rows.append([label, f"{n:,}", "-" if window is None else window,
                         f"{t['sdpa']:.3f}", f"{t['fused']:.3f}", f"{t['fused'] / t['sdpa']:.2f}x",
                         f"{t['fused_no_max']:.3f}", f"{t['fused_no_max'] / t['sdpa']:.2f}x",
                         f"{t['tiled']:.2f}", f"{t['tiled'] / t['sdpa']:.1f}x", f"{t['tiled'] / t['fused']:.1f}x",
                         f"{diff:.1e}", rounds])
            ratios[(label, n)] = (t["fused"] / t["sdpa"], t["fused_no_max"] / t["sdpa"])
            del q, k, v, tokens
    headers = ["layer", "n", "window", "SDPA forward s", "stats (fused) s", "/ SDPA", "stats w/o max s", "/ SDPA",
               "old tiled s", "/ SDPA", "old / fused", "max |fused - tiled|", "rounds"]
    all7 = [r[0] for r in ratios.values()]
    no_max = [r[1] for r in ratios.values()]
    return Section(
        "stats_kernel", "Head statistics at the fused kernel's speed (one layer, CPU)",
        intro=("One attention layer, batch 1, float32, causal, random q/k/v and a random token sequence repeated "
               "twice: the layer's fused forward (`fused_attention`: SDPA, a windowed layer in bands) against "
               "`attention_stats` by the fused route (one fused call per block of queries on [K | position | sink] "
               "and its logsumexp, the pairwise statistics gathered at the pairs found by sorting the tokens, and "
               "the row-max pass for `max`), the same without `max` (what the atlas asks for), and the old tiled "
               "kernel (`backend=\"torch\"`, per-pair features in every tile; what `backend=\"auto\"` runs when `max` is "
               "asked for, the fused route otherwise). Medians (on the page's clock), the functions "
               "interleaved round by round; the old kernel runs the minimum number of rounds from 8,192 tokens."),
        tables=[Table("", headers, rows)],
        notes=[f"on {opts.device}, {torch.get_num_threads()} threads, {opts.clock} clock; `max |fused - tiled|` is over "
               "every statistic (distance relative to its largest value)"],
        headline=[f"attention_stats / SDPA forward of the layer (CPU): fused route {min(no_max):.2f}-{max(no_max):.2f}x "
                  f"without max (what auto runs for the atlas), {min(all7):.2f}-{max(all7):.2f}x with all seven; tiled "
                  f"kernel (auto with max) {min(float(r[9][:-1]) for r in rows):.1f}-{max(float(r[9][:-1]) for r in rows):.1f}x"],
    )


# --------------------------------------------------------------------------------------------
# The three ways to get the statistics
# --------------------------------------------------------------------------------------------


def materialised_stats(q: torch.Tensor, k: torch.Tensor, tokens: torch.Tensor, n_sink: int = 1) -> dict:
    """Causal statistics from the full float32 pattern ``[batch, heads, n, n]`` (the baseline).

    Same definitions as :func:`interp.kernels.attention_stats` (TransformerLens detection
    patterns for duplicate / induction), written the direct way.
    """
    batch, heads, n, d = q.shape
    k = k.float().repeat_interleave(heads // k.shape[1], dim=1)
    scores = q.float() @ k.transpose(-1, -2) * d**-0.5
    pos = torch.arange(n, device=q.device)
    delta = (pos[:, None] - pos[None, :]).float()  # p - j
    scores.masked_fill_(delta < 0, float("-inf"))
    pattern = scores.softmax(-1)
    del scores
    same = tokens[:, :, None] == tokens[:, None, :]  # [batch, n, n]
    duplicate = same & (delta > 0)
    induction = torch.zeros_like(same)
    induction[:, :, 1:] = same[:, :, :-1] & (delta[:, 1:] >= 0)
    del same
    previous = torch.zeros(batch, heads, n, device=q.device)
    previous[..., 1:] = pattern.diagonal(offset=-1, dim1=-2, dim2=-1)
    return {
        "sink": pattern[..., :n_sink].sum(-1),
        "previous": previous,
        "duplicate": (pattern * duplicate[:, None]).sum(-1),
        "induction": (pattern * induction[:, None]).sum(-1),
        "entropy": -torch.special.xlogy(pattern, pattern).sum(-1),
        "max": pattern.amax(-1),
        "distance": (pattern * delta).sum(-1),
    }


def _streaming(backend: str):
    def run(q, k, tokens):
        return attention_stats(q, k, tokens, backend=backend)

    return run


RUNNERS = {"materialised": materialised_stats, "torch": _streaming("torch"), "triton": _streaming("triton")}


def materialised_bytes(batch: int, heads: int, n: int) -> int:
    """Estimated peak of :func:`materialised_stats`: the pattern, one same-sized float32
    temporary and slack (2.5 patterns in all), the float32 ``delta`` and the bool detection
    matrices. Measured on CPU with 4 heads: 765 MiB at n=4k (estimate 752), 10.5 GiB at 16k
    (estimate 11.75)."""
    return int(2.5 * 4 * batch * heads * n * n) + 4 * n * n + 3 * batch * n * n


# --------------------------------------------------------------------------------------------
# One cell: one method at one n
# --------------------------------------------------------------------------------------------


def make_inputs(n: int, batch: int, heads: int, kv_heads: int, d: int, dtype: torch.dtype, device: str):
    """Random q / k and a random token sequence repeated twice (so induction is non-trivial)."""
    gen = torch.Generator(device="cpu").manual_seed(0)
    q = torch.randn(batch, heads, n, d, generator=gen).to(device=device, dtype=dtype)
    k = torch.randn(batch, kv_heads, n, d, generator=gen).to(device=device, dtype=dtype)
    half = torch.randint(0, 1000, (batch, (n + 1) // 2), generator=gen)
    tokens = torch.cat([half, half], dim=1)[:, :n].to(device)
    return q, k, tokens


def run_cell(method: str, n: int, batch: int, heads: int, kv_heads: int, d: int, dtype: str,
             repeats: int, device: str, threads: int | None = None) -> dict:
    """Time ``repeats`` runs (best is reported) and measure the peak memory they add."""
    if threads:
        torch.set_num_threads(threads)
    q, k, tokens = make_inputs(n, batch, heads, kv_heads, d, getattr(torch, dtype), device)
    run = RUNNERS[method]
    cuda = device.startswith("cuda")
    warm = min(n, 256)  # compile / load everything on a small problem first
    run(q[:, :, :warm], k[:, :, :warm], tokens[:, :warm])
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        base = _reset_peak_rss()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        out = run(q, k, tokens)
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        del out
    if cuda:
        peak = torch.cuda.max_memory_allocated() - base
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base
    return {"seconds": min(times), "peak_bytes": peak}


def _reset_peak_rss() -> int:
    """Reset this process's RSS high-water mark and return the current RSS in bytes.

    Writing 5 to /proc/self/clear_refs (Linux >= 4.0) resets the mark that ``ru_maxrss``
    reports, so the growth measured afterwards is the timed runs' own, not an earlier spike
    (importing torch, building the inputs). Where that fails the baseline is still the current
    RSS, and the growth an upper bound.
    """
    try:
        with open("/proc/self/clear_refs", "w") as clear_refs:
            clear_refs.write("5")
    except OSError:
        pass
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * resource.getpagesize()
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _cell_in_subprocess(cell: dict, time_budget: float) -> dict:
    """CPU: a fresh process per cell, so ru_maxrss is this cell's own high-water mark."""
    cmd = [sys.executable, "-m", "interp.benchmarks.stats_kernel", "--cell", json.dumps(cell)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=time_budget, cwd=tempfile.gettempdir())
    except subprocess.TimeoutExpired:
        return {"skip": f"> {time_budget:.0f} s budget"}
    if proc.returncode != 0:
        reason = "killed (out of memory?)" if proc.returncode < 0 else proc.stderr.strip().splitlines()[-1][:60]
        return {"skip": reason}
    return json.loads(proc.stdout.strip().splitlines()[-1])


# --------------------------------------------------------------------------------------------
# Table
# --------------------------------------------------------------------------------------------


def _fmt_bytes(n: float) -> str:
    for unit, size in (("GiB", GIB), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n:.0f} B"


def _fmt_cell(result: dict) -> tuple[str, str]:
    if "skip" in result:
        return "skipped:", result["skip"]
    return f"{result['seconds']:.3f} s", _fmt_bytes(result["peak_bytes"])


def _check(device: str, dtype: torch.dtype, methods: list[str]) -> str:
    """Max |streaming - materialised| on a small problem (distance separately: it is in
    positions, so its float32 round-off grows with n, in both implementations alike)."""
    q, k, tokens = make_inputs(333, 1, 4, 2, 64, dtype, device)
    ref = materialised_stats(q, k, tokens)
    parts = []
    for method in methods:
        if method == "materialised":
            continue
        got = RUNNERS[method](q, k, tokens).to_dict()
        diff = {name: float((got[name] - ref[name]).abs().max()) for name in ref}
        rest = max(value for name, value in diff.items() if name != "distance")
        span = float(ref["distance"].abs().max())
        parts.append(f"{method} {rest:.1e} (distance {diff['distance']:.1e} on values up to {span:.0f})")
    return "check at n=333, GQA 4/2: max |streaming - materialised|: " + ", ".join(parts)


def main(argv: list[str] | None = None) -> int:
    parser = entry.parser("stats_kernel", "Time and peak memory of head statistics: materialised pattern vs streaming kernels.")
    parser.add_argument("--n", type=int, nargs="+", default=[1024, 4096, 16384, 65536], help="sequence lengths")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=None, help="GQA key heads (default: heads)")
    parser.add_argument("--d", type=int, default=64, help="head dimension")
    parser.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per cell; the best is shown")
    parser.add_argument("--max-gib", type=float, default=6.0, help="skip the materialised cell above this estimate")
    parser.add_argument("--time-budget", type=float, default=600.0, help="seconds per cell before it is stopped")
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    parser.add_argument("--cell", help=argparse.SUPPRESS)  # internal: run one cell, print JSON
    args = parser.parse_args(argv)

    if args.cell:
        print(json.dumps(run_cell(**json.loads(args.cell))))
        return 0

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    cuda = device.startswith("cuda")
    kv_heads = args.kv_heads or args.heads
    methods = [m for m in METHODS if m in args.methods]

    entry.apply_threads(args.threads)  # also each cell's (1 is steadier on a shared machine)
    where = f"CUDA {torch.cuda.get_device_name()}" if cuda else f"CPU, threads={torch.get_num_threads()}"
    print(
        f"attention statistics, causal, with tokens: batch={args.batch} heads={args.heads} "
        f"kv_heads={kv_heads} d={args.d} {args.dtype}; {where}; best of {args.repeats}; "
        f"peak = {'max_memory_allocated' if cuda else 'ru_maxrss growth, one subprocess per cell'}"
    )
    header = ["n", "fp32 pattern"] + [f"{m} {col}" for m in methods for col in ("time", "peak")]
    rows = []
    for n in args.n:
        pattern = 4 * args.batch * args.heads * n * n
        row = [str(n), _fmt_bytes(pattern)]
        for method in methods:
            if method == "triton" and not cuda:
                row += ["n/a", "(no CUDA)"]
                continue
            if method == "materialised":
                need = materialised_bytes(args.batch, args.heads, n)
                available = None if cuda else available_bytes()
                limit = args.max_gib * GIB if available is None else min(args.max_gib * GIB, 0.8 * available)
                if need > limit:
                    row += ["skipped:", f"~{need / GIB:.1f} GiB > {limit / GIB:.1f}"]
                    continue
            cell = dict(method=method, n=n, batch=args.batch, heads=args.heads, kv_heads=kv_heads, d=args.d,
                        dtype=args.dtype, repeats=args.repeats, device=device, threads=args.threads)
            if cuda:
                try:
                    result = run_cell(**cell)
                except torch.cuda.OutOfMemoryError:
                    result = {"skip": "CUDA out of memory"}
                    torch.cuda.empty_cache()
            else:
                result = _cell_in_subprocess(cell, args.time_budget)
            row += list(_fmt_cell(result))
            print(f"  n={n} {method}: {' '.join(row[-2:])}", file=sys.stderr, flush=True)
        rows.append(row)

    widths = [max(len(r[i]) for r in [header] + rows) for i in range(len(header))]
    line = lambda cells: "  ".join(c.rjust(w) for c, w in zip(cells, widths))  # noqa: E731
    print(line(header))
    print("  ".join("-" * w for w in widths))
    for row in rows:
        print(line(row))
    print(_check(device, getattr(torch, args.dtype), methods if cuda else [m for m in methods if m != "triton"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
