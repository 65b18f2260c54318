"""Generation: tokens per second with our KV cache (`model.generate`) vs Hugging Face `generate`.

    interp bench --sections generation --gen-tokens 64

Greedy (`do_sample=False`), the same weights and prompts, exactly `gen_tokens` new tokens each
(`min_new_tokens` keeps HF from stopping at an end-of-sequence id), end to end (prefill included).
The table also says whether both produced the same tokens.
"""

from __future__ import annotations

import torch

from .models import build_pair
from .report import Options, Section, Table
from .timing import compare_times

HEADERS = ["shape", "batch", "prompt", "new tokens", "ours tok/s", "HF tok/s", "HF time / ours", "same tokens", "rounds"]


def section(opts: Options) -> Section:
    import transformers

    transformers.logging.set_verbosity_error()  # generation-config chatter
    rows, heads = [], []
    for shape in opts.shapes:
        hf, ours = build_pair(shape, device=opts.device)
        new = opts.gen_tokens
        for batch in opts.gen_batches:
            prompt = torch.randint(1, ours.cfg.d_vocab, (batch, opts.gen_prompt), generator=torch.Generator().manual_seed(batch))
            prompt = prompt.to(opts.device)
            mask = torch.ones_like(prompt)
            out = {}

            def run_ours():
                out["ours"] = ours.generate(prompt, max_new_tokens=new, stop_at_eos=False)

            def run_hf():
                out["hf"] = hf.generate(prompt, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                                        do_sample=False, pad_token_id=0)

            with torch.no_grad():
                t, rounds = compare_times({"ours": run_ours, "hf": run_hf}, opts.repeats, opts.warmup, opts.budget,
                                          opts.min_repeats, opts.clock)
            a, b = out["ours"][:, prompt.shape[1]:], out["hf"][:, prompt.shape[1]:]
            same = "yes" if a.shape == b.shape and bool((a == b).all()) else f"{float((a == b).float().mean()):.0%}"
            rows.append([shape, batch, opts.gen_prompt, new, batch * new / t["ours"], batch * new / t["hf"],
                         t["hf"] / t["ours"], same, rounds])
            heads.append(f"{shape} batch {batch}: {t['hf'] / t['ours']:.2f}")
        del hf, ours
    return Section(
        "generation", "Generation: our KV cache vs Hugging Face generate",
        intro=(
            f"Greedy decoding, {opts.gen_prompt}-token random prompts, {opts.gen_tokens} new tokens, float32 on "
            f"{opts.device}; tokens/s = batch x new tokens / time (prefill included, on the clock above). ours: "
            "`model.generate` (preallocated KV cache, fused attention, only the last prompt position unembedded); "
            "HF: `model.generate(do_sample=False)` with its dynamic cache (and `logits_to_keep=1`)."
        ),
        tables=[Table("", HEADERS, rows)],
        headline=["generation, HF time / ours (above 1: ours faster): " + ", ".join(heads)],
    )
