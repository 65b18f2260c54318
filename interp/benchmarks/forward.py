"""Forward pass: our fused forward vs Hugging Face (`sdpa`, `eager`) vs TransformerLens 4's bridge.

    python -m interp.benchmarks.forward --shape gpt2-small --seq 1024
    interp bench --sections forward --seqs 128,512,1024,2048

One set of random weights per shape (GPT-2 small; a Llama of the same width with GQA and RoPE), the
same tokens for everyone, logits checked equal first. Columns: ours (fused attention everywhere,
no hooks), HF with `sdpa` and with `eager` attention, the bridge's plain forward and its
`run_with_cache()` (every hook, its default). The headline is HF sdpa / ours: ours should be within
5% of it (a ratio of at least 0.95).
"""

from __future__ import annotations

import copy

import torch

from .models import SHAPES, build_pair, build_trio, max_logit_diff, set_attention
from .report import Options, Section, Table
from .timing import compare_times, format_table, machine_summary
from .entry import apply_threads, parser

__all__ = ["SHAPES", "build_pair", "run", "section"]

VARIANTS = ("ours", "hf_sdpa", "hf_eager", "tl", "tl_cache")
FOCUS = ("ours", "hf_sdpa")  # the headline pair: timed in every round
HEADERS = [
    "shape", "seq", "ours ms", "HF sdpa ms", "HF eager ms", "TL fwd ms", "TL run_with_cache ms",
    "HF sdpa / ours", "HF eager / ours", "TL fwd / ours", "TL cache / ours", "rounds (headline pair / rest)",
]


def run(opts: Options, shapes=None) -> tuple[list[list], list[str]]:
    """Rows of the forward table and notes (logit checks, skipped sizes)."""
    rows, notes = [], []
    for shape in shapes or opts.shapes:
        hf, ours, bridge = build_trio(shape, device=opts.device)
        hf_eager = copy.deepcopy(hf)
        set_attention(hf_eager, "eager")
        vocab, n_ctx = ours.cfg.d_vocab, ours.cfg.n_ctx
        gen = torch.Generator().manual_seed(0)
        probe = torch.randint(1, vocab, (opts.batch, min(64, n_ctx)), generator=gen).to(opts.device)
        notes.append(f"{shape}: max |logit difference| ours vs HF and bridge = {max_logit_diff(probe, ours, hf, bridge):.1e}")
        warmed = False
        for seq in opts.seqs:
            if seq > n_ctx:
                notes.append(f"{shape}: seq {seq} skipped (n_ctx {n_ctx})")
                continue
            tokens = torch.randint(1, vocab, (opts.batch, seq), generator=gen).to(opts.device)
            fns = {
                "ours": lambda: ours(tokens),
                "hf_sdpa": lambda: hf(tokens, use_cache=False),
                "hf_eager": lambda: hf_eager(tokens, use_cache=False),
                "tl": lambda: bridge(tokens),
                "tl_cache": lambda: bridge.run_with_cache(tokens),
            }
            with torch.no_grad():
                # Warm-up round at the first size only: the code paths are warm after it, and a full-size
                # warm-up of every variant would double the cost of the biggest cells. The headline pair
                # (ours, HF sdpa) runs every round, on twice the budget; the others stop at min_repeats.
                t, rounds = compare_times(
                    fns, opts.repeats, 0 if warmed else opts.warmup, 2 * opts.budget, opts.min_repeats, opts.clock,
                    focus=FOCUS,
                )
            warmed = True
            o = t["ours"]
            rows.append([
                shape, seq, *(1e3 * t[v] for v in VARIANTS),
                t["hf_sdpa"] / o, t["hf_eager"] / o, t["tl"] / o, t["tl_cache"] / o,
                f"{rounds} / {min(rounds, opts.min_repeats)}",
            ])
        del hf, hf_eager, ours, bridge
    return rows, notes


def section(opts: Options) -> Section:
    rows, notes = run(opts)
    s = Section(
        "forward", "Forward pass: ours vs Hugging Face vs TransformerLens",
        intro=(
            f"Logits of one forward, batch {opts.batch}, float32 on {opts.device}. ours: fused attention "
            "(SDPA) in every layer, no hooks. HF: the same `transformers` model with `sdpa` and with "
            "`eager` attention (`use_cache=False`). TL: TransformerLens 4 `TransformerBridge` around "
            "a copy of that model, plain `bridge(tokens)` and `bridge.run_with_cache(tokens)` (every "
            "hook cached, TransformerLens's default). One untimed warm-up round per shape, at its first "
            "size; the headline pair (ours, HF sdpa) is timed in every round, the other columns in the first "
            f"{opts.min_repeats}. Target: ours within 5% of HF sdpa, i.e. HF sdpa / ours >= 0.95."
        ),
        tables=[Table("", HEADERS, rows)],
        notes=notes,
    )
    for shape in dict.fromkeys(r[0] for r in rows):
        ratios = [r[7] for r in rows if r[0] == shape]
        tl = [r[9] for r in rows if r[0] == shape]
        tlc = [r[10] for r in rows if r[0] == shape]
        s.headline.append(
            f"forward, {shape}: HF sdpa / ours = {_span(ratios)} over seqs {[r[1] for r in rows if r[0] == shape]} "
            f"(target >= 0.95: {'met' if min(ratios) >= 0.95 else 'missed at some size'}); "
            f"TL bridge forward / ours = {_span(tl)}, TL run_with_cache / ours = {_span(tlc)}"
        )
    return s


def _span(xs: list[float]) -> str:
    return f"{min(xs):.2f}" if len(xs) == 1 or f"{min(xs):.2f}" == f"{max(xs):.2f}" else f"{min(xs):.2f}-{max(xs):.2f}"


def main(argv=None) -> int:
    p = parser("forward", __doc__)
    p.add_argument("--shape", nargs="+", default=["gpt2-small"], choices=sorted(SHAPES))
    p.add_argument("--seq", nargs="+", type=int, default=[1024])
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--repeats", type=int, default=5)
    a = p.parse_args(argv)
    apply_threads(a.threads)
    opts = Options(shapes=tuple(a.shape), seqs=tuple(a.seq), batch=a.batch, repeats=a.repeats, budget=float("inf"))
    rows, notes = run(opts)
    print(machine_summary())
    print(format_table(HEADERS, rows))
    print("\n".join(notes))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
