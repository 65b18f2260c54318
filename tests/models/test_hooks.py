"""Hook points: names, firing, gradients, scoping, and the ActivationCache built on them."""

from __future__ import annotations

import copy
from collections import Counter

import pytest
import torch

from core_models import OWN_CONFIGS, left_mask, own, tokens
from interp import ActivationCache

N = 7
CONFIGS = ["learned-layernorm", "sinusoidal", "rotary-rms-swiglu-gqa", "rotary-partial-parallel", "no-positions-attn-only",
           "no-norm-mqa-window", "gemma3-like"]
INSTRUMENTED_ONLY = ("hook_attn_scores", "hook_pattern")


def expected_hook_names(cfg) -> set[str]:
    """The TransformerLens-compatible names a config must declare, written out independently."""
    names = {"hook_embed"}
    if cfg.positional in ("learned", "sinusoidal"):
        names.add("hook_pos_embed")
    norms = cfg.normalization is not None
    for l in range(cfg.n_layers):
        b = f"blocks.{l}."
        names |= {b + "hook_resid_pre", b + "hook_attn_out", b + "hook_resid_post"}
        names |= {b + f"attn.hook_{x}" for x in ("q", "k", "v", "attn_scores", "pattern", "z", "result")}
        if cfg.positional == "rotary":
            names |= {b + "attn.hook_rot_q", b + "attn.hook_rot_k"}
        if cfg.qk_norm:  # Gemma 3: RMSNorm of each head's q and k (TransformerLens's q_norm / k_norm, hook_q_normed)
            names |= {b + "attn.hook_q_normed", b + "attn.hook_k_normed"}
            names |= {b + f"attn.{n}.hook_{x}" for n in ("q_norm", "k_norm") for x in ("scale", "normalized")}
        if norms:
            names |= {b + "ln1.hook_scale", b + "ln1.hook_normalized"}
        if cfg.sandwich_norms:  # Gemma 2 / 3: the norms after attention and after the MLP
            names |= {b + "ln1_post.hook_scale", b + "ln1_post.hook_normalized"}
            if not cfg.attn_only:
                names |= {b + "ln2_post.hook_scale", b + "ln2_post.hook_normalized"}
        if not cfg.attn_only:
            names |= {b + "hook_mlp_out", b + "mlp.hook_pre", b + "mlp.hook_post"}
            if cfg.gated_mlp:
                names.add(b + "mlp.hook_pre_linear")
            if not cfg.parallel_attn_mlp:
                names.add(b + "hook_resid_mid")
            if norms:
                names |= {b + "ln2.hook_scale", b + "ln2.hook_normalized"}
    if norms:
        names |= {"ln_final.hook_scale", "ln_final.hook_normalized"}
    return names


@pytest.mark.parametrize("name", CONFIGS)
def test_declared_hook_names(name):
    model = own(name)
    assert set(model.hook_dict) == expected_hook_names(model.cfg)


@pytest.mark.parametrize("backend", ["auto", "instrumented", "fused"])
@pytest.mark.parametrize("name", CONFIGS)
def test_every_hook_fires_exactly_once(name, backend):
    model = own(name)
    names = [n for n in model.hook_dict if backend != "fused" or not n.endswith(INSTRUMENTED_ONLY)]
    fired, shapes = Counter(), {}

    def count(t, hook):
        fired[hook.name] += 1
        shapes[hook.name] = tuple(t.shape)

    with model.attention(backend), model.hooks([(n, count) for n in names]):
        model(tokens(2, N))
    assert fired == Counter({n: 1 for n in names})
    cfg = model.cfg
    assert shapes["blocks.0.attn.hook_q"] == (2, N, cfg.n_heads, cfg.head_dim)
    assert shapes["blocks.0.attn.hook_k"] == shapes["blocks.0.attn.hook_v"] == (2, N, cfg.kv_heads, cfg.head_dim)
    assert shapes["blocks.0.attn.hook_z"] == (2, N, cfg.n_heads, cfg.head_dim)
    assert shapes["blocks.0.attn.hook_result"] == (2, N, cfg.n_heads, cfg.d_model)
    assert shapes["blocks.0.hook_resid_pre"] == (2, N, cfg.d_model)
    if backend != "fused":
        assert shapes["blocks.0.attn.hook_pattern"] == shapes["blocks.0.attn.hook_attn_scores"] == (2, cfg.n_heads, N, N)


