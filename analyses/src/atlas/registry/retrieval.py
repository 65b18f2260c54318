"""retrieval: Wu et al.'s retrieval score per head (`analyses/src/kv/roles.py`): while the model greedily
decodes the pass key of seeded passkey prompts built for its own tokenizer (not the sweep data: the
score needs the model to copy a key), a head scores when its top-1 attention lands on the very needle
token being copied; hits / tokens copied. Opt-in (`--analyses ...,retrieval`): it adds the
"retrieval heads" column to the atlas's head tables. A checkpoint that copies no key token fails
with that message (a score of 0 everywhere would be a finding it is not)."""

from __future__ import annotations

from types import MappingProxyType

import pandas as pd
import torch

from ...kv.roles import retrieval_scores
from ...store import NonFiniteResult
from ...kv.tasks import retrieval_prompts
from .base import Analysis, Context, Metric, per_head, register

PARAMS = MappingProxyType(dict(length=512, depths=(0.2, 0.5, 0.8), per_depth=2, seed=1000, max_new_tokens=8))


def _finite_heads(ctx: Context) -> None:
    """NonFiniteResult naming the heads whose attention on the sweep data is not finite: a NaN head
    would otherwise never be anyone's top-1 and score a quiet 0."""
    bad = []

    def check(pattern, hook):
        rows = ~torch.isfinite(pattern).flatten(2).all(-1).all(0)  # [head]
        bad.extend(f"L{hook.layer()}H{h}" for h in rows.nonzero().flatten().tolist())

    names = [f"blocks.{l}.attn.hook_pattern" for l in range(ctx.model.cfg.n_layers)]
    with torch.no_grad():
        ctx.model.run_with_hooks(ctx.tokens[:1], fwd_hooks=[(n, check) for n in names])
    if bad:
        raise NonFiniteResult(f"retrieval: the attention of {', '.join(bad[:8])} is not finite, so no retrieval "
                              "score can be read from it: check the checkpoint's weights for NaN/inf")


def run(ctx: Context) -> pd.DataFrame:
    model, p = ctx.model, PARAMS
    _finite_heads(ctx)
    length = min(p["length"], model.cfg.n_ctx - p["max_new_tokens"])
    prompts = retrieval_prompts(model, [length], list(p["depths"]), p["per_depth"], p["seed"])
    frame = retrieval_scores(model, prompts, max_new_tokens=p["max_new_tokens"])
    return per_head(frame, "retrieval", "retrieval")


register(Analysis(
    "retrieval", run, "retrieval heads (Wu et al. 2024): top-1 attention on the needle token being copied while "
    "decoding a pass key", PARAMS, expensive=True, kv_cache=True,
    metrics=(Metric("retrieval", "head",
                    "interp.analyses.kv.roles.retrieval_scores on seeded passkey prompts (keys from seed 1000)",
                    label="retrieval (passkey copying)", heatmap=True, headline=True),)))
