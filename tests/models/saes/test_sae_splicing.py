"""Splicing SAEs into models (`interp.models.saes.splice`, SAELens's `HookedSAETransformer` methods on every
interp model), against a hand-written splice: the same SAE formula applied by a plain `run_with_hooks` hook.

Native (our own configs, a hook_z SAE and a residual one) and wrapped (transformers runs the model); the error
term gives the clean forward back; an edit of a feature moves the output by its decoder row; the SAE's hook
points are cached under SAELens's names; everything is put back after a call, a block, or an exception; bad
splices are one line; attention stays fused."""

from __future__ import annotations

import pytest
import torch

import interp
from core_models import build, small, tokens
from interp.models.saes import SAE, SAEConfig
from interp.saes import HookedSAETransformer
from spies import Softmaxes
from wrapped_cases import build_wrapped_hf

N = 12


def random_sae(hook_name: str, d_in: int, d_sae: int = 40, seed: int = 0, **cfg) -> SAE:
    """A standard SAE with random weights, big enough that many features fire and the reconstruction is poor
    (so a splice without the error term changes the logits)."""
    sae = SAE(SAEConfig(architecture="standard", d_in=d_in, d_sae=d_sae, hook_name=hook_name, **cfg))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in (sae.W_enc, sae.b_enc, sae.W_dec, sae.b_dec):
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return sae