@pytest.mark.parametrize("name", CONFIGS)
def test_every_backward_hook_fires_once(name):
    model = own(name)
    fired = Counter()
    with model.hooks(bwd_hooks=[(lambda n: True, lambda g, hook: fired.update([hook.name]))]):
        model(tokens(2, N), return_type="loss").backward()
    model.zero_grad(set_to_none=True)
    assert fired == Counter({n: 1 for n in model.hook_dict})


@pytest.mark.parametrize("name", ["rotary-rms-swiglu-gqa", "learned-layernorm", "sinusoidal"])
def test_backward_hooks_receive_the_gradient_of_the_activation(name):
    model = own(name)
    toks = tokens(2, N)
    names = [n for n in model.hook_dict if n.startswith(("blocks.1", "hook_"))] + ["blocks.0.attn.hook_pattern", "blocks.0.ln1.hook_scale"]
    names = [n for n in names if n in model.hook_dict]
    acts, grads = {}, {}

    def keep(t, hook):
        if not t.requires_grad:  # sinusoidal positions are a buffer: make the activation a leaf
            t = t.detach().requires_grad_(True)
        acts[hook.name] = t
        return t

    with model.hooks([(n, keep) for n in names]):
        loss = model(toks, return_type="loss")
    expected = dict(zip(acts, torch.autograd.grad(loss, list(acts.values()))))

    def keep_grad(g, hook):
        grads[hook.name] = g

    with model.hooks(bwd_hooks=[(n, keep_grad) for n in names]):
        model(toks, return_type="loss").backward()
    model.zero_grad(set_to_none=True)
    assert set(grads) == set(names)
    for n in names:
        torch.testing.assert_close(grads[n], expected[n], msg=n)
        assert grads[n].abs().max() > 0, n


def test_backward_hooks_fire_on_a_frozen_model():
    """Attribution on frozen weights: activations still get their gradients."""
    model = copy.deepcopy(own("learned-layernorm")).requires_grad_(False)
    toks = tokens(2, N)
    got = {}
    with model.hooks(bwd_hooks=[("blocks.1.hook_resid_pre", lambda g, hook: got.update(g=g))]):
        model(toks, return_type="loss").backward()
    acts = {}
    with model.hooks([("blocks.1.hook_resid_pre", lambda t, hook: acts.update(a=t.detach().requires_grad_(True)) or acts["a"])]):
        loss = model(toks, return_type="loss")
    torch.testing.assert_close(got["g"], torch.autograd.grad(loss, acts["a"])[0])


def test_backward_hook_can_replace_the_gradient():
    model = own("learned-layernorm")  # untied: every path from W_E to the loss crosses blocks.1.hook_resid_pre
    with model.hooks(bwd_hooks=[("blocks.1.hook_resid_pre", lambda g, hook: torch.zeros_like(g))]):
        model(tokens(2, N), return_type="loss").backward()
    assert model.embed.W_E.grad.abs().max() == 0 and model.unembed.W_U.grad.abs().max() > 0
    model.zero_grad(set_to_none=True)


# ---- scoping ----------------------------------------------------------------------------------


def no_hooks(model) -> bool:
    return not any(hp.active for hp in model.hook_points())


class Boom(Exception):
    pass


def boom(t, hook):
    raise Boom(hook.name)


