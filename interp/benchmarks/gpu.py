"""GPU: the other sections' tables again on CUDA, plus the Triton streaming-statistics kernel vs SDPA's
flash forward. Without CUDA the section says it was skipped and why.

    interp bench --sections gpu                      # on a machine with a CUDA GPU

The kernel table times, per sequence length, on one [batch 1, 8 heads, n, 64] bfloat16 problem:
SDPA's causal forward restricted to FlashAttention (`sdpa_kernel(SDPBackend.FLASH_ATTENTION)`: the
output only, the cheapest attention there is), our streaming statistics with the Triton kernel and
with the torch tiled reference (`interp.kernels.attention_stats`: previous-token / duplicate /
induction mass, sink, entropy, max, distance per query, never the pattern).
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from .report import Options, Section, Table
from .timing import compare_times, fmt_bytes, peak_memory

HEADS, D_HEAD = 8, 64


def kernel_table(opts: Options, device: str = "cuda", backends=("triton", "torch"), dtype=torch.bfloat16) -> Table:
    from interp.kernels import attention_stats

    rows = []
    for n in sorted(opts.long_seqs):
        gen = torch.Generator().manual_seed(n)
        q, k, v = (torch.randn(1, HEADS, n, D_HEAD, generator=gen).to(device=device, dtype=dtype) for _ in range(3))
        half = torch.randint(0, 1000, (1, (n + 1) // 2), generator=gen)
        tokens = torch.cat([half, half], dim=1)[:, :n].to(device)
        fns = {"sdpa": lambda: _flash(q, k, v)}
        for b in backends:
            fns[b] = lambda b=b: attention_stats(q, k, tokens, backend=b)
        t, rounds = compare_times(fns, opts.repeats, opts.warmup, opts.budget, opts.min_repeats, opts.clock)
        peaks = {name: peak_memory(fn, device)[0] for name, fn in fns.items()}
        row = [n, 1e3 * t["sdpa"], fmt_bytes(peaks["sdpa"])]
        for b in ("triton", "torch"):
            row += [1e3 * t[b], fmt_bytes(peaks[b]), t[b] / t["sdpa"]] if b in t else ["-", "-", "-"]
        rows.append(row + [rounds])
    headers = ["seq", "SDPA ms", "SDPA peak", "triton stats ms", "triton peak", "triton / SDPA",
               "torch stats ms", "torch peak", "torch / SDPA", "rounds"]
    return Table(f"Streaming statistics kernel vs SDPA forward ({dtype}, {HEADS} heads of {D_HEAD}, causal, on {device})",
                 headers, rows)


def _flash(q, k, v):
    ctx = contextlib.nullcontext()
    if q.is_cuda:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        ctx = sdpa_kernel(SDPBackend.FLASH_ATTENTION)
    with ctx:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def section(opts: Options, others: dict | None = None, selected=()) -> Section:
    """`others`: {key: section function} of the sections to repeat on the GPU (those in `selected`)."""
    if not torch.cuda.is_available():
        return Section("gpu", "GPU", skipped=(
            "no CUDA device on this machine (`torch.cuda.is_available()` is False), so there are no GPU "
            "tables and no Triton-vs-flash comparison here; run `interp bench --sections gpu` on a GPU machine."
        ))
    gpu_opts = opts.replace(device="cuda", clock="wall")
    s = Section("gpu", f"GPU: {torch.cuda.get_device_name()}", intro=(
        "The sections above, rerun on the GPU (float32; memory = `torch.cuda.max_memory_allocated`), then "
        "the Triton streaming kernel against SDPA's flash forward."
    ))
    for key, fn in (others or {}).items():
        if key not in selected:
            continue
        sub = fn(gpu_opts)
        for table in sub.tables:
            table.caption = f"{sub.title} (GPU)" + (f": {table.caption}" if table.caption else "")
            s.tables.append(table)
        s.notes += [f"{key}: {n}" for n in sub.notes]
        s.headline += [f"GPU {h}" for h in sub.headline]
    table = kernel_table(gpu_opts)
    s.tables.append(table)
    ratios = [r[5] for r in table.rows if isinstance(r[5], float)]
    if ratios:
        s.headline.append(f"GPU kernel: Triton streaming statistics / SDPA flash forward time = "
                          f"{min(ratios):.2f}-{max(ratios):.2f} over seqs {[r[0] for r in table.rows]}")
    return s
