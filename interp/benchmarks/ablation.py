"""Ablation sweep: every head, mean ablation, ours (`ablate_heads`) vs a TransformerLens hook loop.

    interp bench --sections ablation

On the zoo's modern model (`rope-gqa-4l`; a random model of its config until it is shipped), with
the same weights inside a TransformerLens bridge (`hf_llama_from_ours` -> `bridge_from_hf`):

  ours            `ablate_heads(model, tokens, "mean")`: one clean forward caching the residual
                  stream, then one batched forward per layer resuming from it
  ours hook loop  the obvious loop on our model: one full forward per head, a hook on
                  `blocks.L.attn.hook_z` (`interp.benchmarks.ablation_loop.naive_sweep`)
  TL hook loop    the same loop on the bridge, TransformerLens's API only: mean z per head from
                  `bridge.run_with_cache`, then `bridge.run_with_hooks(..., return_type="loss")`

All three give the mean next-token loss with each head ablated alone; the table reports their
largest difference and the speed ratios.
"""

from __future__ import annotations

import torch

from .models import hf_llama_from_ours, zoo_or_random
from .report import Options, Section, Table
from .timing import compare_times


def text_tokens(batch: int, seq: int, vocab: int) -> torch.Tensor:
    """[batch, seq] byte tokens of Python standard-library source (the zoo's training domain)."""
    import textwrap

    data = open(textwrap.__file__, "rb").read()
    while len(data) < batch * seq:
        data += data
    ids = torch.tensor(list(data[: batch * seq]), dtype=torch.long).view(batch, seq)
    return ids % vocab


@torch.no_grad()
def tl_hook_loop(bridge, tokens) -> tuple[float, dict]:
    """(clean loss, {(layer, head): loss}) with one bridge forward per head, mean-ablating its hook_z."""
    n_layers, n_heads = bridge.cfg.n_layers, bridge.cfg.n_heads
    names = [f"blocks.{l}.attn.hook_z" for l in range(n_layers)]
    clean, cache = bridge.run_with_cache(tokens, names_filter=names, return_type="loss")
    means = {l: cache[names[l]].mean((0, 1), keepdim=True) for l in range(n_layers)}
    out = {}
    for l in range(n_layers):
        for h in range(n_heads):
            def hook(z, hook, h=h, v=means[l]):
                z = z.clone()
                z[:, :, h] = v[:, :, h]
                return z

            out[(l, h)] = float(bridge.run_with_hooks(tokens, fwd_hooks=[(names[l], hook)], return_type="loss"))
    return float(clean), out


def section(opts: Options) -> Section:
    from interp.analyses import ablate_heads
    # imported when the section runs: a section loads only what it measures
    from interp.benchmarks.ablation_loop import naive_sweep
    from interp.interop import bridge_from_hf  # imported when the section runs: a section loads only what it measures

    model, provenance = zoo_or_random("rope-gqa-4l")
    model = model.to(opts.device)
    bridge = bridge_from_hf(hf_llama_from_ours(model))
    cfg = model.cfg
    tokens = text_tokens(opts.ablation_batch, min(opts.ablation_seq, cfg.n_ctx), cfg.d_vocab).to(opts.device)
    results = {}

    def ours():
        frame = ablate_heads(model, tokens, "mean", progress=False)
        results["ours"] = {(int(r.layer), int(r.head)): float(r.loss) for r in frame.itertuples()}

    def ours_loop():
        results["ours_loop"] = naive_sweep(model, tokens, "mean")

    def tl_loop():
        results["tl_clean"], results["tl_loop"] = tl_hook_loop(bridge, tokens)

    fns = {"ours": ours, "ours_loop": ours_loop, "tl_loop": tl_loop}
    with torch.no_grad():
        t, rounds = compare_times(fns, opts.repeats, opts.warmup, opts.budget, opts.min_repeats, opts.clock)
    heads = sorted(results["ours"])
    diff_tl = max(abs(results["ours"][k] - results["tl_loop"][k]) for k in heads)
    diff_loop = max(abs(results["ours"][k] - results["ours_loop"][k]) for k in heads)
    spread = max(results["ours"].values()) - min(results["ours"].values())
    n = len(heads)
    rows = [
        ["ours: ablate_heads (resume + batch)", 1 + cfg.n_layers, t["ours"], 1.0, "-"],
        ["ours: hook loop, one forward per head", n + 1, t["ours_loop"], t["ours_loop"] / t["ours"], f"{diff_loop:.1e}"],
        ["TL bridge: hook loop, one forward per head", n + 1, t["tl_loop"], t["tl_loop"] / t["ours"], f"{diff_tl:.1e}"],
    ]
    return Section(
        "ablation", "Ablation sweep: every head, mean ablation",
        intro=(
            f"Model: {provenance}: {cfg.n_layers} layers x {cfg.n_heads} heads (GQA {cfg.kv_heads} kv), RoPE, RMSNorm, "
            f"SwiGLU. Data: {tokens.shape[0]} x {tokens.shape[1]} byte tokens of Python source. Each head's z is "
            "replaced by its mean over the data and the mean next-token loss measured; all "
            f"{n} heads, one at a time. Median of {rounds} timed rounds."
        ),
        tables=[Table("", ["method", "forwards", "time s", "time / ours", "max abs loss diff vs ours"], rows)],
        notes=[f"the losses span {spread:.3g} across heads, so a difference of {diff_tl:.1e} is round-off"],
        headline=[
            f"ablation sweep ({n} heads, {provenance.split(':')[0]}): ours is {t['tl_loop'] / t['ours']:.1f}x faster "
            f"than the TransformerLens hook loop (and {t['ours_loop'] / t['ours']:.1f}x faster than the same loop on "
            f"our model); same losses to {diff_tl:.1e}"
        ],
    )
