"""SAELens's own code on interp: SAELens's `SAE` objects spliced into an interp model give what SAELens's own
`HookedSAETransformer` gives on the same weights (logits, feature activations, the error term, a feature edit),
and code written against SAELens's methods runs with only the import changed.

SAELens pins transformer-lens<4, so it is not in the dev environment (TransformerLens 4 is): these tests skip
where sae-lens is absent, and run in an environment made with `pip install -e ".[sae]"` (docs/saes.md)."""

from __future__ import annotations

import pytest
import torch

sae_lens = pytest.importorskip("sae_lens", reason="sae-lens is not installed (pip install -e '.[sae]')")
transformer_lens = pytest.importorskip("transformer_lens")

import interp  # noqa: E402

pytestmark = pytest.mark.slow
N = 10


@pytest.fixture(scope="module")
def pair():
    """SAELens's HookedSAETransformer and interp's model, both of one small random GPT-2 built by transformers
    (TransformerLens 3 reads it with its own weight conversion; interp with `from_hf`)."""
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformer_lens.pretrained.weight_conversions import convert_gpt2_weights

    torch.manual_seed(0)
    hf = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=4, n_inner=64, vocab_size=61, n_positions=32,
                                    activation_function="gelu_new")).eval()
    cfg = transformer_lens.HookedTransformerConfig(n_layers=2, d_model=32, n_heads=4, d_head=8, d_mlp=64,
                                                   d_vocab=61, n_ctx=32, act_fn="gelu_new", normalization_type="LN",
                                                   positional_embedding_type="standard", eps=hf.config.layer_norm_epsilon)
    theirs = sae_lens.HookedSAETransformer(cfg)
    theirs.load_and_process_state_dict(convert_gpt2_weights(hf, cfg), fold_ln=False, center_writing_weights=False,
                                       center_unembed=False, fold_value_biases=False)
    return theirs.eval(), interp.from_hf(hf).eval()


def their_sae(kind: str, hook: str, d_in: int, seed: int = 0):
    """A SAELens SAE of `kind` at `hook`, random weights from SAELens's own classes."""
    meta = sae_lens.saes.sae.SAEMetadata(hook_name=hook)
    z = "hook_z" if hook.endswith("hook_z") else "none"
    if kind == "topk":
        sae = sae_lens.TopKSAE(sae_lens.TopKSAEConfig(d_in=d_in, d_sae=48, k=6, metadata=meta, reshape_activations=z))
    elif kind == "jumprelu":
        sae = sae_lens.JumpReLUSAE(sae_lens.JumpReLUSAEConfig(d_in=d_in, d_sae=48, metadata=meta,
                                                              reshape_activations=z))
    else:
        sae = sae_lens.StandardSAE(sae_lens.StandardSAEConfig(d_in=d_in, d_sae=48, metadata=meta,
                                                              reshape_activations=z))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sae.named_parameters():
            p.copy_(torch.rand(p.shape, generator=g) * 0.05 if name == "threshold" else
                    torch.randn(p.shape, generator=g) * 0.3)
    return sae.eval()


CASES = [("standard", "blocks.1.attn.hook_z", 32), ("topk", "blocks.0.hook_resid_post", 32),
         ("jumprelu", "blocks.1.hook_mlp_out", 32)]


@pytest.mark.parametrize("kind, hook, d_in", CASES)
def test_their_sae_on_our_model_gives_their_numbers(pair, kind, hook, d_in):
    theirs, ours = pair
    sae = their_sae(kind, hook, d_in)
    toks = torch.randint(0, 61, (2, N), generator=torch.Generator().manual_seed(1))
    acts = f"{hook}.hook_sae_acts_post"
    with torch.no_grad():
        want, want_cache = theirs.run_with_cache_with_saes(toks, saes=[sae])
        got, got_cache = ours.run_with_cache_with_saes(toks, saes=[sae])
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(got_cache[acts], want_cache[acts], rtol=1e-4, atol=1e-5)
        assert (want - theirs(toks)).abs().max() > 1e-3  # the splice changed something: the check can fail
        f = int(want_cache[acts].sum((0, 1)).argmax())
        off = [(acts, lambda a, hook: a.index_fill(-1, torch.tensor([f]), 0.0))]
        with theirs.saes([sae], use_error_term=True):
            want_edit = theirs.run_with_hooks(toks, fwd_hooks=off)
        with ours.saes([sae], use_error_term=True):
            got_edit = ours.run_with_hooks(toks, fwd_hooks=off)
        torch.testing.assert_close(got_edit, want_edit, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(ours.run_with_saes(toks, saes=[sae], use_error_term=True), ours(toks),
                                   rtol=1e-5, atol=1e-5)
    assert ours.acts_to_saes == {} and theirs.acts_to_saes == {}


def test_code_written_for_saelens_runs_with_the_import_changed(pair, tmp_path):
    """The same lines, SAELens's imports and then interp's: `SAE.load_from_disk`, `add_sae`, `saes`,
    `run_with_cache_with_saes`, `reset_saes`, `acts_to_saes`."""
    theirs, ours = pair
    folder = tmp_path / "sae"
    their_sae("standard", "blocks.1.attn.hook_z", 32).save_model(folder)
    toks = torch.randint(0, 61, (1, N), generator=torch.Generator().manual_seed(2))

    def script(SAE, model):
        sae = SAE.load_from_disk(str(folder))
        model.add_sae(sae)
        logits, cache = model.run_with_cache(toks)
        feats = cache[f"{sae.cfg.metadata.hook_name}.hook_sae_acts_post"]
        in_ = list(model.acts_to_saes)
        model.reset_saes()
        return logits, feats, in_, list(model.acts_to_saes)

    from interp.saes import SAE as OurSAE

    with torch.no_grad():
        want = script(sae_lens.SAE, theirs)
        got = script(OurSAE, ours)
    torch.testing.assert_close(got[0], want[0], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got[1], want[1], rtol=1e-4, atol=1e-5)
    assert got[2:] == want[2:] == (["blocks.1.attn.hook_z"], [])
