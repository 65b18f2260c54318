"""Forward pass: our fused and instrumented paths vs Hugging Face `sdpa` and `eager`, same weights.

    python -m interp.benchmarks.forward --shape gpt2-small --seq 1024

The headline is the ratio ours-fused / HF-sdpa (below 1.0 means we are faster).
"""

from __future__ import annotations

import argparse

import torch

from .timing import format_table, machine_summary, median_time

# Hugging Face configs (random init) of the shapes people benchmark.
SHAPES = {
    "gpt2-small": ("GPT2Config", "GPT2LMHeadModel", dict(n_layer=12, n_embd=768, n_head=12, n_positions=2048, vocab_size=50257)),
    "llama-small": ("LlamaConfig", "LlamaForCausalLM", dict(num_hidden_layers=12, hidden_size=768, num_attention_heads=12, num_key_value_heads=4, intermediate_size=2048, vocab_size=32000, max_position_embeddings=4096)),
    "tiny": ("GPT2Config", "GPT2LMHeadModel", dict(n_layer=2, n_embd=64, n_head=4, n_positions=256, vocab_size=500)),
}


def build_pair(shape: str, attn_implementation: str = "sdpa"):
    """(hf_model, our_model) with identical weights, float32, eval mode."""
    import transformers

    import interp

    cfg_cls, model_cls, kwargs = SHAPES[shape]
    torch.manual_seed(0)
    config = getattr(transformers, cfg_cls)(**kwargs, bos_token_id=0, eos_token_id=0)
    config._attn_implementation = attn_implementation
    hf = getattr(transformers, model_cls)(config).eval()
    return hf, interp.from_hf(hf)


def run(shapes=("gpt2-small",), seqs=(1024,), batch: int = 1, repeats: int = 5) -> list[list]:
    rows = []
    for shape in shapes:
        hf, ours = build_pair(shape, "sdpa")
        for seq in seqs:
            tokens = torch.randint(0, ours.cfg.d_vocab, (batch, seq))
            with torch.inference_mode():
                t_ours = median_time(lambda: ours(tokens), repeats)
                hf.config._attn_implementation = "sdpa"
                t_sdpa = median_time(lambda: hf(tokens, use_cache=False), repeats)
                hf.config._attn_implementation = "eager"
                t_eager = median_time(lambda: hf(tokens, use_cache=False), repeats)
                with ours.attention("instrumented"):
                    t_instr = median_time(lambda: ours(tokens), repeats)
            rows.append([shape, seq, batch, 1e3 * t_ours, 1e3 * t_instr, 1e3 * t_sdpa, 1e3 * t_eager, t_ours / t_sdpa])
    return rows


HEADERS = ["shape", "seq", "batch", "ours fused ms", "ours instrumented ms", "HF sdpa ms", "HF eager ms", "fused / HF sdpa"]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", nargs="+", default=["gpt2-small"], choices=sorted(SHAPES))
    p.add_argument("--seq", nargs="+", type=int, default=[1024])
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--repeats", type=int, default=5)
    a = p.parse_args(argv)
    print(machine_summary())
    print(format_table(HEADERS, run(a.shape, a.seq, a.batch, a.repeats)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
