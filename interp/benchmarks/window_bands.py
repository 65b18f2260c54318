"""Sliding-window attention at long context: ours in bands vs one call with the whole [n, n] mask.

    interp bench --sections window_bands --long-seqs 4096,8192,16384,32768

One sliding-window layer of Gemma 3 270M's shape (4 query heads, 1 key-value head of 256, window
512), float32, batch 1, causal. Ours: `fused_attention`, which runs a long windowed prefill band by
band (`kernels.attention._banded_attention`: each band of queries reads only the keys its window
reaches). The alternative: SDPA with the whole boolean [n, n] mask, which is what interp did before
and what Hugging Face's `sdpa` attention does for a windowed layer (a 4-D mask of every query and
key): O(n^2) memory and time, for a layer that reads O(n * window) pairs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from interp.kernels.attention import AttentionMask, expand_kv, fused_attention
from interp.kernels.stats import Scoring

from .report import Options, Section, Table
from .timing import available_bytes, compare_times, fmt_bytes, measure_memory

HEADS, KV_HEADS, D_HEAD, WINDOW = 4, 1, 256, 512
MASK_SHARE = 0.3  # the whole-mask call runs only where its mask and scores fit in this share of free memory


def _inputs(n: int, device: str):
    g = torch.Generator(device="cpu").manual_seed(n)
    q = torch.randn(1, HEADS, n, D_HEAD, generator=g).to(device)
    k = torch.randn(1, KV_HEADS, n, D_HEAD, generator=g).to(device)
    v = torch.randn(1, KV_HEADS, n, D_HEAD, generator=g).to(device)
    return q, k, v


def section(opts: Options) -> Section:
    rows, notes = [], []
    scale = D_HEAD ** -0.5
    for n in opts.long_seqs:
        q, k, v = _inputs(n, opts.device)
        mask = AttentionMask(n, n)

        def ours():
            return fused_attention(q, k, v, mask, Scoring(scale=scale, window=WINDOW))

        def whole():
            m = AttentionMask(n, n).visible(WINDOW, q.device)  # built per call, as a forward does
            return F.scaled_dot_product_attention(q, expand_kv(k, HEADS), expand_kv(v, HEADS), attn_mask=m, scale=scale)

        mask_bytes = n * n * (1 + 4 * HEADS)  # the bool mask, and the float scores a masked call may make per head
        fns = {"ours": ours}
        if mask_bytes <= MASK_SHARE * (available_bytes() or 0):
            fns["whole"] = whole
        times, runs = compare_times(fns, repeats=opts.repeats, warmup=opts.warmup, budget=opts.budget,
                                    min_repeats=opts.min_repeats, clock="wall")
        peaks = {name: measure_memory(fn, opts.device)[0] for name, fn in fns.items()}
        diff = float((ours() - whole()).abs().max()) if "whole" in fns else None
        rows.append([f"{n:,}", f"{times['ours'] * 1e3:.1f} ms", fmt_bytes(peaks["ours"]),
                     f"{times['whole'] * 1e3:.1f} ms" if "whole" in times else "skipped (memory)",
                     fmt_bytes(peaks.get("whole")) if "whole" in peaks else "",
                     f"{times['whole'] / times['ours']:.1f}x" if "whole" in times else "",
                     f"{diff:.1e}" if diff is not None else "", runs])
        del q, k, v
    notes.append(f"one sliding-window layer of Gemma 3 270M's shape: {HEADS} query heads, {KV_HEADS} key-value head of "
                 f"{D_HEAD}, window {WINDOW}; float32, batch 1, random q/k/v, on {opts.device}; wall-clock medians, "
                 "the two interleaved round by round")
    notes.append(f"whole mask: skipped where its [n, n] mask and per-head float scores would pass {MASK_SHARE:.0%} of "
                 "the memory free at the time")
    return Section("window_bands", "Sliding-window attention at long context: bands vs the whole mask",
                   intro="A windowed layer's prefill, ours (bands of queries, each reading the keys its window reaches) "
                         "against one SDPA call with the whole [n, n] boolean mask (interp before, and Hugging Face's "
                         "sdpa path for a sliding-window layer).",
                   tables=[Table("", ["n", "ours (bands)", "ours peak", "whole mask", "whole peak", "whole / ours",
                                      "max abs diff", "runs"], rows)],
                   notes=notes)
