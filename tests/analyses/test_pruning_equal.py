"""The pruning study's shortcuts (values without a forward, one unpruned evaluation for every curve, the
importance of a set scored once, evaluations resumed from the lowest layer a step changes) give the
curves of the plain algorithm, written out here as it ran before them: every step of every order a whole
forward on the held-out data with the pruned heads' z zeroed, the importance recomputed from scratch by a
gradient through gates on the fit data. Heads, order and losses must agree (losses within 1e-4)."""

from __future__ import annotations

import pandas as pd
import pytest
import torch
from analyses_fixtures import build, tokens

import interp
from interp.analyses.pruning import pruning_study


def plain_pruning(model, toks, *, split, seeds, step, max_fraction):
    cfg = model.cfg
    n_fit = int(round(split * len(toks)))
    fit, held = toks[:n_fit], toks[n_fit:]
    total = cfg.n_layers * cfg.n_heads
    per_step = int(step) if step >= 1 else max(1, round(step * total))
    limit = int(round(max_fraction * total))
    heads = [(l, h) for l in range(cfg.n_layers) for h in range(cfg.n_heads)]

    def zeroed(pruned):
        def hook(z, hook):
            layer = int(hook.name.split(".")[1])
            z = z.clone()
            z[:, :, [h for l, h in pruned if l == layer]] = 0.0
            return z
        return [(f"blocks.{l}.attn.hook_z", hook) for l in sorted({l for l, _ in pruned})]

    def importance(pruned):  # Michel et al.: |dL/dxi| per sequence, mean, L2-normalised per layer
        xi = torch.ones(len(fit), cfg.n_layers, cfg.n_heads, requires_grad=True)
        gates = [(f"blocks.{l}.attn.hook_z", lambda z, hook, l=l: z * xi[:, l, None, :, None]) for l in range(cfg.n_layers)]
        nll = model.run_with_hooks(fit, fwd_hooks=zeroed(pruned) + gates, return_type="loss", loss_per_token=True)
        (grad,) = torch.autograd.grad(nll.mean(1).sum(), [xi])
        imp = grad.abs().mean(0)
        return imp / imp.norm(dim=-1, keepdim=True).clamp(min=1e-20)

    rows = []
    for order, seed in [("importance", 0), ("reverse", 0)] + [("random", s) for s in seeds]:
        shuffled = [heads[i] for i in torch.randperm(total, generator=torch.Generator().manual_seed(seed)).tolist()]
        pruned = []
        for i in range(-(-limit // per_step) + 1):
            chosen = []
            if i:
                remaining = [hd for hd in heads if hd not in pruned]
                k = min(per_step, limit - len(pruned))
                if order == "random":
                    chosen = [hd for hd in shuffled if hd not in pruned][:k]
                else:
                    imp = importance(pruned)
                    chosen = sorted(remaining, key=lambda hd: float(imp[hd]), reverse=order == "reverse")[:k]
                pruned = pruned + chosen
            with torch.no_grad():
                loss = float(model.run_with_hooks(held, fwd_hooks=zeroed(pruned), return_type="loss"))
            rows.append(dict(order=order, seed=seed, step=i, loss=loss, pruned=",".join(f"L{l}H{h}" for l, h in chosen)))
    return pd.DataFrame(rows)


def _compare(model, toks, **kw):
    got = pruning_study(model, toks, progress_bar=False, **kw)
    want = plain_pruning(model, toks, **kw)
    assert list(got["pruned"]) == list(want["pruned"])  # the same heads, in the same order, every curve
    assert (got["loss"].to_numpy() - want["loss"].to_numpy()).__abs__().max() < 1e-4


def test_the_pruning_study_equals_the_plain_algorithm_on_the_zoo_model():
    model = interp.load("attn-only-2l")
    toks = torch.randint(0, model.cfg.d_vocab, (6, 48), generator=torch.Generator().manual_seed(3))
    _compare(model, toks, split=0.5, seeds=(0, 1, 2), step=1, max_fraction=0.75)


@pytest.mark.parametrize("arch", ["rotary-gqa", "attn-only-3l"])
def test_the_pruning_study_equals_the_plain_algorithm_with_mlps_and_gqa(arch):
    model = build(arch)
    _compare(model, tokens(6, 20, seed=9, vocab=model.cfg.d_vocab), split=0.5, seeds=(0, 1), step=2, max_fraction=0.5)
