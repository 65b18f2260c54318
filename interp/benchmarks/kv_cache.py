"""Quantized KV caches on SmolLM2-135M: bytes per token against the theoretical figure, and decoding
speed with each precision as a ratio to the full-precision cache, side by side in one run.

    python -m interp.benchmarks.kv_cache                    # 2,048 tokens of context, 16 decoded tokens
    interp bench --sections kv_cache

Bytes: `cache.bytes_per_token()` (the codes and float32 scales the cache holds, per token), against
2 x layers x KV heads x (d_head x bytes per code + scale bytes). Decoding: the cache is prefilled
with the context once per precision (untimed), then `new` single-token steps are timed (median of
interleaved rounds; each round resets the cache to the context length). Every step dequantizes the
whole cache of each layer before attention, which is where the time goes; a fused dequantizing
attention kernel (as serving stacks have) would read the codes directly.
"""

from __future__ import annotations


import torch

from .entry import section_main
from .report import Options, Section, Table
from .timing import compare_times

PRECISIONS = ("fp32", "fp16", "bf16", "int8", "fp8", "int4")


def _model():
    import interp  # imported when the section runs: a section loads only what it measures
    from interp.loading import ModelNotFound  # imported when the section runs: a section loads only what it measures

    try:
        return "smollm2-135m", interp.load("smollm2-135m")
    except ModelNotFound:
        return "rope-gqa-4l", interp.load("rope-gqa-4l")


def rows(opts: Options, context: int, new: int) -> tuple[str, list[list], list[list]]:
    from interp.kernels.kv_quant import bytes_per_vector

    name, model = _model()
    cfg = model.cfg
    context = min(context, cfg.n_ctx - new) if cfg.positional in ("learned", "sinusoidal") else context
    tokens = torch.randint(0, cfg.d_vocab, (1, context + new), generator=torch.Generator().manual_seed(0))
    caches, first = {}, {}
    with torch.no_grad():
        for p in PRECISIONS:
            cache = model.new_kv_cache(1, context + new, precision=p)
            model(tokens[:, :context], kv_cache=cache)
            caches[p] = cache

    def decode(p):
        def run():
            cache = caches[p]
            cache.length = context
            with torch.no_grad():
                for i in range(new):
                    out = model(tokens[:, context + i : context + i + 1], kv_cache=cache)
            first[p] = out
        return run

    times, rounds = compare_times({p: decode(p) for p in PRECISIONS}, repeats=opts.repeats, warmup=opts.warmup,
                                  budget=opts.budget, min_repeats=opts.min_repeats, clock=opts.clock)
    size = [[p, caches[p].bytes_per_token(), 2 * cfg.n_layers * cfg.kv_heads * bytes_per_vector(p, cfg.head_dim),
             caches[p].bytes_per_token() / (2 * cfg.n_layers * cfg.kv_heads * bytes_per_vector(p, cfg.head_dim))]
            for p in PRECISIONS]
    speed = [[p, times[p] / new * 1e3, times[p] / times["fp32"], rounds] for p in PRECISIONS]
    return name, size, speed


def section(opts: Options) -> Section:
    context, new = (64, 4) if opts.quick else (2048, 16)
    name, size, speed = rows(opts, context, new)
    s = Section("kv_cache", f"Quantized KV caches ({name}, {context} tokens of context)", intro=__doc__.split("\n\n", 2)[2].strip(),
                tables=[Table("Bytes per token, measured vs theoretical", ["precision", "measured B/token",
                                                                           "theoretical B/token", "ratio"], size),
                        Table(f"Decoding {new} tokens after {context}", ["precision", "ms / token", "vs fp32", "rounds"], speed)])
    s.headline = ["KV cache decode time vs fp32: " + ", ".join(f"{r[0]} {r[2]:.2f}" for r in speed[1:])]
    return s


def main(argv=None) -> int:
    return section_main("kv_cache", section, __doc__, argv)


if __name__ == "__main__":
    raise SystemExit(main())