def test_hooks_are_removed_even_when_the_forward_raises():
    model = own("rotary-rms-swiglu-gqa")
    toks = tokens(1, N)
    with pytest.raises(Boom):
        with model.hooks([("blocks.0.attn.hook_pattern", lambda t, hook: None), ("blocks.1.hook_resid_post", boom)]):
            model(toks)
    assert no_hooks(model)
    with pytest.raises(Boom):
        model.run_with_hooks(toks, fwd_hooks=[("blocks.0.mlp.hook_post", boom)])
    assert no_hooks(model)
    with pytest.raises(ValueError, match="token ids"):
        model.run_with_cache(torch.tensor([[0, 10_000]]))
    assert no_hooks(model)
    with model.hooks([("blocks.0.hook_resid_pre", boom)]), pytest.raises(Boom):
        model.run_with_cache(toks, names_filter="blocks.1.hook_resid_pre")
    assert no_hooks(model)
    # A bad name half way through: the hooks already added are removed too.
    with pytest.raises(KeyError):
        with model.hooks([("blocks.0.hook_resid_pre", boom), ("blocks.0.hook_bogus", boom)]):
            pass
    assert no_hooks(model)


def test_scoped_hooks_leave_other_hooks_alone():
    model = own("learned-layernorm")
    seen = []
    handle = model.add_hook("blocks.0.hook_resid_pre", lambda t, hook: seen.append("outer"))
    try:
        with model.hooks([("blocks.0.hook_resid_pre", lambda t, hook: seen.append("inner"))]):
            model(tokens(1, N))
        model(tokens(1, N))
        assert seen == ["outer", "inner", "outer"]
        model.run_with_hooks(tokens(1, N), fwd_hooks=[("blocks.0.hook_resid_pre", lambda t, hook: seen.append("run"))])
        assert seen[-2:] == ["outer", "run"]
    finally:
        handle.remove()
    assert no_hooks(model)


def test_handles():
    model = own("learned-layernorm")
    seen = []

    def fn(t, hook):
        seen.append(hook.name)

    h1 = model.add_hook("blocks.0.hook_resid_pre", fn)
    h2 = model.add_hook("blocks.0.hook_resid_pre", fn)  # the same function twice fires twice
    model(tokens(1, N))
    assert seen == ["blocks.0.hook_resid_pre"] * 2
    h1.remove()
    h1.remove()  # removing twice is harmless and does not remove h2
    model(tokens(1, N))
    assert len(seen) == 3
    h2.remove()
    model(tokens(1, N))
    assert len(seen) == 3 and no_hooks(model)
    with model.add_hook(lambda n: n.endswith("hook_resid_post"), fn):  # a predicate: one handle for all
        model(tokens(1, N))
    assert seen[3:] == ["blocks.0.hook_resid_post", "blocks.1.hook_resid_post"] and no_hooks(model)
    model.add_hook("blocks.1.hook_resid_pre", fn)
    model.reset_hooks()
    assert no_hooks(model)


def test_forward_hook_replaces_the_activation():
    model = own("learned-layernorm")
    toks = tokens(2, N)
    with torch.no_grad():
        ref = model(toks)
        out = model.run_with_hooks(toks, fwd_hooks=[("blocks.1.hook_resid_post", lambda t, hook: torch.zeros_like(t))])
    # zero final residual -> LayerNorm gives its bias -> every position's logits = b_ln W_U
    expected = model.ln_final.b @ model.unembed.W_U
    torch.testing.assert_close(out, expected.expand_as(out))
    assert not torch.allclose(out, ref)
    with pytest.raises(ValueError, match="changed the shape"):
        model.run_with_hooks(toks, fwd_hooks=[("blocks.1.hook_resid_post", lambda t, hook: t[:, :1])])
    with pytest.raises(TypeError, match="return a tensor or None"):
        model.run_with_hooks(toks, fwd_hooks=[("blocks.1.hook_resid_post", lambda t, hook: 1.0)])
    assert no_hooks(model)


def test_backward_hooks_in_run_with_hooks_warn():
    model = own("learned-layernorm")
    with pytest.warns(UserWarning, match="reset_hooks_end=False"):
        model.run_with_hooks(tokens(1, N), bwd_hooks=[("blocks.0.hook_resid_pre", lambda g, hook: None)])
    assert no_hooks(model)


