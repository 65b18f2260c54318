"""Readers that are not interp hooks see the instrumented hook points: PyTorch module hooks and nnsight.

interp's attention runs fused (no scores, no pattern) unless something asks for them. Whenever a layer runs
the instrumented path (forced with `model.attention("instrumented")`, `model.attention_backend = ...`, per layer,
or chosen because an interp hook or the cache reads its pattern), its hook points are called as modules, hooked
or not: `hook_attn_scores` and `hook_pattern` on native and wrapped layers, and on a wrapped layer also `hook_q`,
`hook_k`, `hook_v` and `hook_z` (which its fused path calls only when hooked). `hook_result` is called on every
call while `model.set_use_attn_result(True)` is on. So `register_forward_hook` fires and nnsight (which wraps each module's
forward, with no torch hooks: nothing tells "auto" that it reads a module) can read and edit them.

The nnsight tests run where nnsight is installed (0.8.1 was measured); they skip elsewhere. Every nnsight test
wraps a model of its own: `nnsight.NNsight` installs its forward on every module for good.
"""

from __future__ import annotations

import pytest
import torch
from core_models import build, small, tokens
from wrapped_cases import VOCAB as WRAPPED_VOCAB
from wrapped_cases import build_wrapped_hf

import interp
from interp.kernels import attention as kernels_attention
from interp.models.wrapped import attention_function

PATTERN, SCORES = "blocks.1.attn.hook_pattern", "blocks.1.attn.hook_attn_scores"


@pytest.fixture
def nnsight():
    return pytest.importorskip("nnsight", reason="nnsight is not installed (pip install nnsight)")


def native():
    return build(small())


def wrapped():
    pytest.importorskip("transformers")
    return interp.from_hf(build_wrapped_hf("gemma"))


MODELS = {"native": (native, lambda: tokens(2, 10)), "wrapped": (wrapped, lambda: tokens(2, 12, vocab=WRAPPED_VOCAB))}


def zero_head_0(pattern, hook=None):
    """The edit both sides make: head 0 attends nowhere (its pattern rows all zero)."""
    pattern = pattern.clone()
    pattern[:, 0] = 0
    return pattern


def cached(model, toks, *names):
    """What interp's own cache holds at `names`, every layer instrumented as under the forced backend."""
    with model.attention("instrumented"):
        _, cache = model.run_with_cache(toks, names_filter=list(names))
    return [cache[n] for n in names]


def recording(model, *names):
    """Plain PyTorch forward hooks on the hook point modules `names`: {name: [outputs]} and their handles."""
    seen = {n: [] for n in names}
    handles = [model.hook_dict[n].register_forward_hook(lambda m, args, out, n=n: seen[n].append(out.detach()))
               for n in names]
    return seen, handles


def counting(monkeypatch):
    """Counts the calls that build a pattern: the instrumented backend (native) and the explicit path (wrapped)."""
    calls = []
    backend = kernels_attention.ATTENTION_BACKENDS["instrumented"]

    def instrumented(*args, **kwargs):
        calls.append("native")
        return backend.fn(*args, **kwargs)

    explicit = attention_function._explicit

    def wrapped_explicit(*args, **kwargs):
        calls.append("wrapped")
        return explicit(*args, **kwargs)

    monkeypatch.setitem(kernels_attention.ATTENTION_BACKENDS, "instrumented",
                        kernels_attention.AttentionBackend(**{**backend.__dict__, "fn": instrumented}))
    monkeypatch.setattr(attention_function, "_explicit", wrapped_explicit)
    return calls


# ---- PyTorch module hooks (no nnsight needed) ------------------------------------------------------------


@pytest.mark.parametrize("kind", list(MODELS))
def test_module_hooks_fire_once_per_forward_under_the_forced_instrumented_path(kind):
    make, toks_of = MODELS[kind]
    model, toks = make(), toks_of()
    scores, pattern = cached(model, toks, SCORES, PATTERN)
    seen, handles = recording(model, SCORES, PATTERN)
    with torch.no_grad():
        with model.attention("instrumented"):
            model(toks)
        assert [len(v) for v in seen.values()] == [1, 1]
        assert torch.equal(seen[SCORES][0], scores) and torch.equal(seen[PATTERN][0], pattern)
        model.attention_backend = "instrumented"  # the property: the same
        try:
            model(toks)
        finally:
            model.attention_backend = "auto"
        assert [len(v) for v in seen.values()] == [2, 2]
        assert torch.equal(seen[PATTERN][1], pattern)
    for h in handles:
        h.remove()


@pytest.mark.parametrize("kind", list(MODELS))
def test_a_layer_requested_instrumented_calls_its_own_hook_points_only(kind):
    make, toks_of = MODELS[kind]
    model, toks = make(), toks_of()
    seen, handles = recording(model, "blocks.0.attn.hook_pattern", PATTERN)
    with torch.no_grad(), model.attention("instrumented", layers=[1]):
        model(toks)
    assert len(seen["blocks.0.attn.hook_pattern"]) == 0 and len(seen[PATTERN]) == 1
    for h in handles:
        h.remove()


