"""What a head moves (Kissane et al. 2024): decoder norms by head against a loop written here in float64, the direct
feature attribution against the SAE's own pre-activation (its hook_sae_acts_pre, or a gated SAE's gate computed
whole here) on a real run of attn-only-2l for every architecture, the summed attribution against the per-position
terms summed here, each head's top features by hand, and the refusals in one line."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch

from interp.analyses.features import (decoder_norms, direct_feature_attribution, feature_head_terms,
                                      head_top_features)
from interp.analyses.features.site import activations, site_of

HOOK_Z = "blocks.1.attn.hook_z"


def test_decoder_norms_equal_a_loop_by_hand(model, make_sae):
    """And each head's top features by share and by norm are the loop's largest."""
    sae = make_sae(d_sae=24, seed=3)
    frame = decoder_norms(sae, model.cfg)
    W = sae.W_dec.detach().double().numpy()
    assert len(frame) == 24 * 4 and set(frame["layer"]) == {1}
    for f in range(24):
        row = W[f]
        slices = [row[h * 32:(h + 1) * 32] for h in range(4)]
        norms = [float(np.sqrt((s ** 2).sum())) for s in slices]
        total = float((row ** 2).sum())
        part = frame[frame["feature"] == f].sort_values("head")
        np.testing.assert_allclose(part["norm"], norms, rtol=1e-6)
        np.testing.assert_allclose(part["share"], [n ** 2 / total for n in norms], rtol=1e-5)
        np.testing.assert_allclose(part["feature_norm"], np.sqrt(total), rtol=1e-6)
        assert set(part["top_head"]) == {int(np.argmax(norms))}
    assert np.allclose(frame.groupby("feature")["share"].sum(), 1.0, atol=1e-6)
    slices = np.linalg.norm(W.reshape(24, 4, 32), axis=-1)  # [feature, head]
    shares = slices ** 2 / (slices ** 2).sum(-1, keepdims=True)
    for by, values in (("norm", slices), ("share", shares)):
        top = head_top_features(frame, by=by, top=3)
        for h in range(4):
            assert top[top["head"] == h]["feature"].tolist() == np.argsort(-values[:, h])[:3].tolist(), (by, h)


@pytest.mark.parametrize("arch", ["standard", "topk", "jumprelu", "gated"])
def test_the_head_terms_and_the_constant_are_the_saes_own_pre_activation(model, make_sae, corpus, arch):
    """At every position of a real run: sum over heads + constant = the SAE's pre-activation (float32 round-off).
    A gated SAE's split is of its gate, sae_in @ W_enc + b_gate, computed whole here; its hook_sae_acts_pre (the
    magnitude) is the same head terms times exp(r_mag), plus b_mag."""
    sae = make_sae(arch=arch, seed=5)
    z = activations(model, corpus[:4], site_of(HOOK_Z, model.cfg))  # [4, 48, 4, 32]
    terms, constant = feature_head_terms(sae, z)
    assert terms.shape == (4, 48, 4, 48) and constant.shape == (48,)
    with torch.no_grad():
        _, cache = sae.run_with_cache(z)
        pre = cache["hook_sae_acts_pre"]
        whole = terms.sum(-2) + constant
        if arch == "gated":
            gate = (z.flatten(-2) - sae.b_dec) @ sae.W_enc + sae.b_gate
            torch.testing.assert_close(whole, gate, atol=2e-5, rtol=1e-5)
            magnitude = terms.sum(-2) * sae.r_mag.exp() + sae.b_mag - sae.r_mag.exp() * (sae.b_dec @ sae.W_enc)
            torch.testing.assert_close(magnitude, pre, atol=2e-5, rtol=1e-5)
        else:
            torch.testing.assert_close(whole, pre, atol=2e-5, rtol=1e-5)
    assert float(terms.abs().max()) > 0.1  # the heads' terms are not negligible: the check has something to check


@pytest.mark.parametrize("arch", ["standard", "gated"])
def test_the_summed_attribution_is_the_per_position_terms_over_the_active_positions(model, make_sae, corpus, arch):
    sae = make_sae(arch=arch, seed=7)
    frame = direct_feature_attribution(model, sae, corpus, batch_size=3)  # three batches, the last shorter
    z = activations(model, corpus, site_of(HOOK_Z, model.cfg)).double()
    with torch.no_grad():
        on = sae.encode(z.float()) > 0  # [8, 48, d_sae]
        W = sae.W_enc.double().view(4, 32, -1)
        terms = torch.einsum("bphd,hdf->bphf", z, W)  # float64 here
        want = (terms * on[:, :, None, :]).sum((0, 1))  # [4, d_sae]
        n = on.sum((0, 1))
    assert set(frame["feature"]) == set(torch.nonzero(n).flatten().tolist()) and len(frame) > 40
    got = frame.pivot(index="feature", columns="head", values="attribution")
    np.testing.assert_allclose(got.to_numpy(), want.T.numpy()[got.index.to_numpy()], rtol=1e-4, atol=1e-3)
    per = frame.groupby("feature").agg(heads=("attribution", "sum"), constant=("constant", "first"),
                                       pre=("pre_activation", "first"), n=("n_active", "first"))
    np.testing.assert_array_equal(per["n"], n.numpy()[per.index.to_numpy()])
    scale = float(per["pre"].abs().max())
    assert scale > 1.0
    assert float((per["pre"] - per["heads"] - per["constant"]).abs().max()) < 1e-5 * scale * 8
    assert np.allclose(frame.groupby("feature")["share"].sum(), 1.0, atol=1e-5)
    assert set(frame["kind"]) == {"gate" if arch == "gated" else "pre"}


def test_each_heads_top_features_by_hand():
    frame = pd.DataFrame({"feature": [0, 0, 1, 1, 2, 2, 3, 3], "layer": 1, "head": [0, 1] * 4,
                          "attribution": [5.0, 1.0, 7.0, -2.0, 5.0, 9.0, 0.5, 3.0], "share": 0.5})
    top = head_top_features(frame, by="attribution", top=2)
    assert top[top["head"] == 0][["rank", "feature", "value"]].values.tolist() == [[0, 1, 7.0], [1, 0, 5.0]]
    assert top[top["head"] == 1][["rank", "feature", "value"]].values.tolist() == [[0, 2, 9.0], [1, 3, 3.0]]
    with pytest.raises(ValueError, match="reads a frame of decoder_norms"):
        head_top_features(frame, by="share")  # an attribution frame's share is not the decoder's
    with pytest.raises(ValueError, match="by must be"):
        head_top_features(frame, by="size")


@pytest.mark.parametrize("hook, d_in, cfg, says", [
    ("blocks.1.hook_resid_post", 128, {}, "not split by head"),
    ("blocks.1.attn.hook_q", 128, {}, "the features study reads an attention output"),
    (HOOK_Z, 96, {}, "d_in is 96"),
    ("blocks.2.attn.hook_z", 128, {}, "this model has 2 layers"),
    (HOOK_Z, 128, {"normalize_activations": "layer_norm"}, "does not split by head"),
    (HOOK_Z, 128, {"normalize_activations": "constant_norm_rescale"}, "dividing by its own norm"),
])
def test_an_sae_the_split_cannot_read_is_refused_in_one_line(model, make_sae, corpus, hook, d_in, cfg, says):
    sae = make_sae(hook=hook, d_in=d_in, **cfg)
    with pytest.raises(ValueError, match=says) as e:
        direct_feature_attribution(model, sae, corpus[:1])
    assert "\n" not in str(e.value)


def test_the_zoo_saes_split_is_its_own_pre_activation(model):
    """The trained SAE the zoo ships (top-k, its pre-activation rescaled by the decoder norms after the hook), on
    held-out text: the head terms and the constant are its hook_sae_acts_pre at every position."""
    from interp.analyses.data import DataSpec, build_tokens
    from interp.models.saes import load_sae, zoo_saes

    if "attn-only-2l/blocks.1.attn.hook_z" not in zoo_saes():
        pytest.skip("the zoo's attn-only-2l SAE is not there (models/src/zoo/saes/)")
    sae = load_sae("attn-only-2l/blocks.1.attn.hook_z")
    assert sae.cfg.architecture == "topk" and sae.cfg.rescale_acts_by_decoder_norm
    tokens = build_tokens(DataSpec(kind="corpus", n_seqs=4, seq_len=128), model)
    z = activations(model, tokens, site_of(HOOK_Z, model.cfg))
    terms, constant = feature_head_terms(sae, z)
    with torch.no_grad():
        _, cache = sae.run_with_cache(z)
    pre = cache["hook_sae_acts_pre"]
    torch.testing.assert_close(terms.sum(-2) + constant, pre, atol=5e-5, rtol=1e-5)
    frame = direct_feature_attribution(model, sae, tokens)
    per = frame.groupby("feature").agg(heads=("attribution", "sum"), constant=("constant", "first"),
                                       pre=("pre_activation", "first"))
    assert float((per["pre"] - per["heads"] - per["constant"]).abs().max()) < 1e-6 * float(per["pre"].abs().max()) * 10
