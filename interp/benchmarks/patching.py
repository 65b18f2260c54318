"""Activation patching: TransformerLens's own sweeps on our model vs on its TransformerBridge, same weights.

    python -m interp.benchmarks.patching                                  # gpt2-4l, seq 256 and 1024
    python -m interp.benchmarks.patching --shape llama-4l --sweeps attn_head_out_all_pos attn_head_all_pos_every
    python -m interp.benchmarks.patching --shape tiny --seqs 16 --repeats 1   # seconds

Each row runs one `transformer_lens.patching` sweep, unchanged, on both models (built from one
random-init `transformers` model: ours with `interp.from_hf`, theirs with `TransformerBridge`), and
reports the median wall time of each, `speedup` = bridge time / our time (above 1: ours is faster)
and the largest difference between the two result tensors (they must agree). A sweep is one
forward per cell (`attn_head_out_all_pos`: one per (layer, head)); ours keeps fused attention in
every layer whose pattern the sweep does not patch, the bridge runs eager attention throughout.
Both run under `torch.no_grad()`. TransformerLens prints progress bars; TQDM_DISABLE=1 hides them.
"""

from __future__ import annotations

import sys
from typing import Sequence

import torch

from interp.benchmarks.timing import format_table, machine_summary, median_time
from .entry import apply_threads, parser

# transformers configs (random init, never downloaded).
SHAPES = {
    "gpt2-4l": ("GPT2Config", "GPT2LMHeadModel", dict(n_layer=4, n_embd=256, n_head=8, n_positions=2048, vocab_size=2048)),
    "llama-4l": ("LlamaConfig", "LlamaForCausalLM", dict(num_hidden_layers=4, hidden_size=256, num_attention_heads=8, num_key_value_heads=2, intermediate_size=688, vocab_size=2048, max_position_embeddings=4096)),
    "tiny": ("GPT2Config", "GPT2LMHeadModel", dict(n_layer=2, n_embd=32, n_head=4, n_positions=128, vocab_size=100)),
}

# name -> transformer_lens.patching function. resid_pre sweeps (layer, pos): n_layers * seq forwards.
SWEEPS = {
    "attn_head_out_all_pos": "get_act_patch_attn_head_out_all_pos",
    "attn_head_pattern_all_pos": "get_act_patch_attn_head_pattern_all_pos",
    "attn_head_all_pos_every": "get_act_patch_attn_head_all_pos_every",
    "resid_pre": "get_act_patch_resid_pre",
}


def build(shape: str):
    """(hf_model, ours, bridge): one set of weights, float32, eval mode."""
    import transformers

    import interp  # imported when the section runs: a section loads only what it measures
    from interp.interop import bridge_from_hf  # imported when the section runs: a section loads only what it measures

    cfg_cls, model_cls, kwargs = SHAPES[shape]
    torch.manual_seed(0)
    config = getattr(transformers, cfg_cls)(**kwargs, bos_token_id=0, eos_token_id=0)
    hf = getattr(transformers, model_cls)(config).eval()
    return hf, interp.from_hf(hf), bridge_from_hf(hf)


def run(
    shape: str = "gpt2-4l",
    seqs: Sequence[int] = (256, 1024),
    sweeps: Sequence[str] = ("attn_head_out_all_pos",),
    batch: int = 1,
    repeats: int = 3,
) -> list[dict]:
    from transformer_lens import patching

    _, ours, bridge = build(shape)
    vocab = ours.cfg.d_vocab
    rows = []
    for seq in seqs:
        gen = torch.Generator().manual_seed(seq)
        clean = torch.randint(1, vocab, (batch, seq), generator=gen)
        corrupted = clean.clone()
        corrupted[:, seq // 2] = (clean[:, seq // 2] + 1) % vocab  # one token differs
        right, wrong = int(clean[0, -1]), int(corrupted[0, -1] + 1) % vocab

        def metric(logits):
            return (logits[:, -1, right] - logits[:, -1, wrong]).mean()

        with torch.no_grad():
            _, cache_ours = ours.run_with_cache(clean)
            _, cache_bridge = bridge.run_with_cache(clean)
            ours(corrupted), bridge(corrupted)  # warm-up: first-call allocations, kernel selection
            for name in sweeps:
                sweep = getattr(patching, SWEEPS[name])
                out = {}

                def go(model, cache, key):
                    out[key] = sweep(model, corrupted, cache, metric)

                t_bridge = median_time(lambda: go(bridge, cache_bridge, "bridge"), repeats=repeats, warmup=0)
                t_ours = median_time(lambda: go(ours, cache_ours, "ours"), repeats=repeats, warmup=0)
                rows.append(dict(
                    shape=shape, sweep=name, seq=seq, batch=batch, cells=out["ours"].numel(),
                    bridge_s=t_bridge, ours_s=t_ours, speedup=t_bridge / t_ours,
                    max_abs_diff=(out["ours"] - out["bridge"]).abs().max().item(),
                ))
    return rows


HEADERS = ["shape", "sweep", "seq", "batch", "cells", "bridge_s", "ours_s", "speedup", "max_abs_diff"]


def section(opts):
    """`interp bench --sections patching`: one sweep on the gpt2-4l shape (tiny with --quick)."""
    from .report import Section, Table  # imported when the section runs: a section loads only what it measures

    shape, seqs = ("tiny", (12,)) if opts.quick else ("gpt2-4l", (256,))
    rows = run(shape, seqs, ("attn_head_out_all_pos",), 1, max(1, min(opts.repeats, 3)))
    return Section("patching", "Activation patching: TransformerLens's own sweeps, ours vs its bridge",
                   intro=__doc__.split("\n\n", 2)[2].strip(),
                   tables=[Table("", HEADERS, [[r[h] for h in HEADERS] for r in rows])],
                   notes=["speedup = bridge time / our time"])


def main(argv: Sequence[str] | None = None) -> int:
    p = parser("patching", __doc__.split("\n")[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="gpt2-4l")
    p.add_argument("--seqs", type=int, nargs="+", default=[256, 1024])
    p.add_argument("--sweeps", choices=sorted(SWEEPS), nargs="+", default=["attn_head_out_all_pos"])
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--repeats", type=int, default=3, help="timed runs of each sweep (the median is reported)")
    args = p.parse_args(argv)
    try:
        import transformer_lens  # noqa: F401
    except ImportError:
        print("this benchmark needs TransformerLens: pip install 'interp[tl]'", file=sys.stderr)
        return 1
    apply_threads(args.threads)
    rows = run(args.shape, args.seqs, args.sweeps, args.batch, args.repeats)
    print(format_table(HEADERS, [[r[h] for h in HEADERS] for r in rows]))
    print(f"\nspeedup = bridge time / our time; {machine_summary()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
