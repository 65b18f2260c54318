"""A feature's direct effect on the logits equals the product of matrices written here: its decoder row cut into
heads, each through its head's W_O, summed, through the final LayerNorm's centring and weight (or not), and through
W_U, in float64; a d_model-wide SAE's row goes to W_U directly."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from interp.analyses.features import logit_effect
from interp.analyses.features.logits import feature_directions


def by_hand(model, sae, through_norm: bool, heads: bool = True) -> np.ndarray:
    W_dec = sae.W_dec.detach().double().numpy()
    if heads:
        W_O = model.blocks[1].attn.W_O.detach().double().numpy()  # [4, 32, 128]
        d = sum(W_dec[:, h * 32:(h + 1) * 32] @ W_O[h] for h in range(4))
    else:
        d = W_dec
    if through_norm:
        d = (d - d.mean(-1, keepdims=True)) * model.ln_final.w.detach().double().numpy()
    return d @ model.unembed.W_U.detach().double().numpy()  # [d_sae, d_vocab]


@pytest.mark.parametrize("through_norm", [True, False])
def test_the_logit_effect_is_the_hand_product(model, make_sae, through_norm):
    sae = make_sae(d_sae=20, seed=8)
    with torch.no_grad():
        model.ln_final.w.mul_(torch.linspace(0.5, 1.5, 128))  # a weight that is not ones, so the norm shows
    try:
        want = by_hand(model, sae, through_norm)
        frame = logit_effect(model, sae, top=5, through_norm=through_norm)
    finally:
        with torch.no_grad():
            model.ln_final.w.div_(torch.linspace(0.5, 1.5, 128))
    assert len(frame) == 20 * 2 * 5
    for f in range(20):
        top = frame[(frame["feature"] == f) & (frame["direction"] == "top")].sort_values("rank")
        bottom = frame[(frame["feature"] == f) & (frame["direction"] == "bottom")].sort_values("rank")
        assert top["token"].tolist() == np.argsort(-want[f])[:5].tolist()
        assert bottom["token"].tolist() == np.argsort(want[f])[:5].tolist()
        np.testing.assert_allclose(top["effect"], np.sort(want[f])[::-1][:5], rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(bottom["effect"], np.sort(want[f])[:5], rtol=1e-4, atol=1e-5)
    assert frame["token_text"].map(type).eq(str).all()


def test_a_residual_saes_row_goes_to_the_unembedding_directly(model, make_sae):
    sae = make_sae(hook="blocks.1.hook_resid_post", d_sae=12, seed=9)
    want = by_hand(model, sae, through_norm=True, heads=False)
    frame = logit_effect(model, sae, top=3, features=[2, 7])
    assert set(frame["feature"]) == {2, 7}
    for f in (2, 7):
        top = frame[(frame["feature"] == f) & (frame["direction"] == "top")].sort_values("rank")
        np.testing.assert_allclose(top["effect"], np.sort(want[f])[::-1][:3], rtol=1e-4, atol=1e-5)


def test_the_directions_split_by_head_add_up(model, make_sae):
    """The direction of a feature is the sum of its heads' writes: a decoder row zero outside head 2 writes what
    head 2's W_O makes of its slice, and nothing of the other heads."""
    sae = make_sae(d_sae=4)
    with torch.no_grad():
        sae.W_dec[0].zero_()
        sae.W_dec[0, 64:96] = torch.randn(32)
        want = sae.W_dec[0, 64:96] @ model.blocks[1].attn.W_O[2]
    got = feature_directions(model, sae, torch.tensor([0]), through_norm=False)[0]
    torch.testing.assert_close(got, want.float(), rtol=1e-5, atol=1e-6)