def test_unknown_hook_name_suggests_the_closest():
    model = own("learned-layernorm")
    with pytest.raises(KeyError, match="blocks.0.attn.hook_pattern"):
        model.add_hook("blocks.0.attn.hook_patern", boom)
    with pytest.raises(KeyError, match="hook_dict"):
        model.run_with_cache(tokens(1, N), names_filter=["blocks.0.hook_resid_pre", "blocks.9.hook_nothing_like_it"])
    assert no_hooks(model)


def test_names_filter_forms():
    model = own("learned-layernorm")
    toks = tokens(1, N)
    _, c = model.run_with_cache(toks, names_filter="blocks.0.hook_resid_post")
    assert list(c.keys()) == ["blocks.0.hook_resid_post"]
    _, c = model.run_with_cache(toks, names_filter=["blocks.1.attn.hook_pattern", "hook_embed"])
    assert list(c.keys()) == ["hook_embed", "blocks.1.attn.hook_pattern"]  # in the order of the model
    _, c = model.run_with_cache(toks, names_filter=lambda n: n.endswith("hook_z"))
    assert list(c.keys()) == ["blocks.0.attn.hook_z", "blocks.1.attn.hook_z"]
    _, c = model.run_with_cache(toks)
    assert set(c.keys()) == set(model.hook_dict)
    for name, t in c.items():
        assert not t.requires_grad, name


# ---- ActivationCache --------------------------------------------------------------------------


def test_activation_cache_indexing():
    model = own("rotary-rms-swiglu-gqa")
    toks = tokens(2, N)
    logits, cache = model.run_with_cache(toks)
    assert isinstance(cache, ActivationCache)
    torch.testing.assert_close(logits, model(toks))
    assert cache["pattern", 0] is cache["blocks.0.attn.hook_pattern"]
    assert cache["attn", 1] is cache["blocks.1.attn.hook_pattern"]  # TransformerLens's alias
    assert cache["pattern", -1] is cache["blocks.1.attn.hook_pattern"]
    assert cache["resid_pre", -2] is cache["blocks.0.hook_resid_pre"]
    assert cache["normalized", 1, "ln2"] is cache["blocks.1.ln2.hook_normalized"]
    assert cache["scale", 0] is cache["blocks.0.ln1.hook_scale"]
    assert cache["embed"] is cache["hook_embed"]
    assert cache["q", 0].shape == (2, N, 6, 8) and cache["k", 0].shape == (2, N, 2, 8)
    assert cache["rot_q", 1] is cache["blocks.1.attn.hook_rot_q"]
    assert cache["pre", 0] is cache["blocks.0.mlp.hook_pre"]
    assert ("pattern", 0) in cache and "blocks.0.attn.hook_pattern" in cache and ("bogus", 0) not in cache
    assert len(cache) == len(model.hook_dict) and set(cache.keys()) == set(model.hook_dict)
    assert dict(cache.items()).keys() == cache.keys() and len(list(cache.values())) == len(cache)
    with pytest.raises(KeyError, match="names_filter"):
        model.run_with_cache(toks, names_filter="hook_embed")[1]["pattern", 0]
    # The final residual stream normalised and unembedded is the logits.
    torch.testing.assert_close(model.unembed(cache["ln_final.hook_normalized"]), logits)


def test_activation_cache_to_and_remove_batch_dim():
    model = own("learned-layernorm")
    _, cache = model.run_with_cache(tokens(1, N), names_filter=lambda n: "resid" in n or "pattern" in n)
    moved = cache.to("cpu")
    assert moved is not cache and moved.keys() == cache.keys()
    assert all(torch.equal(moved[k], cache[k]) for k in cache)
    single = cache.remove_batch_dim()
    assert single["resid_post", 1].shape == (N, model.cfg.d_model)
    assert single["pattern", 0].shape == (model.cfg.n_heads, N, N)
    torch.testing.assert_close(single["pattern", 0], cache["pattern", 0][0])
    assert single.remove_batch_dim() is single
    _, cache1 = model.run_with_cache(tokens(1, N), names_filter="hook_embed", remove_batch_dim=True)
    assert cache1["embed"].shape == (N, model.cfg.d_model)
    _, cache2 = model.run_with_cache(tokens(2, N), names_filter="hook_embed")
    with pytest.raises(ValueError, match="batch size 1"):
        cache2.remove_batch_dim()


