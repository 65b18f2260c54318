"""detect_heads (streaming vs materialised patterns), the model/KV-cache statistics wiring,
hand-built heads, Olsson et al.'s induction scores and the ICL score."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F
from analyses_fixtures import build, force_attention, tokens

from interp.analyses import (
    detect_heads,
    icl_score,
    induction_scores,
    kv_cache_attention_stats,
    model_attention_stats,
)
from interp.analyses.heads import earlier_occurrences

OPTIONS = list(itertools.product((False, True), (False, True), ("mul", "abs")))


@pytest.mark.parametrize("name", ["learned", "rotary-gqa", "alibi-window"])
def test_streaming_equals_pattern(name):
    model = build(name)
    toks = tokens(3, 40, seed=1)
    for xb, xc, measure in OPTIONS:
        kw = dict(exclude_bos=xb, exclude_current_token=xc, error_measure=measure)
        a = detect_heads(model, toks, method="streaming", **kw)
        b = detect_heads(model, toks, method="pattern", **kw)
        assert (a[["layer", "head", "kind"]] == b[["layer", "head", "kind"]]).all().all()
        assert (a["score"] - b["score"]).abs().max() < 1e-5, kw


def test_streaming_never_materialises_a_pattern_at_long_context():
    """Forced onto the fused backend (which raises if anything asks for a pattern), the streaming
    method still runs, and equals the pattern method."""
    model = build("rotary-gqa")
    toks = tokens(1, 1024, seed=9)
    with model.attention("fused"):
        a = detect_heads(model, toks, method="streaming", exclude_bos=True)
        with pytest.raises(RuntimeError, match="fused"):
            detect_heads(model, toks[:, :8], method="pattern")
    b = detect_heads(model, toks, method="pattern", exclude_bos=True)
    assert (a["score"] - b["score"]).abs().max() < 1e-5


def test_streaming_equals_pattern_with_right_padding():
    model = build("rotary-gqa")
    toks = tokens(3, 30, seed=2)
    mask = torch.ones_like(toks)
    mask[1, 22:] = 0
    mask[2, 9:] = 0
    for xb, xc, measure in [(False, False, "mul"), (True, True, "abs"), (True, False, "mul")]:
        kw = dict(exclude_bos=xb, exclude_current_token=xc, error_measure=measure, attention_mask=mask)
        a = detect_heads(model, toks, method="streaming", **kw)
        b = detect_heads(model, toks, method="pattern", **kw)
        assert (a["score"] - b["score"]).abs().max() < 1e-5
        # a padded batch scores as the mean of its rows, each alone and unpadded
        alone = [detect_heads(model, toks[i : i + 1, :n], method="pattern", exclude_bos=xb, exclude_current_token=xc,
                              error_measure=measure)["score"] for i, n in enumerate((30, 22, 9))]
        assert (a["score"] - sum(alone) / 3).abs().max() < 1e-5
    left = mask.flip(1)
    with pytest.raises(ValueError, match="right padding"):
        detect_heads(model, toks, attention_mask=left)


def test_model_and_kv_cache_stats_match_the_materialised_pattern():
    model = build("rotary-gqa")
    toks = tokens(2, 24, seed=3)
    _, cache = model.run_with_cache(toks, names_filter=lambda n: n.endswith("hook_pattern"))
    stats = model_attention_stats(model, toks)
    kv = model.new_kv_cache(2, 24, capture_queries=True)
    model(toks[:, :10], kv_cache=kv)
    model(toks[:, 10:], kv_cache=kv)
    from_cache = kv_cache_attention_stats(model, kv)
    n = toks.shape[1]
    for l in range(model.cfg.n_layers):
        pattern = cache["pattern", l]  # [batch, head, q, k]
        prev = torch.cat([torch.zeros(2, 6, 1), pattern.diagonal(-1, -2, -1)], dim=-1)
        assert torch.allclose(stats[l].previous, prev, atol=1e-5)
        assert torch.allclose(stats[l].sink, pattern[..., 0], atol=1e-5)
        entropy = -(pattern * pattern.clamp(min=1e-30).log()).sum(-1)
        assert torch.allclose(stats[l].entropy, entropy, atol=1e-4)
        for name in ("previous", "duplicate", "induction", "sink", "entropy"):
            assert torch.allclose(getattr(stats[l], name), getattr(from_cache[l], name), atol=1e-5)
    assert n == from_cache[0].shape[-1]


def test_earlier_occurrences_counts_by_brute_force():
    toks = tokens(4, 50, seed=5, vocab=6)
    brute = torch.tensor([[int((row[:p] == row[p]).sum()) for p in range(50)] for row in toks])
    assert torch.equal(earlier_occurrences(toks), brute)


def test_forced_previous_token_head_scores_one():
    model = build("wide-head")  # d_head 16: one-hot codes for 16 positions
    toks = tokens(2, 16, seed=6)
    with model.hooks(force_attention(model, 1, 2, lambda p: max(p - 1, 0))):
        for method in ("streaming", "pattern"):
            frame = detect_heads(model, toks, kinds=["previous_token"], method=method, exclude_bos=True)
            score = frame.set_index(["layer", "head"])["score"]
            assert score[(1, 2)] == pytest.approx(1.0, abs=1e-6)
            assert score.drop((1, 2)).max() < 0.9
            plain = detect_heads(model, toks, kinds=["previous_token"], method=method)
            # without exclude_bos, query 0 (which can only see itself) counts against it: (n - 1) / n
            assert plain.set_index(["layer", "head"])["score"][(1, 2)] == pytest.approx(15 / 16, abs=1e-6)


def test_forced_induction_head_in_olsson_scores():
    model = build("learned")
    seq_len, bos = 6, 1

    def stripe(pattern, hook):
        out = torch.zeros_like(pattern)
        n = pattern.shape[-1]
        for p in range(n):
            j = p - seq_len + 1 if p >= bos + seq_len else p
            out[:, 3, p, j] = 1.0
        out[:, :3], out[:, 4:] = pattern[:, :3], pattern[:, 4:]
        return out

    with model.hooks([("blocks.1.attn.hook_pattern", stripe)]):
        frame = induction_scores(model, seq_len=seq_len, n_repeats=3, batch_size=4, seed=1)
    s = frame.set_index(["kind", "layer", "head"])["score"]
    assert s[("induction", 1, 3)] == pytest.approx(1.0)
    assert s[("prefix_matching", 1, 3)] == pytest.approx(1.0)
    assert s[("duplicate_token", 1, 3)] == pytest.approx(0.0)
    assert s[("induction", 0, 3)] < 0.9


def test_induction_scores_are_the_stripe_of_the_pattern():
    model = build("attn-only-3l")
    frame = induction_scores(model, seq_len=7, n_repeats=2, batch_size=3, seed=2)
    from interp.analyses import repeated_random_tokens

    toks = repeated_random_tokens(model.cfg.d_vocab, 7, 2, 3, seed=2, bos_token_id=0)
    assert toks[0, 0] == 0 and torch.equal(toks[:, 1:8], toks[:, 8:]) and not bool((toks[:, 1:] == 0).any())
    _, cache = model.run_with_cache(toks, names_filter=lambda n: n.endswith("hook_pattern"))
    dest = torch.arange(8, 15)
    for l in range(3):
        a = cache["pattern", l]
        want = a[:, :, dest, dest - 6].mean((0, 2))
        got = frame.query("kind == 'induction' and layer == @l").sort_values("head")["score"].to_numpy()
        assert torch.allclose(torch.tensor(got), want, atol=1e-6)
    assert {"loss_first_copy", "loss_repeats"} <= set(frame.attrs)


def test_icl_score_from_hand_computed_losses():
    model = build("learned")
    toks = tokens(3, 40, seed=8)
    row = icl_score(model, toks, early=5).iloc[0]  # late=None: the last position
    with torch.no_grad():
        logits = model(toks)
    nll = F.cross_entropy(logits[:, :-1].flatten(0, 1), toks[:, 1:].flatten(), reduction="none").view(3, 39)
    assert row["late"] == 39
    assert row["loss_early"] == pytest.approx(float(nll[:, 4].mean()), abs=1e-5)  # token 5 <- tokens[:5]
    assert row["loss_late"] == pytest.approx(float(nll[:, 38].mean()), abs=1e-5)
    assert row["icl_score"] == pytest.approx(row["loss_late"] - row["loss_early"])
    with pytest.raises(ValueError, match="early < late"):
        icl_score(model, toks, early=39, late=39)
    with pytest.raises(ValueError, match="late=500 is beyond the 40-token sequences"):
        icl_score(model, toks, early=5, late=500)  # never clipped silently


def test_auto_scan_picks_patterns_for_short_sequences_and_streaming_for_long():
    from interp.analyses.heads import resolve_method

    gqa, mha = build("rotary-gqa"), build("learned")
    assert resolve_method(gqa, tokens(4, 64), "auto") == "pattern"
    assert resolve_method(gqa, tokens(1, 200), "auto") == "streaming"
    assert resolve_method(mha, tokens(1, 200), "auto") == "pattern"
    assert resolve_method(mha, tokens(2000, 256), "auto") == "streaming"  # the pattern would not fit the budget
    assert resolve_method(gqa, tokens(1, 20), "streaming") == "streaming"  # an explicit choice stands
    frame = detect_heads(gqa, tokens(2, 20))
    assert set(frame["method"]) == {"pattern"}
    same = detect_heads(gqa, tokens(2, 20), method="streaming")
    assert (frame["score"] - same["score"]).abs().max() < 1e-5
