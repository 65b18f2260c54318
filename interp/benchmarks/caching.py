"""Cache overhead: `run_with_cache` with patterns, with residuals only, with nothing, vs TransformerLens.

    interp bench --sections cache --cache-seq 512

For each filter, ours (`model.run_with_cache(tokens, names_filter=...)`) and the bridge's
(`bridge.run_with_cache(tokens, names_filter=...)`, the same hook names) are timed side by side and
their peak memory measured, next to a plain forward of each. What the filter asks for decides our
attention path: only layers whose pattern is cached leave the fused kernel, so "residuals" and
"nothing" cost what a forward costs; the bridge runs eager attention throughout.
"""

from __future__ import annotations

import torch

from .models import build_trio
from .report import Options, Section, Table
from .timing import compare_times, fmt_bytes, peak_memory

HEADERS = [
    "shape", "cached", "tensors (ours / TL)", "cached bytes (ours / TL)", "ours ms", "TL ms", "TL / ours",
    "ours peak", "TL peak", "TL / ours peak", "rounds",
]


def filters(n_layers: int) -> dict[str, object]:
    """label -> names_filter (None: everything; "forward": no cache at all)."""
    res = [f"blocks.{l}.{n}" for l in range(n_layers) for n in ("hook_resid_pre", "hook_resid_mid", "hook_resid_post")]
    return {
        "forward (no cache)": "forward",
        "nothing (names_filter=[])": [],
        "residuals (resid_pre/mid/post)": res,
        "patterns (hook_pattern)": [f"blocks.{l}.attn.hook_pattern" for l in range(n_layers)],
        "everything (names_filter=None)": None,
    }


def cache_size(cache) -> tuple[int, int]:
    """(distinct tensors, their bytes); the bridge stores some activations under two names."""
    seen = {}
    for t in (cache.cache_dict if hasattr(cache, "cache_dict") else cache).values():
        if isinstance(t, torch.Tensor):
            seen[(t.data_ptr(), t.dtype, tuple(t.shape))] = t.numel() * t.element_size()
    return len(seen), sum(seen.values())


def _call(model, tokens, names_filter):
    if names_filter == "forward":
        return model(tokens), {}
    return model.run_with_cache(tokens, names_filter=names_filter)


def section(opts: Options) -> Section:
    rows, notes, headline = [], [], []
    for shape in opts.shapes:
        hf, ours, bridge = build_trio(shape, device=opts.device)
        del hf
        seq = min(opts.cache_seq, ours.cfg.n_ctx)
        tokens = torch.randint(1, ours.cfg.d_vocab, (opts.batch, seq), generator=torch.Generator().manual_seed(1)).to(opts.device)
        ratios = {}
        for label, names in filters(ours.cfg.n_layers).items():
            fns = {"ours": lambda: _call(ours, tokens, names), "tl": lambda: _call(bridge, tokens, names)}
            with torch.no_grad():
                # The memory-measuring calls come first and are the (untimed) warm-up round.
                peak_ours, (_, c_ours) = peak_memory(fns["ours"], opts.device)
                (n_o, b_o) = cache_size(c_ours)
                del c_ours
                peak_tl, (_, c_tl) = peak_memory(fns["tl"], opts.device)
                (n_t, b_t) = cache_size(c_tl)
                del c_tl
                t, rounds = compare_times(fns, opts.repeats, max(0, opts.warmup - 1), opts.budget, opts.min_repeats)
            mem_ratio = peak_tl / peak_ours if peak_ours and peak_tl is not None and peak_ours > 0 else None
            rows.append([
                shape, label, f"{n_o} / {n_t}", f"{fmt_bytes(b_o)} / {fmt_bytes(b_t)}", 1e3 * t["ours"], 1e3 * t["tl"],
                t["tl"] / t["ours"], fmt_bytes(peak_ours), fmt_bytes(peak_tl),
                "n/a" if mem_ratio is None else mem_ratio, rounds,
            ])
            ratios[label.split(" ")[0]] = (t["tl"] / t["ours"], mem_ratio)
        notes.append(f"{shape}: seq {seq}, batch {opts.batch}")
        headline.append(
            f"cache, {shape} @ {seq}: TL / ours time = "
            + ", ".join(f"{k} {v[0]:.2f}" for k, v in ratios.items() if k != "forward")
            + "; peak memory TL / ours = "
            + ", ".join(f"{k} {v[1]:.2f}" for k, v in ratios.items() if k != "forward" and v[1] is not None)
        )
        del ours, bridge
    return Section(
        "cache", "Cache overhead: run_with_cache, ours vs TransformerLens",
        intro=(
            "Each row caches the named activations of one forward (float32, on the same weights and "
            "tokens). `nothing` is `run_with_cache(names_filter=[])`, the cost of the machinery alone. "
            "Ours keeps fused attention in every layer whose pattern is not asked for; only `patterns` "
            "and `everything` take the instrumented path. `cached bytes` counts distinct tensors (the "
            "bridge files some activations under an alias too). Peak memory includes the returned cache; it is "
            "measured on the first call of each, which is also the untimed warm-up."
        ),
        tables=[Table("", HEADERS, rows)],
        notes=notes,
        headline=headline,
    )
