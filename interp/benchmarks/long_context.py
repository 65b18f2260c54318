"""Long-context head detection: previous-token, induction and sink scores of every head, ours
(streaming, no pattern) vs TransformerLens (cached patterns), time and peak memory.

    interp bench --sections long_context --long-seqs 1024,4096,16384,32768

Ours: `detect_heads(model, tokens, ["previous_token", "induction"], method="streaming")` and
`attention_sinks(model, tokens)` (Gu et al.'s alpha for key 0): one fused forward each, with the
streaming statistics kernel reading each layer's q/k as it is computed; memory O(n).

TransformerLens: `bridge.run_with_cache(tokens, names_filter=<every hook_pattern>, remove_batch_dim=True)`
and then exactly what `transformer_lens.head_detector.detect_head(bridge, seq, kind, cache=cache)`
does with that cache (its `get_*_detection_pattern` and `compute_head_attention_similarity_score`,
called directly because `detect_head` only takes text), and the sink score as the mean attention
on key 0 from the same cached patterns. Memory O(n^2): every layer's [head, n, n] pattern, the
n x n detection patterns, the eager attention's temporaries.

A cell that would not fit (its peak predicted from the growth measured at the smaller sizes, or
from the pattern bytes alone) is skipped and says so. "Longest context in N GiB" extrapolates the
measured growth (exponent fitted on the two largest sizes, between 1 and 2) and says so.
"""

from __future__ import annotations

import math

import torch

from .models import build_trio, long_context_shape, release_bridge_state
from .report import Options, Section, Table
from .timing import available_bytes, clock_fn, fmt_bytes, measure_memory

GIB = 2**30
KINDS = ("previous_token", "induction")
METHODS = ("ours", "tl")
TIME_CAP = 900.0  # seconds: a cell predicted to run longer than this is skipped
AVAILABLE_SHARE = 0.6  # of the memory available now: the machine is shared, an OOM kill would hit others too


