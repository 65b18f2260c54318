"""`detect_head` against TransformerLens 4's own `detect_head`, run on a TransformerBridge of the same
Hugging Face weights; and its contract (cache untouched, options on every prompt, errors)."""

from __future__ import annotations

import itertools

import pytest
import torch
from analyses_fixtures import build, tokens, word_tokenizer
from hf_cases import VOCAB, build_hf

import interp
from interp.analyses import detect_head, detect_head_frame, detect_heads

KINDS = ("previous_token_head", "duplicate_token_head", "induction_head")
OPTIONS = list(itertools.product((False, True), (False, True), ("mul", "abs")))


def _bridge(hf, tok):
    tl = pytest.importorskip("transformer_lens")
    from transformer_lens.model_bridge.sources._bridge_builder import build_bridge_from_module

    return build_bridge_from_module(hf, type(hf).__name__, hf_config=hf.config, tokenizer=tok)


def _prompt(seed: int, n: int = 12) -> str:
    ids = torch.randint(2, 10, (n,), generator=torch.Generator().manual_seed(seed)).tolist()
    return " ".join(f"t{i}" for i in ids + ids[: n // 2])  # repeats: duplicate and induction targets


@pytest.fixture(scope="module")
def tokenizer():
    return word_tokenizer(VOCAB)


@pytest.mark.parametrize("name", ["gpt2", "llama-gqa"])
def test_detect_head_matches_transformer_lens(name, tokenizer):
    from transformer_lens import head_detector

    hf = build_hf(name)
    ours = interp.from_hf(hf, tokenizer=tokenizer)
    bridge = _bridge(hf, tokenizer)
    prompt = _prompt(1)
    # One forward each (the scoring is what differs between the options); the first call of each
    # side runs the model itself.
    _, tl_cache = bridge.run_with_cache(bridge.to_tokens(prompt), remove_batch_dim=True)
    _, our_cache = ours.run_with_cache(ours.to_tokens(prompt, prepend_bos=True), names_filter=lambda n: "pattern" in n)
    for i, (kind, (xb, xc, measure)) in enumerate(itertools.product(KINDS, OPTIONS)):
        kw = dict(exclude_bos=xb, exclude_current_token=xc, error_measure=measure)
        theirs = head_detector.detect_head(bridge, prompt, kind, cache=tl_cache if i else None, **kw).float()
        mine = detect_head(ours, prompt, kind, cache=our_cache if i else None, **kw)
        # TransformerLens rounds the "abs" score to 3 decimals; ours keeps full precision.
        tol = 1e-4 if measure == "mul" else 5e-4 + 1e-6
        assert (theirs - mine).abs().max() < tol, (kind, kw)


def test_detect_head_list_of_prompts_and_subset_match_transformer_lens(tokenizer):
    from transformer_lens import head_detector

    hf = build_hf("llama-gqa")
    ours, bridge = interp.from_hf(hf, tokenizer=tokenizer), _bridge(hf, tokenizer)
    prompts = [_prompt(2), _prompt(3, n=9)]
    heads = [(0, 1), (1, 4), (1, 0)]
    for kind in KINDS:
        kw = dict(exclude_bos=True, exclude_current_token=True)
        theirs = head_detector.detect_head(bridge, prompts, kind, heads=heads, **kw).float()
        mine = detect_head(ours, prompts, kind, heads=heads, **kw)
        assert (theirs - mine).abs().max() < 1e-4
        assert int((mine == -1).sum()) == 2 * 6 - len(heads)


def test_transformer_lens_scoring_on_our_patterns_matches_detect_heads():
    """TransformerLens's pattern helpers and scorer, fed our cached patterns, give detect_heads' numbers."""
    from transformer_lens import head_detector as hd

    model = build("rotary-gqa")
    toks = tokens(1, 20, seed=4)
    _, cache = model.run_with_cache(toks, names_filter=lambda n: n.endswith("hook_pattern"), remove_batch_dim=True)
    helpers = {"previous_token": hd.get_previous_token_head_detection_pattern,
               "duplicate_token": hd.get_duplicate_token_head_detection_pattern,
               "induction": hd.get_induction_head_detection_pattern}
    for xb, xc, measure in OPTIONS:
        frame = detect_heads(model, toks, method="pattern", exclude_bos=xb, exclude_current_token=xc, error_measure=measure)
        for kind, helper in helpers.items():
            det = helper(toks[0].cpu())
            for l, h in [(0, 0), (1, 5), (1, 2)]:
                theirs = hd.compute_head_attention_similarity_score(
                    cache["pattern", l][h], det, exclude_bos=xb, exclude_current_token=xc, error_measure=measure)
                mine = frame.query("kind == @kind and layer == @l and head == @h")["score"].item()
                assert abs(theirs - mine) < (1e-5 if measure == "mul" else 5e-4 + 1e-6)


def test_cache_is_read_not_modified():
    model = build("learned")
    toks = tokens(1, 16, seed=1)
    _, cache = model.run_with_cache(toks, names_filter=lambda n: n.endswith("hook_pattern"), remove_batch_dim=True)
    before = {k: v.clone() for k, v in cache.items()}
    with_cache = detect_head(model, toks, "duplicate_token_head", cache=cache, exclude_bos=True, exclude_current_token=True)
    without = detect_head(model, toks, "duplicate_token_head", exclude_bos=True, exclude_current_token=True)
    assert all(torch.equal(before[k], cache[k]) for k in before)
    assert torch.allclose(with_cache, without, atol=1e-6)


def test_custom_pattern_equals_named_and_options_apply_to_every_prompt():
    model = build("learned")
    toks = tokens(3, 14, seed=2)
    named = detect_head(model, toks, "previous_token", exclude_bos=True)
    custom = detect_head(model, toks, torch.ones(13).diag(-1), exclude_bos=True)
    assert torch.allclose(named, custom, atol=1e-6)
    per_row = torch.stack([detect_head(model, row, "previous_token", exclude_bos=True) for row in toks]).mean(0)
    assert torch.allclose(named, per_row, atol=1e-6)
    assert not torch.allclose(named, detect_head(model, toks, "previous_token"), atol=1e-3)
    frame = detect_head_frame(model, toks, "previous_token", heads=[(1, 2)], exclude_bos=True)
    assert list(frame[["layer", "head"]].itertuples(index=False, name=None)) == [(1, 2)]
    assert frame["score"].item() == pytest.approx(float(named[1, 2]), abs=1e-6)


def test_errors_say_what_to_do():
    model = build("learned")
    toks = tokens(2, 10)
    with pytest.raises(ValueError, match="unknown head kind"):
        detect_head(model, toks, "bigram_head")
    with pytest.raises(ValueError, match="lower triangular"):
        detect_head(model, toks[:1], torch.ones(10, 10))
    with pytest.raises(ValueError, match="one prompt"):
        _, cache = model.run_with_cache(toks[:1])
        detect_head(model, toks, "induction", cache=cache)
    with pytest.raises(ValueError, match=r"\(layer, head\)"):
        detect_head(model, toks, "induction", heads=[(5, 0)])