@pytest.mark.parametrize("kind", list(MODELS))
def test_a_module_hook_that_returns_a_pattern_edits_it_as_an_interp_hook_does(kind):
    make, toks_of = MODELS[kind]
    model, toks = make(), toks_of()
    with torch.no_grad(), model.attention("instrumented"):
        clean = model(toks)
        expected = model.run_with_hooks(toks, fwd_hooks=[(PATTERN, zero_head_0)])
        handle = model.hook_dict[PATTERN].register_forward_hook(lambda m, args, out: zero_head_0(out))
        try:
            edited = model(toks)
        finally:
            handle.remove()
    assert not torch.equal(edited, clean)
    assert torch.equal(edited, expected)


@pytest.mark.parametrize("kind", list(MODELS))
def test_the_default_fused_path_builds_no_pattern_and_calls_no_pattern_hook_point(kind, monkeypatch):
    make, toks_of = MODELS[kind]
    model, toks = make(), toks_of()
    calls = counting(monkeypatch)
    seen, handles = recording(model, SCORES, PATTERN)
    with torch.no_grad():
        model(toks)  # "auto", nothing hooked: fused in every layer
        assert calls == [] and all(len(v) == 0 for v in seen.values())
        with model.attention("instrumented"):  # the spy does see the instrumented path
            model(toks)
    assert calls == [kind] * model.cfg.n_layers and all(len(v) == 1 for v in seen.values())
    for h in handles:
        h.remove()


def test_a_wrapped_layer_calls_every_hook_point_of_its_attention_when_instrumented():
    model, toks = wrapped(), MODELS["wrapped"][1]()
    names = [f"blocks.1.attn.hook_{n}" for n in ("q", "k", "v", "attn_scores", "pattern", "z")]
    expected = cached(model, toks, *names)
    seen, handles = recording(model, *names)
    with torch.no_grad():
        model(toks)
        assert all(len(v) == 0 for v in seen.values())  # fused: none built, none called
        with model.attention("instrumented"):
            model(toks)
    for (n, got), want in zip(seen.items(), expected):
        assert len(got) == 1 and torch.equal(got[0], want), n
    for h in handles:
        h.remove()


def test_hook_result_is_called_on_every_call_while_use_attn_result_is_on():
    model, toks = native(), tokens(2, 10)
    name = "blocks.0.attn.hook_result"
    _, cache = model.run_with_cache(toks, names_filter=name)
    seen, handles = recording(model, name)
    with torch.no_grad():
        model(toks)
        assert seen[name] == []  # off by default: the fused path computes no per-head result
        model.set_use_attn_result(True)  # TransformerLens's switch
        logits = model(toks)
    assert len(seen[name]) == 1 and torch.equal(seen[name][0], cache[name])
    torch.testing.assert_close(logits, model(toks).detach())  # the same output, summed over heads
    for h in handles:
        h.remove()


# ---- nnsight ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", list(MODELS))
def test_nnsight_reads_scores_and_pattern_under_the_forced_instrumented_path(kind, nnsight):
    make, toks_of = MODELS[kind]
    model, toks = make(), toks_of()
    scores, pattern = cached(model, toks, SCORES, PATTERN)
    traced = nnsight.NNsight(model)
    with model.attention("instrumented"):  # around the trace: the model runs when the trace block ends
        with traced.trace(toks):
            attn = traced.blocks[1].attn
            got_scores = attn.hook_attn_scores.output.save()  # in the order the model computes them
            got_pattern = attn.hook_pattern.output.save()
    assert torch.equal(got_scores, scores) and torch.equal(got_pattern, pattern)


def test_nnsight_cannot_read_a_pattern_the_fused_default_never_builds(nnsight):
    model, toks = native(), tokens(2, 10)
    traced = nnsight.NNsight(model)
    with pytest.raises(Exception, match="already ran past"):  # nnsight's OutOfOrderError
        with traced.trace(toks):
            traced.blocks[1].attn.hook_pattern.output.save()
    with model.attention("instrumented", layers=[1]):  # forcing the one layer read is enough
        with traced.trace(toks):
            got = traced.blocks[1].attn.hook_pattern.output.save()
    assert torch.equal(got, model.run_with_cache(toks, names_filter=PATTERN)[1][PATTERN])


@pytest.mark.parametrize("kind", list(MODELS))
def test_an_nnsight_edit_of_the_pattern_equals_the_same_run_with_hooks_edit(kind, nnsight):
    make, toks_of = MODELS[kind]
    model, toks = make(), toks_of()
    with torch.no_grad(), model.attention("instrumented", layers=[1]):  # what "auto" runs for the hooked run
        clean = model(toks)
    expected = model.run_with_hooks(toks, fwd_hooks=[(PATTERN, zero_head_0)])
    traced = nnsight.NNsight(model)
    with torch.no_grad(), model.attention("instrumented", layers=[1]):
        with traced.trace(toks):
            traced.blocks[1].attn.hook_pattern.output[:, 0] = 0  # head 0 of layer 1 attends nowhere
            edited = traced.output.save()
    assert not torch.equal(edited, clean)
    assert torch.equal(edited, expected)


def test_nnsight_reads_hook_result_while_use_attn_result_is_on(nnsight):
    model, toks = native(), tokens(2, 10)
    name = "blocks.0.attn.hook_result"
    want = model.run_with_cache(toks, names_filter=name)[1][name]
    model.set_use_attn_result(True)
    traced = nnsight.NNsight(model)
    with traced.trace(toks):
        got = traced.blocks[0].attn.hook_result.output.save()
    assert torch.equal(got, want)