def repeated_tokens(n: int, vocab: int, seed: int = 0, batch: int = 1) -> torch.Tensor:
    """Random tokens whose second half repeats the first (induction heads have something to do)."""
    half = torch.randint(1, vocab, (batch, (n + 1) // 2), generator=torch.Generator().manual_seed(seed))
    return torch.cat([half, half], dim=1)[:, :n]


@torch.no_grad()
def ours_scores(model, tokens) -> dict[str, torch.Tensor]:
    """{kind: [layer, head]} and "sink": alpha of key 0, streaming (no pattern anywhere)."""
    from interp.analyses import attention_sinks, detect_heads

    cfg = model.cfg
    frame = detect_heads(model, tokens, KINDS, method="streaming")
    out = {}
    for kind in KINDS:
        part = frame[frame.kind == kind]
        grid = torch.empty(cfg.n_layers, cfg.n_heads)
        grid[part["layer"].tolist(), part["head"].tolist()] = torch.tensor(part["score"].tolist())
        out[kind] = grid
    sinks = attention_sinks(model, tokens, n_sink=1)
    grid = torch.empty(cfg.n_layers, cfg.n_heads)
    grid[sinks["layer"].tolist(), sinks["head"].tolist()] = torch.tensor(sinks["alpha"].tolist())
    out["sink"] = grid
    return out


@torch.no_grad()
def tl_scores(bridge, tokens) -> dict[str, torch.Tensor]:
    """The same scores the TransformerLens way: cache every pattern, then `detect_head`'s scoring."""
    from transformer_lens.head_detector import (
        compute_head_attention_similarity_score,
        get_induction_head_detection_pattern,
        get_previous_token_head_detection_pattern,
    )

    cfg = bridge.cfg
    names = [f"blocks.{l}.attn.hook_pattern" for l in range(cfg.n_layers)]
    _, cache = bridge.run_with_cache(tokens, names_filter=names, remove_batch_dim=True)
    makers = {"previous_token": get_previous_token_head_detection_pattern, "induction": get_induction_head_detection_pattern}
    out = {}
    for kind in KINDS:
        detection = makers[kind](tokens.cpu()).to(tokens.device)
        grid = torch.empty(cfg.n_layers, cfg.n_heads)
        for l in range(cfg.n_layers):
            patterns = cache["pattern", l, "attn"]
            for h in range(cfg.n_heads):
                grid[l, h] = compute_head_attention_similarity_score(
                    patterns[h], detection, exclude_bos=False, exclude_current_token=False, error_measure="mul"
                )
        del detection
        out[kind] = grid
    out["sink"] = torch.stack([cache["pattern", l, "attn"][:, :, 0].float().mean(-1).cpu() for l in range(cfg.n_layers)])
    return out


def pattern_bytes(n: int, n_layers: int, n_heads: int) -> int:
    """float32 patterns of every layer: what caching them holds, before any temporary."""
    return 4 * n * n * n_heads * n_layers


def predict(points: list[tuple[int, float]], n: int, default_exponent: float) -> tuple[float, float]:
    """(predicted value at n, exponent) from measured (n_i, value_i), growing as n^p: p fitted on the two
    largest points and clamped to [1, 2] (p = default_exponent with one point)."""
    pts = sorted(p for p in points if p[1] and p[1] > 0)
    if not pts:
        return 0.0, default_exponent
    p = default_exponent
    if len(pts) >= 2 and pts[-1][0] != pts[-2][0]:
        (n1, m1), (n2, m2) = pts[-2], pts[-1]
        p = min(2.0, max(1.0, math.log(m2 / m1) / math.log(n2 / n1)))
    n_last, m_last = pts[-1]
    return m_last * (n / n_last) ** p, p


def longest_within(
    points: list[tuple[int, float]], limit: float, default_exponent: float
) -> tuple[int | None, int | None, float]:
    """(largest measured n within `limit`, n where the extrapolated growth reaches `limit`, exponent)."""
    pts = sorted(p for p in points if p[1] is not None)
    measured = max((n for n, m in pts if m <= limit), default=None)
    if not pts:
        return measured, None, default_exponent
    _, p = predict(pts, pts[-1][0], default_exponent)
    n_last, m_last = pts[-1]
    if m_last <= 0:
        return measured, None, p
    return measured, int(n_last * (limit / m_last) ** (1 / p)), p


def section(opts: Options) -> Section:
    seqs = sorted(opts.long_seqs)
    shape = long_context_shape(max(seqs), opts.long_layers)
    hf, ours, bridge = build_trio(shape, device=opts.device)
    del hf
    cfg = ours.cfg
    limit = opts.memory_limit_gib * GIB
    now = clock_fn(opts.clock)
    runners = {"ours": lambda t: ours_scores(ours, t), "tl": lambda t: tl_scores(bridge, t)}
    default_p = {"ours": 1.0, "tl": 2.0}

    warm = repeated_tokens(min(seqs[0], 128), cfg.d_vocab).to(opts.device)
    for run in runners.values():  # untimed: first-call allocations, lazy imports
        run(warm)

    measured: dict[str, list[tuple[int, float]]] = {m: [] for m in METHODS}
    timed: dict[str, list[tuple[int, float]]] = {m: [] for m in METHODS}
    rows = []
    for n in seqs:
        tokens = repeated_tokens(n, cfg.d_vocab, seed=n).to(opts.device)
        cells: dict[str, dict] = {}
        for m in METHODS:
            reason = _would_not_fit(m, n, measured[m], timed[m], limit, cfg, default_p[m], opts.device)
            if reason:
                cells[m] = {"skip": reason}
                continue
            release_bridge_state(bridge)  # the bridge keeps its last patterns between calls: start clean
            box: dict = {}
            start = now()
            peak, _ = measure_memory(lambda: runners[m](tokens), opts.device, keep=lambda out: box.update(scores=out))
            cells[m] = {"times": [now() - start], "peak": peak, "scores": box["scores"]}
            if peak is not None:
                measured[m].append((n, float(peak)))
        # more timed runs, interleaved, while they fit in the budget
        ran = [m for m in METHODS if "times" in cells[m]]
        per_round = sum(cells[m]["times"][0] for m in ran)
        extra = min(opts.repeats - 1, int(opts.budget / per_round) if per_round > 0 else 0)
        for _ in range(max(0, extra)):
            for m in ran:
                release_bridge_state(bridge)  # never hold the last patterns while computing new ones
                start = now()
                runners[m](tokens)
                cells[m]["times"].append(now() - start)
        release_bridge_state(bridge)
        for m in ran:
            ts = sorted(cells[m]["times"])
            cells[m]["time"] = ts[len(ts) // 2] if len(ts) % 2 else 0.5 * (ts[len(ts) // 2 - 1] + ts[len(ts) // 2])
            timed[m].append((n, cells[m]["time"]))
        rows.append(_row(n, cells, cfg))
    fits = _fits(measured, limit, default_p)
    s = Section(
        "long_context", "Long-context head detection: streaming vs cached patterns",
        intro=(
            "Previous-token and induction scores (TransformerLens `detect_head` semantics, error measure "
            "`mul`) and the sink score (mean attention on the first token) of every head, one sequence. "
            "Ours never materialises a pattern; TransformerLens caches every layer's pattern and scores it."
        ),
        tables=[
            Table("", ["seq", "ours time", "ours peak", "TL time", "TL peak", "TL / ours time", "TL / ours peak",
                       "max abs score diff", "fp32 patterns (all layers)", "runs"], rows),
            Table(f"Longest context whose peak fits in {opts.memory_limit_gib:g} GiB",
                  ["method", "largest measured that fits", f"where {opts.memory_limit_gib:g} GiB is reached"], fits),
        ],
        notes=_notes(cfg, opts),
    )
    headline = _headline(measured, timed, fits, opts)
    if headline is not None:
        s.headline.append(headline)
    return s


def _fits(measured: dict, limit: float, default_p: dict) -> list[list[str]]:
    """The "longest context" table's rows: per method, the largest measured size within `limit` and where the
    extrapolated growth reaches it."""
    fits = []
    for m, label in (("ours", "ours (streaming)"), ("tl", "TransformerLens (cached patterns)")):
        measured_n, extrapolated_n, p = longest_within(measured[m], limit, default_p[m])
        fits.append([
            label, "none" if measured_n is None else f"{measured_n:,}",
            "n/a" if extrapolated_n is None else f"~{extrapolated_n:,} (extrapolated, memory ~ n^{p:.2f})",
        ])
    return fits


def _notes(cfg, opts: Options) -> list[str]:
    """What the tables were measured on and how to read them (the memory available read now, at the end)."""
    avail = available_bytes()
    return [
        f"model: random-init Llama, {cfg.n_layers} layers, d_model {cfg.d_model}, {cfg.n_heads} query / {cfg.kv_heads} "
        f"key-value heads of {cfg.head_dim}, RoPE, n_ctx {cfg.n_ctx}; batch 1; tokens: random, second half repeating "
        f"the first; float32 on {opts.device}",
        f"cells are skipped when their predicted peak exceeds {opts.memory_limit_gib:g} GiB or {AVAILABLE_SHARE:.0%} "
        f"of the memory available at the time ({fmt_bytes(avail)} available at the end), or their predicted time {TIME_CAP:.0f} s",
        "max |score diff|: largest difference between our and TransformerLens's previous-token, induction "
        "and sink scores where both ran (float32 round-off)",
        "runs: timed runs per cell (ours / TL), the median shown; the first is also the memory measurement, "
        "and the big cells get one or two; one untimed warm-up of each at 128 tokens comes first",
    ]


def _headline(measured: dict, timed: dict, fits: list[list[str]], opts: Options) -> str | None:
    """The page's headline line: our largest measured size against TransformerLens's; None when ours ran at none."""
    longest_tl = max((n for n, _ in measured["tl"]), default=None)
    ours_big = max((n for n, _ in measured["ours"]), default=None)
    if ours_big is None:
        return None
    peak_big = dict(measured["ours"])[ours_big]
    return (
        f"long context: ours scores every head at {ours_big:,} tokens in {dict(timed['ours'])[ours_big]:.1f} s and "
        f"{fmt_bytes(peak_big)} peak; "
        + (f"TransformerLens ran up to {longest_tl:,} tokens here ({fmt_bytes(dict(measured['tl'])[longest_tl])} peak)"
           if longest_tl else "TransformerLens ran at no size")
        + f"; in {opts.memory_limit_gib:g} GiB: ours {fits[0][2]}, TL {fits[1][2]}"
    )


def _would_not_fit(method, n, measured, timed, limit, cfg, default_p, device) -> str | None:
    avail = None if torch.device(device).type == "cuda" else available_bytes()
    cap = limit if avail is None else min(limit, AVAILABLE_SHARE * avail)
    need, _ = predict(measured, n, default_p)
    if method == "tl":
        need = max(need, pattern_bytes(n, cfg.n_layers, cfg.n_heads))
    if need > cap:
        return f"needs ~{fmt_bytes(need)} (predicted), over {fmt_bytes(cap)}"
    secs, _ = predict(timed, n, 2.0)
    if secs > TIME_CAP:
        return f"would take ~{secs:.0f} s (predicted), over {TIME_CAP:.0f} s"
    return None


def _row(n: int, cells: dict, cfg) -> list:
    def time_of(m):
        c = cells[m]
        return f"skipped: {c['skip']}" if "skip" in c else f"{c['time']:.2f} s"

    def peak_of(m):
        c = cells[m]
        return "" if "skip" in c else fmt_bytes(c["peak"])

    both = all("time" in cells[m] for m in METHODS)
    ratio_t = cells["tl"]["time"] / cells["ours"]["time"] if both else "-"
    peaks = [cells[m].get("peak") for m in METHODS]
    ratio_m = peaks[1] / peaks[0] if both and peaks[0] and peaks[1] is not None else "-"
    diff = "-"
    if both:
        diff = max(float((cells["ours"]["scores"][k] - cells["tl"]["scores"][k]).abs().max()) for k in (*KINDS, "sink"))
        diff = f"{diff:.1e}"
    runs = "/".join(str(len(cells[m].get("times", []))) for m in METHODS)
    return [n, time_of("ours"), peak_of("ours"), time_of("tl"), peak_of("tl"), ratio_t, ratio_m, diff,
            fmt_bytes(pattern_bytes(n, cfg.n_layers, cfg.n_heads)), runs]