@pytest.mark.parametrize("name", ["rotary-rms-swiglu-gqa", "learned-layernorm", "no-norm-mqa-window"])
def test_stack_head_results_sum_to_attn_out(name):
    model = own(name)
    toks = tokens(2, N)
    for extra in ([], ["hook_result"]):  # computed from hook_z, and read from hook_result
        _, cache = model.run_with_cache(toks, names_filter=lambda n: n.endswith(("hook_z", "hook_attn_out", *extra)))
        stack, labels = cache.stack_head_results(return_labels=True)
        h = model.cfg.n_heads
        assert stack.shape == (model.cfg.n_layers * h, 2, N, model.cfg.d_model)
        assert labels[:2] == ["L0H0", "L0H1"] and labels[-1] == f"L{model.cfg.n_layers - 1}H{h - 1}"
        for l in range(model.cfg.n_layers):
            b_O = model.blocks[l].attn.b_O
            total = stack[l * h : (l + 1) * h].sum(0) + (0 if b_O is None else b_O)
            torch.testing.assert_close(total, cache["attn_out", l], atol=1e-5, rtol=1e-5)
    # Each head's contribution is z_h W_O[h], checked for one head by hand.
    z = cache["z", 0][..., 1, :]
    torch.testing.assert_close(stack[1], z @ model.blocks[0].attn.W_O_flat[model.cfg.head_dim : 2 * model.cfg.head_dim])


def test_stack_activation_and_accumulated_resid():
    model = own("learned-layernorm")
    _, cache = model.run_with_cache(tokens(2, N))
    stacked = cache.stack_activation("resid_pre")
    assert stacked.shape == (2, 2, N, model.cfg.d_model)
    torch.testing.assert_close(stacked[1], cache["resid_pre", 1])
    acc, labels = cache.accumulated_resid(return_labels=True)
    assert labels == ["0_pre", "1_pre", "final_post"]
    torch.testing.assert_close(acc[-1], cache["resid_post", 1])
    assert cache.accumulated_resid(layer=1, return_labels=True)[1] == ["0_pre", "1_pre"]
    # apply_ln at the end runs ln_final itself on each component (TransformerLens 4's logit lens).
    ln = model.ln_final
    acc_ln = cache.accumulated_resid(apply_ln=True)
    torch.testing.assert_close(acc_ln[-1], cache["ln_final.hook_normalized"], atol=1e-5, rtol=1e-5)
    heads = cache.stack_head_results(incl_remainder=True)
    torch.testing.assert_close(heads.sum(0), cache["resid_post", -1], atol=1e-5, rtol=1e-5)
    heads_ln = cache.stack_head_results(incl_remainder=True, apply_ln=True)
    torch.testing.assert_close(heads_ln.sum(0) * ln.w + ln.b, cache["ln_final.hook_normalized"], atol=1e-5, rtol=1e-5)


def test_run_with_cache_incl_bwd_caches_gradients():
    model = own("rotary-rms-swiglu-gqa")
    toks = tokens(2, N)
    names = ["blocks.0.hook_resid_post", "blocks.1.attn.hook_pattern", "blocks.1.mlp.hook_post"]
    loss, cache = model.run_with_cache(toks, return_type="loss", incl_bwd=True, names_filter=names)
    model.zero_grad(set_to_none=True)
    assert loss.dim() == 0
    assert set(cache.keys()) == set(names) | {n + "_grad" for n in names}
    acts = {}
    with model.hooks([(n, lambda t, hook: acts.update({hook.name: t})) for n in names]):
        loss2 = model(toks, return_type="loss")
    grads = torch.autograd.grad(loss2, [acts[n] for n in names])
    torch.testing.assert_close(loss, loss2.detach())
    for n, g in zip(names, grads):
        torch.testing.assert_close(cache[n + "_grad"], g)
        torch.testing.assert_close(cache[n], acts[n].detach())
    assert no_hooks(model)