def by_hand(sae: SAE, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(feature activations, reconstruction) of a standard SAE, written out: SAELens's definition."""
    flat = x.flatten(-2) if sae.cfg.hook_name.endswith("hook_z") else x
    acts = torch.relu((flat - sae.b_dec) @ sae.W_enc + sae.b_enc)
    return acts, (acts @ sae.W_dec + sae.b_dec).reshape(x.shape)


@pytest.fixture(scope="module")
def model():
    return build(small(n_layers=2)).eval()


def widths(model, hook: str) -> int:
    return model.cfg.n_heads * model.cfg.d_head if hook.endswith("hook_z") else model.cfg.d_model


HOOKS = ["blocks.1.attn.hook_z", "blocks.0.hook_resid_post"]


@pytest.mark.parametrize("hook", HOOKS)
def test_the_splice_is_the_hand_written_one(model, hook):
    sae = random_sae(hook, widths(model, hook))
    toks = tokens(2, N)
    with torch.no_grad():
        spliced = model.run_with_saes(toks, saes=[sae])
        by_hook = model.run_with_hooks(toks, fwd_hooks=[(hook, lambda x, hook: by_hand(sae, x)[1])])
        clean = model(toks)
    torch.testing.assert_close(spliced, by_hook, rtol=1e-5, atol=1e-5)
    assert (spliced - clean).abs().max() > 1e-2  # the SAE is lossy: a splice that did nothing would fail above
    assert model.acts_to_saes == {} and sae.cfg.hook_name + ".hook_sae_acts_post" not in model.hook_dict
    torch.testing.assert_close(model(toks), clean, rtol=0, atol=0)


@pytest.mark.parametrize("hook", HOOKS)
def test_the_cache_holds_the_saes_hook_points_under_saelens_names(model, hook):
    sae = random_sae(hook, widths(model, hook))
    with torch.no_grad():
        _, cache = model.run_with_cache_with_saes(tokens(2, N), saes=[sae])
    acts, recons = by_hand(sae, cache[hook])
    torch.testing.assert_close(cache[f"{hook}.hook_sae_acts_post"], acts, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(cache[f"{hook}.hook_sae_input"].reshape(cache[hook].shape), cache[hook])
    torch.testing.assert_close(cache[f"{hook}.hook_sae_recons"].reshape(recons.shape), recons, rtol=1e-5,
                               atol=1e-6)
    names = list(cache.keys())
    assert names.index(hook) < names.index(f"{hook}.hook_sae_input") < names.index(f"{hook}.hook_sae_acts_post")


@pytest.mark.parametrize("hook", HOOKS)
def test_the_error_term_gives_the_clean_forward_and_an_edit_moves_it_by_the_decoder_row(model, hook):
    sae = random_sae(hook, widths(model, hook))
    toks = tokens(2, N)
    with torch.no_grad():
        clean = model(toks)
        torch.testing.assert_close(model.run_with_saes(toks, saes=[sae], use_error_term=True), clean,
                                   rtol=1e-5, atol=1e-5)
        assert sae.use_error_term is False  # put back after the call
        _, cache = model.run_with_cache_with_saes(toks, saes=[sae])
        f = int(cache[f"{hook}.hook_sae_acts_post"].sum((0, 1)).argmax())  # a feature that fires
        off = lambda a, hook: a.index_fill(-1, torch.tensor([f]), 0.0)  # noqa: E731
        with model.saes([sae], use_error_term=True):
            edited = model.run_with_hooks(toks, fwd_hooks=[(f"{hook}.hook_sae_acts_post", off)])

        def minus_feature(x, hook):  # the clean activation less the feature's decoder image, by hand
            acts = by_hand(sae, x)[0][..., f:f + 1]
            return x - (acts * sae.W_dec[f]).reshape(x.shape)

        by_hook = model.run_with_hooks(toks, fwd_hooks=[(hook, minus_feature)])
    torch.testing.assert_close(edited, by_hook, rtol=1e-5, atol=1e-5)
    assert (edited - clean).abs().max() > 1e-3


def test_what_was_there_comes_back_after_a_block_and_an_exception(model):
    a, b = (random_sae("blocks.1.attn.hook_z", widths(model, "hook_z"), seed=s) for s in (0, 1))
    toks = tokens(1, N)
    model.add_sae(a)
    try:
        with torch.no_grad():
            with_a = model(toks)
            with pytest.raises(RuntimeError, match="inside"):
                with model.saes([b]):
                    assert model.acts_to_saes == {"blocks.1.attn.hook_z": b}
                    raise RuntimeError("inside")
            assert model.acts_to_saes == {"blocks.1.attn.hook_z": a}
            torch.testing.assert_close(model(toks), with_a, rtol=0, atol=0)
            assert model.hook_dict["blocks.1.attn.hook_z.hook_sae_acts_post"] is a.hook_sae_acts_post
            assert b.hook_sae_acts_post.name == "hook_sae_acts_post"  # b's hook points got their own names back
    finally:
        model.reset_saes()
    assert model.acts_to_saes == {} and not any(".hook_sae_" in n for n in model.hook_dict)
    assert not any("W_enc" in k for k in model.state_dict())


def test_a_wrapped_model_splices_alike():
    hf = build_wrapped_hf("gemma")
    model = interp.from_hf(hf)
    hook = "blocks.1.attn.hook_z"
    sae = random_sae(hook, model.cfg.n_heads * model.cfg.d_head)
    toks = torch.randint(3, 90, (2, N))
    with torch.no_grad():
        clean = model(toks)
        spliced = model.run_with_saes(toks, saes=sae)
        by_hook = model.run_with_hooks(toks, fwd_hooks=[(hook, lambda x, hook: by_hand(sae, x)[1])])
        kept = model.run_with_saes(toks, saes=sae, use_error_term=True)
    torch.testing.assert_close(spliced, by_hook, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(kept, clean, rtol=1e-5, atol=1e-5)
    assert (spliced - clean).abs().max() > 1e-2


def test_attention_stays_fused_under_a_hook_z_splice(model):
    sae = random_sae("blocks.1.attn.hook_z", widths(model, "hook_z"))
    with Softmaxes() as spy, torch.no_grad():
        model.run_with_saes(tokens(1, N), saes=[sae])
    assert spy.n == 0
    with Softmaxes() as spy, torch.no_grad():  # control: the spy sees a pattern when one is asked for
        model.run_with_hooks(tokens(1, N), fwd_hooks=[("blocks.0.attn.hook_pattern", lambda t, hook: None)])
    assert spy.n >= 1


@pytest.mark.parametrize("hook, d_in, says", [
    ("blocks.7.attn.hook_z", None, "'blocks.7.attn.hook_z' is not a hook point of this model"),
    ("blocks.1.attn.hook_zz", None, "Did you mean 'blocks.1.attn.hook_z'"),
    ("blocks.1.attn.hook_z", 5, "the SAE for blocks.1.attn.hook_z reads d_in=5, but that activation has width"),
])
def test_a_bad_splice_is_one_line_and_leaves_the_model_as_it_was(model, hook, d_in, says):
    sae = random_sae(hook, d_in or widths(model, hook))
    with pytest.raises((KeyError, ValueError)) as e:
        model.run_with_saes(tokens(1, N), saes=[sae])
    assert says in str(e.value) and "\n" not in str(e.value)
    assert model.acts_to_saes == {}


def test_saelens_way_in_gives_an_interp_model():
    model = HookedSAETransformer.from_pretrained_no_processing("attn-only-2l")
    assert isinstance(model, HookedSAETransformer) and isinstance(model, interp.models.HookedModel)
    assert not isinstance(torch.nn.Linear(2, 2), HookedSAETransformer)
    with pytest.raises(TypeError, match="from_pretrained"):
        HookedSAETransformer()
