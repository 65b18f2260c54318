"""Wrapped models: transformers' own SDPA forward vs the same model under interp's attention function.

    interp bench --sections wrapped

For each architecture, two copies of one random-init transformers model (the same seed): one as
transformers runs it (its default attention, SDPA), one wrapped by interp (`interp.from_hf`, so
transformers calls interp's attention function, which runs SDPA while nothing is hooked). Timed
interleaved, round by round: the plain forward of each, interp's `run_with_cache` of every hook point
(patterns of every layer: the instrumented path everywhere), and TransformerLens 4's bridge
`run_with_cache` on a third copy, where transformer-lens is installed.
"""

from __future__ import annotations

import torch

from .report import Options, Section, Table
from .timing import compare_times

ARCHITECTURES = ("phi", "starcoder2", "cohere", "olmoe")
FULL = dict(hidden_size=768, num_attention_heads=12, num_key_value_heads=4, num_hidden_layers=6, intermediate_size=2048,
            vocab_size=8192, max_position_embeddings=4096)
TINY = dict(hidden_size=48, num_attention_heads=6, num_key_value_heads=2, num_hidden_layers=2, intermediate_size=72,
            vocab_size=97, max_position_embeddings=256)
EXTRA = {"olmoe": dict(num_experts=8, num_experts_per_tok=2), "starcoder2": dict(sliding_window=None)}


def _models(model_type: str, size: dict):
    import transformers
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    cls = getattr(transformers, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type])
    def make():  # a config of its own each: wrapping a model points its config at interp's attention
        config = AutoConfig.for_model(model_type, **size, **EXTRA.get(model_type, {}), pad_token_id=0, bos_token_id=1,
                                      eos_token_id=2)
        torch.manual_seed(0)
        return cls(config).eval()

    return make


def section(opts: Options) -> Section:
    try:
        import transformers  # noqa: F401 - optional
    except ImportError:
        return Section("wrapped", "Wrapped models", skipped="transformers is not installed")
    import interp  # imported when the section runs: a section loads only what it measures

    try:
        # imported when the section runs: a section loads only what it measures
        from interp.interop import bridge_from_hf
        import transformer_lens  # noqa: F401
    except ImportError:
        bridge_from_hf = None
    size = TINY if opts.quick else FULL
    n = 32 if opts.quick else 1024
    rows = []
    for model_type in ARCHITECTURES:
        make = _models(model_type, size)
        hf, ours = make(), interp.from_hf(make())
        bridge = bridge_from_hf(make(), copy_model=False) if bridge_from_hf is not None else None
        tokens = torch.randint(3, size["vocab_size"], (1, n), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            diff = float((hf(tokens).logits - ours(tokens)).abs().max())
        fns = {
            "hf": lambda: hf(tokens),
            "ours": lambda: ours(tokens),
            "ours_cache": lambda: ours.run_with_cache(tokens),
        }
        if bridge is not None:
            fns["bridge_cache"] = lambda: bridge.run_with_cache(tokens)
        with torch.no_grad():
            times, runs = compare_times(fns, repeats=opts.repeats, warmup=opts.warmup, budget=opts.budget,
                                        min_repeats=opts.min_repeats, clock="wall")
        t = {k: v * 1e3 for k, v in times.items()}
        rows.append([model_type, hf.config._attn_implementation, f"{t['hf']:.1f} ms", f"{t['ours']:.1f} ms",
                     f"{times['ours'] / times['hf']:.3f}x", f"{t['ours_cache']:.1f} ms",
                     f"{t['bridge_cache']:.1f} ms" if "bridge_cache" in t else "not installed",
                     f"{times['bridge_cache'] / times['ours_cache']:.2f}x" if "bridge_cache" in t else "",
                     f"{diff:.1e}", runs])
        del hf, ours, bridge
    shape = ", ".join(f"{k}={v}" for k, v in size.items())
    return Section(
        "wrapped", "Wrapped models: interp's attention function inside transformers",
        intro="A non-native architecture runs as transformers' own model with interp's attention function registered in "
              "its attention interface. The plain forward should cost what transformers' own SDPA forward costs; "
              "caching every hook point (patterns of every layer) is compared with TransformerLens 4's bridge doing the "
              "same on the same weights.",
        tables=[Table("", ["architecture", "transformers' attention", "transformers forward", "wrapped forward",
                           "wrapped / transformers", "wrapped run_with_cache (all hooks)", "bridge run_with_cache",
                           "bridge / wrapped (cache)", "max abs logit diff", "runs"], rows)],
        notes=[f"random-init models, {shape}; batch 1 x {n} tokens, float32, on {opts.device}; wall-clock medians, "
               "every function interleaved round by round; forwards under torch.no_grad"])


def main(argv=None) -> int:
    from .entry import section_main  # imported when the section runs: a section loads only what it measures

    return section_main("wrapped", section, __doc__, argv)


if __name__ == "__main__":
    raise SystemExit(main())
