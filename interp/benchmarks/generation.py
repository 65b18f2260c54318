"""Generation: tokens per second with our KV cache (`model.generate`) vs Hugging Face `generate`
vs TransformerLens 4's bridge `generate` (its KV cache, its default).

    interp bench --sections generation --gen-tokens 64

Greedy (`do_sample=False`), the same weights and prompts, exactly `gen_tokens` new tokens each
(`min_new_tokens` / `stop_at_eos=False` keep everyone from stopping at an end-of-sequence id), end
to end (prefill included). The table also says whether HF and the bridge produced our tokens (our
greedy tokens are the argmax of a full uncached forward at every step: see tests/models/kv/test_kv_cache.py).
"""

from __future__ import annotations

import torch

from .models import build_trio
from .report import Options, Section, Table
from .timing import compare_times

HEADERS = ["shape", "batch", "prompt", "new tokens", "ours tok/s", "HF tok/s", "TL tok/s", "HF time / ours",
           "TL time / ours", "HF same tokens", "TL same tokens", "rounds"]


def section(opts: Options) -> Section:
    import transformers

    transformers.logging.set_verbosity_error()  # generation-config chatter
    rows, heads = [], []
    for shape in opts.shapes:
        hf, ours, bridge = build_trio(shape, device=opts.device)
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

            def run_tl():
                out["tl"] = bridge.generate(prompt, max_new_tokens=new, stop_at_eos=False, do_sample=False,
                                            verbose=False, return_type="tokens")

            with torch.no_grad():
                t, rounds = compare_times({"ours": run_ours, "hf": run_hf, "tl": run_tl}, opts.repeats, opts.warmup,
                                          opts.budget, opts.min_repeats, opts.clock, focus=("ours", "hf"))
            ref = out["ours"][:, prompt.shape[1]:]

            def same(other):
                o = other[:, prompt.shape[1]:].to(ref.device)
                return "yes" if o.shape == ref.shape and bool((o == ref).all()) else f"{float((o == ref).float().mean()):.0%}"

            rows.append([shape, batch, opts.gen_prompt, new, batch * new / t["ours"], batch * new / t["hf"],
                         batch * new / t["tl"], t["hf"] / t["ours"], t["tl"] / t["ours"], same(out["hf"]),
                         same(out["tl"]), rounds])
            heads.append(f"{shape} batch {batch}: HF {t['hf'] / t['ours']:.2f}, TL {t['tl'] / t['ours']:.2f}")
        del hf, ours, bridge
    return Section(
        "generation", "Generation: our KV cache vs Hugging Face generate vs TransformerLens",
        intro=(
            f"Greedy decoding, {opts.gen_prompt}-token random prompts, {opts.gen_tokens} new tokens, float32 on "
            f"{opts.device}; tokens/s = batch x new tokens / time (prefill included, on the clock above). ours: "
            "`model.generate` (preallocated KV cache, fused attention, only the last prompt position unembedded); "
            "HF: `model.generate(do_sample=False)` with its dynamic cache (and `logits_to_keep=1`); TL: the "
            "bridge's `generate(do_sample=False)` with its KV cache (its default). \"same tokens\": the share of "
            "new tokens equal to ours."
        ),
        tables=[Table("", HEADERS, rows)],
        notes=[] if all(r[10] == "yes" for r in rows) else [
            "TL same tokens below 100%: the bridge's cached decoding leaves its own uncached forward after "
            "the first new token (TransformerLens 4.x on transformers 5.x; with `use_past_kv_cache=False` it "
            "gives our tokens, see tests/interp/test_tl_conventions.py), so its time is that of a wrong continuation."],
        headline=["generation, time / ours (above 1: ours faster): " + "; ".join(heads)],
    )
