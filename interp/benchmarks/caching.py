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

from .models import build_trio, release_bridge_state
from .report import Options, Section, Table
from .timing import compare_times, fmt_bytes, measure_memory

HEADERS = [
    "shape", "cached", "tensors (ours / TL)", "cached bytes (ours / TL)", "ours ms", "TL ms", "TL / ours",
    "ours peak", "TL peak", "TL / ours peak", "held after (ours / TL)", "rounds",
]

EVERY_HOOK = "everything (names_filter=None)"
NO_RESULT = "everything but hook_result"


def filters(n_layers: int) -> dict[str, tuple[object, object]]:
    """label -> (our names_filter, the bridge's); "forward" means no cache at all."""
    res = [f"blocks.{l}.{n}" for l in range(n_layers) for n in ("hook_resid_pre", "hook_resid_mid", "hook_resid_post")]
    pat = [f"blocks.{l}.attn.hook_pattern" for l in range(n_layers)]
    return {
        "forward (no cache)": ("forward", "forward"),
        "nothing (names_filter=[])": ([], []),
        "residuals (resid_pre/mid/post)": (res, res),
        "patterns (hook_pattern)": (pat, pat),
        # Our None includes the per-head `hook_result` ([batch, pos, head, d_model] per layer), which
        # only fires when something asks for it; the bridge has no such hook by default.
        EVERY_HOOK: (None, None),
        NO_RESULT: (lambda name: not name.endswith("hook_result"), None),
    }


def cache_size(cache) -> tuple[int, int]:
    """(distinct tensors, their bytes); the bridge stores some activations under two names."""
    seen = {}
    for t in (cache.cache_dict if hasattr(cache, "cache_dict") else cache).values():
        if isinstance(t, torch.Tensor):
            seen[(t.data_ptr(), t.dtype, tuple(t.shape))] = t.numel() * t.element_size()
    return len(seen), sum(seen.values())


def _call(model, tokens, names_filter):
    if isinstance(names_filter, str) and names_filter == "forward":
        return model(tokens), {}
    return model.run_with_cache(tokens, names_filter=names_filter)


def section(opts: Options) -> Section:
    rows, notes, headline = [], [], []
    for shape in opts.shapes:
        hf, ours, bridge = build_trio(shape, device=opts.device)
        del hf
        seq = min(opts.cache_seq, ours.cfg.n_ctx)
        tokens = torch.randint(1, ours.cfg.d_vocab, (opts.batch, seq), generator=torch.Generator().manual_seed(1)).to(opts.device)
        ratios, retained = {}, 0
        for label, (mine, theirs) in filters(ours.cfg.n_layers).items():
            fns = {"ours": lambda: _call(ours, tokens, mine), "tl": lambda: _call(bridge, tokens, theirs)}
            sizes = {}
            with torch.no_grad():
                # The memory-measuring calls come first and are the (untimed) warm-up round. The bridge
                # keeps its last patterns between calls: they are dropped first, so both start clean.
                peak_o, held_o = measure_memory(fns["ours"], opts.device, keep=lambda out: sizes.update(ours=cache_size(out[1])))
                retained = max(retained, release_bridge_state(bridge))
                peak_t, held_t = measure_memory(fns["tl"], opts.device, keep=lambda out: sizes.update(tl=cache_size(out[1])))
                # Half the budget: twelve rows of two full forwards each; ratios near 1 need no more.
                t, rounds = compare_times(fns, opts.repeats, max(0, opts.warmup - 1), opts.budget / 2, opts.min_repeats,
                                          opts.clock)
            (n_o, b_o), (n_t, b_t) = sizes["ours"], sizes["tl"]
            mem_ratio = peak_t / peak_o if peak_o and peak_t is not None and peak_o > 0 else None
            rows.append([
                shape, label, f"{n_o} / {n_t}", f"{fmt_bytes(b_o)} / {fmt_bytes(b_t)}", 1e3 * t["ours"], 1e3 * t["tl"],
                t["tl"] / t["ours"], fmt_bytes(peak_o), fmt_bytes(peak_t),
                "n/a" if mem_ratio is None else mem_ratio, f"{fmt_bytes(held_o)} / {fmt_bytes(held_t)}", rounds,
            ])
            ratios[label.split(" ")[0] if label != NO_RESULT else "everything-but-result"] = (t["tl"] / t["ours"], mem_ratio)
        release_bridge_state(bridge)
        notes.append(f"{shape}: seq {seq}, batch {opts.batch}")
        if retained:
            notes.append(
                f"{shape}: after a call the bridge still holds the last attention pattern of every layer "
                f"(`attn._pattern`, up to {fmt_bytes(retained)} here, n^2 per layer); `held after` shows it, and "
                "it is released before each of its memory measurements"
            )
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
            "Ours keeps fused attention in every layer whose pattern is not asked for; only `patterns` and "
            "`everything` take the instrumented path. Our `names_filter=None` also computes the opt-in "
            "per-head `hook_result` (the bridge has none by default), so `everything but hook_result` "
            "compares like with like. `cached bytes` counts distinct tensors (the bridge files some "
            "activations under an alias too). Peak memory includes the returned cache and is measured on "
            "the first call of each, which is also the untimed warm-up; `held after` is what stays "
            "allocated once the caller drops the output and the cache."
        ),
        tables=[Table("", HEADERS, rows)],
        notes=notes,
        headline=headline,
    )