def test_every_config_declares_its_hooks():
    """The configs not exercised above declare their hook names too (alibi, window, tied)."""
    for name in set(OWN_CONFIGS) - set(CONFIGS):
        assert set(own(name).hook_dict) == expected_hook_names(own(name).cfg), name


@pytest.mark.parametrize("name", list(OWN_CONFIGS))
def test_caching_everything_leaves_the_logits_unchanged(name):
    """Hooking every point switches to the explicit paths (instrumented attention, per-head results,
    LayerNorm with its scale); the output stays that of the plain fused forward."""
    model = own(name)
    toks = tokens(2, N)
    with torch.no_grad():
        ref = model(toks)
    logits, cache = model.run_with_cache(toks)
    torch.testing.assert_close(logits, ref, atol=1e-5, rtol=1e-5)
    assert set(cache.keys()) == set(model.hook_dict)


def test_return_types_and_loss_against_torch_cross_entropy():
    model = own("rotary-rms-swiglu-gqa")
    toks, mask = tokens(3, N), torch.ones(3, N, dtype=torch.long)
    mask[1, :2] = 0
    mask[2, -3:] = 0
    with torch.no_grad():
        logits = model(toks, attention_mask=mask)
        assert model(toks, return_type=None) is None
        both = model(toks, return_type="both", attention_mask=mask)
        loss = model(toks, return_type="loss", attention_mask=mask)
        per_token = model(toks, return_type="loss", attention_mask=mask, loss_per_token=True)
    torch.testing.assert_close(both[0], logits)
    torch.testing.assert_close(both[1], loss)
    ce = torch.nn.functional.cross_entropy(logits[:, :-1].transpose(1, 2), toks[:, 1:], reduction="none")
    pairs = (mask[:, :-1] * mask[:, 1:]).bool()  # predictions from a real token of a real token
    torch.testing.assert_close(loss, ce[pairs].mean())
    torch.testing.assert_close(per_token, ce * pairs)
    with torch.no_grad():
        plain = model(toks, return_type="loss")
    torch.testing.assert_close(plain, torch.nn.functional.cross_entropy(model(toks)[:, :-1].transpose(1, 2), toks[:, 1:]))


@pytest.mark.parametrize("name", ["learned-tied-rms", "alibi-window-untied-bias"])
def test_the_loss_made_a_slab_of_logits_at_a_time_equals_the_loss_of_the_logits(name, monkeypatch):
    """return_type="loss" never builds [batch, pos, vocab] (Gemma's 262k vocabulary): slabs of 5 rows
    here, checkpointed under autograd. Its loss, per-token loss (with padding) and gradients equal
    lm_loss on the whole logits."""
    import interp.models.native.transformer as transformer_module
    from interp.models.base import lm_loss

    model = own(name)
    monkeypatch.setattr(transformer_module, "_NLL_SLAB", 5 * model.cfg.d_vocab)
    monkeypatch.setattr(transformer_module, "_NLL_GRAD_WHOLE", 5 * model.cfg.d_vocab)  # checkpointed slabs
    toks, mask = tokens(3, 9), left_mask(3, 9)
    with torch.no_grad():
        logits = model(toks, attention_mask=mask)
        assert torch.equal(model(toks, return_type="loss"), lm_loss(model(toks), toks))
        per = model(toks, return_type="loss", loss_per_token=True, attention_mask=mask)
        torch.testing.assert_close(per, lm_loss(logits, toks, mask.bool(), per_token=True), rtol=0, atol=1e-6)
        assert (per[0] > 0).all() and (per[2, :4] == 0).all()  # row 2's first 5 tokens are padding
    grads = []
    for loss_of in (lambda: model(toks, return_type="loss"), lambda: lm_loss(model(toks), toks)):
        model.zero_grad(set_to_none=True)
        loss_of().backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    model.zero_grad(set_to_none=True)
    for n in grads[0]:
        torch.testing.assert_close(grads[0][n], grads[1][n], msg=n)
