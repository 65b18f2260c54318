"""An SAE spliced into a real model: what `run_with_saes` costs over the clean forward, beside the same SAE
applied by a plain forward hook written by hand (the least any splice can cost).

    interp bench --sections saes

SmolLM2-135M (its GGUF; skipped where it is not installed) with one top-k SAE of the shape issue 67 trains
(8x the activation's width, k 32; random weights, seeded: the cost of a top-k SAE does not depend on its
weights) at layer 18, on the attention output (`blocks.18.attn.hook_z`, the 9 heads flattened, 576 wide) and
on the residual stream (`blocks.18.hook_resid_pre`, 576 wide). Three ways, timed interleaved round by round
on the same tokens: the clean forward, `model.run_with_saes(tokens, saes=[sae])`, and `run_with_hooks` with
a hook that returns `sae(x)` (reshaping hook_z's heads as the splice does). The spliced logits are checked
against the hand hook's first. `--quick` runs attn-only-2l with the zoo's hook_z SAE.
"""

from __future__ import annotations

import torch

from .report import Options, Section, Table
from .timing import compare_times

HOOKS = ("blocks.18.attn.hook_z", "blocks.18.hook_resid_pre")
D_SAE_PER_D_IN, K = 8, 32


def random_topk_sae(d_in: int, hook: str, seed: int = 0):
    """A top-k SAE of `d_in` inputs and 8 * d_in features at `hook`, random weights (decoder rows of unit norm)."""
    from interp.models.saes import SAE, SAEConfig  # imported when the section runs

    cfg = SAEConfig("topk", d_in=d_in, d_sae=D_SAE_PER_D_IN * d_in, k=K, hook_name=hook,
                    reshape_activations="hook_z" if hook.endswith("hook_z") else "none")
    sae = SAE(cfg)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        sae.W_dec.copy_(torch.nn.functional.normalize(torch.randn(cfg.d_sae, d_in, generator=gen), dim=-1))
        sae.W_enc.copy_(sae.W_dec.T)
        sae.b_enc.copy_(0.1 * torch.randn(cfg.d_sae, generator=gen))
        sae.b_dec.copy_(0.1 * torch.randn(d_in, generator=gen))
    return sae.eval()


def hand_hook(sae):
    """A forward hook that replaces the activation by the SAE's reconstruction: hook_z's [b, p, h, d] heads
    flattened to [b, p, h * d] and back, as SAELens trains them."""
    def hook(x, hook):
        if sae.cfg.reshape_activations == "hook_z":
            return sae(x.flatten(-2)).view_as(x)
        return sae(x)
    return hook


def rows_for(model, saes, tokens: torch.Tensor, opts: Options) -> tuple[list[list], list[str]]:
    rows, notes = [], []
    with torch.no_grad():
        for sae in saes:
            hook = sae.cfg.hook_name
            spliced = model.run_with_saes(tokens, saes=[sae])
            by_hand = model.run_with_hooks(tokens, fwd_hooks=[(hook, hand_hook(sae))])
            notes.append(f"{hook}: max |spliced - hand hook| logits {(spliced - by_hand).abs().max():.1e}")
            t, rounds = compare_times(
                {"clean": lambda: model(tokens), "spliced": lambda: model.run_with_saes(tokens, saes=[sae]),
                 "hand": lambda: model.run_with_hooks(tokens, fwd_hooks=[(hook, hand_hook(sae))])},
                opts.repeats, opts.warmup, opts.budget, opts.min_repeats, opts.clock)
            shape = "x".join(map(str, tokens.shape))
            rows.append([hook, f"{sae.cfg.d_in} -> {sae.cfg.d_sae} (k {sae.cfg.k})", shape, t["clean"] * 1e3,
                         t["spliced"] * 1e3, t["hand"] * 1e3, t["spliced"] / t["clean"], t["spliced"] / t["hand"], rounds])
    return rows, notes


def section(opts: Options) -> Section:
    import interp  # imported when the section runs: a section loads only what it measures
    from interp.loading import ModelNotFound, real_model_file

    title = "An SAE spliced in: run_with_saes against the clean forward and a hand-written hook"
    if opts.quick:
        model, name = interp.load("attn-only-2l"), "attn-only-2l"
        saes = [interp.load_sae("attn-only-2l/blocks.1.attn.hook_z")]
        shapes = ((2, 32),)
    else:
        try:
            real_model_file("smollm2-135m")
        except ModelNotFound as e:
            return Section("saes", title, skipped=str(e))
        model, name = interp.load("smollm2-135m"), "SmolLM2-135M"
        saes = [random_topk_sae(model.cfg.n_heads * model.cfg.d_head if h.endswith("hook_z") else model.cfg.d_model, h)
                for h in HOOKS]
        shapes = ((1, 1024), (4, 256))
    gen = torch.Generator().manual_seed(0)
    rows, notes = [], []
    for batch, seq in shapes:
        tokens = torch.randint(0, model.cfg.d_vocab, (batch, seq), generator=gen)
        r, n = rows_for(model, saes, tokens, opts)
        rows += r
        notes += n
    s = Section(
        "saes", title, intro=__doc__.split("\n\n", 2)[2].strip(),
        tables=[Table(f"{name}, float32, one SAE at a time",
                      ["hook", "SAE", "batch x seq", "clean ms", "run_with_saes ms", "hand hook ms", "spliced / clean",
                       "spliced / hand", "rounds"], rows)],
        notes=notes,
    )
    worst = max(r[6] for r in rows)
    s.headline = [f"one SAE spliced into {name}: run_with_saes costs at most {worst:.2f}x the clean forward "
                  f"({max(r[7] for r in rows):.2f}x a hand-written hook doing the same)"]
    return s
