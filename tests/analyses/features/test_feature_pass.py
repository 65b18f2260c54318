"""The one pass every per-feature measure shares: attention stays fused (no softmax is dispatched: no pattern is
made), the forward stops after the SAE's block, and the activations it hands on are the model's own there."""

from __future__ import annotations

import torch

from interp.analyses.features import direct_feature_attribution, max_activating
from interp.analyses.features.passes import feature_pass
from spies import Softmaxes


def test_attention_stays_fused_and_the_forward_stops_after_the_saes_block(model, make_sae, corpus):
    sae = make_sae(hook="blocks.0.attn.hook_z")
    fired = []
    model.blocks[1].hook_resid_pre.add_hook(lambda t, hook: fired.append(hook.name))
    try:
        with Softmaxes() as spy:
            direct_feature_attribution(model, sae, corpus[:2])
            max_activating(model, sae, [corpus[:2]], k=2)
    finally:
        model.reset_hooks()
    assert spy.n == 0 and fired == []
    with Softmaxes() as spy, torch.no_grad():  # control: the spy sees a pattern when one is asked for
        model.run_with_hooks(corpus[:1], fwd_hooks=[("blocks.0.attn.hook_pattern", lambda t, hook: None)])
    assert spy.n >= 1


def test_the_pass_hands_on_the_models_own_activation_and_the_saes_code(model, make_sae, corpus):
    sae = make_sae(arch="jumprelu")
    seen = []

    class Keep:
        def update(self, first, tokens, x, acts):
            seen.append((first, tokens, x, acts))

    feature_pass(model, sae, [corpus[:3], corpus[3:]], [Keep()])
    _, cache = model.run_with_cache(corpus, names_filter="blocks.1.attn.hook_z")
    z = cache["blocks.1.attn.hook_z"]
    assert [s[0] for s in seen] == [0, 3]
    torch.testing.assert_close(torch.cat([s[2] for s in seen]), z)
    torch.testing.assert_close(torch.cat([s[3] for s in seen]), sae.encode(z).detach())
    assert torch.equal(torch.cat([s[1] for s in seen]), corpus)
