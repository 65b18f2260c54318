"""Streaming attention statistics (interp.kernels.attention_stats) against a materialised pattern.

Every backend is held to the float64 oracle: the fused route (torch's fused attention kernel, its
logsumexp and the pairwise gathers; with the device's kernel and with its plain-torch stand-in, which
is how the CUDA route's block merging is checked here) and the tiled kernels (torch; Triton under its
interpreter). Tests that must fail do: a mutated pair rule or a perturbed logsumexp is caught.

The reference below builds the full pattern (scores -> mask -> softmax, in float64) and the
TransformerLens detection patterns explicitly, then sums. Sequence lengths are odd (mostly
prime), differ between n_q, n_k, heads and d, and are never multiples of the block sizes, so
a transposed axis or an off-by-one block edge cannot pass.

Tolerance: 1e-5 absolute on every statistic but ``distance``, which is measured in positions, so
its float32 round-off grows with the positions (a float32 materialised pattern has the same error):
its difference is taken relative to the largest distance.

The Triton kernel runs under TRITON_INTERPRET=1 in a subprocess (the variable must be set
before Triton is imported); that subprocess re-enters this file (``--interpreter-worker``) so
it uses the same cases and the same reference. A second one (``--native-worker``, no
interpreter) compiles the kernel for sm_90, since no GPU is needed to catch compile errors
and register spills.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from core_models import scored

from interp.kernels import AttentionStats, Scoring, attention_stats
from interp.kernels.stats import STAT_NAMES
from interp.kernels.stats.reference import (
    duplicate_detection_pattern,
    induction_detection_pattern,
    previous_detection_pattern,
    reference_stats,
)

TOL = 1e-5
BACKENDS = ("torch", "fused")


def max_abs_diff(stats: AttentionStats, ref: dict[str, torch.Tensor]) -> dict[str, float]:
    """Per statistic: max |diff| where both are finite; inf if the NaN positions differ. ``distance`` is in
    positions, so its difference is taken relative to the largest distance (when that exceeds 1): float32
    keeps ~7 digits of a number, whatever its size."""
    diffs = {}
    for name in STAT_NAMES:
        got, want = getattr(stats, name).double().cpu(), ref[name]
        assert got.shape == want.shape, (name, got.shape, want.shape)
        if not torch.equal(got.isnan(), want.isnan()):
            diffs[name] = float("inf")
            continue
        ok = ~want.isnan()
        diffs[name] = float((got[ok] - want[ok]).abs().max()) if ok.any() else 0.0
        if name == "distance" and ok.any():
            diffs[name] /= max(1.0, float(want[ok].abs().max()))
    return diffs


# --------------------------------------------------------------------------------------------
# Cases
# --------------------------------------------------------------------------------------------


def make_inputs(
    batch=2, heads=3, kv_heads=None, n_q=37, n_k=None, d=16, vocab=11, seed=0,
    left_pad=None, alibi=False, dtype=torch.float32,
):
    """Random q/k and a random token sequence repeated twice (so induction/duplicate fire)."""
    g = torch.Generator().manual_seed(seed)
    kv_heads = kv_heads or heads
    n_k = n_k or n_q
    q = torch.randn(batch, heads, n_q, d, generator=g).to(dtype)
    k = torch.randn(batch, kv_heads, n_k, d, generator=g).to(dtype)
    half = torch.randint(0, vocab, (batch, (n_k + 1) // 2), generator=g)
    tokens = torch.cat([half, half], dim=1)[:, :n_k]
    extra = {}
    if left_pad is not None:  # left_pad[b] padding positions at the start of sequence b
        extra["key_padding_mask"] = torch.arange(n_k)[None, :] >= torch.tensor(left_pad)[:, None]
    if alibi:
        extra["alibi_slopes"] = 2.0 ** -torch.arange(1, heads + 1, dtype=torch.float32)
    return q, k, tokens, extra


# name -> (make_inputs kwargs, attention_stats kwargs)
CASES = {
    "mha": (dict(), dict()),
    "gqa": (dict(heads=6, kv_heads=2, n_q=41), dict()),
    "mqa": (dict(heads=5, kv_heads=1, n_q=29), dict()),
    "window": (dict(n_q=43), dict(window=5)),
    "left_padding": (dict(n_q=31, left_pad=[0, 7]), dict()),
    "suffix": (dict(n_q=11, n_k=41), dict()),
    "suffix_window_gqa": (dict(heads=4, kv_heads=2, n_q=13, n_k=47), dict(window=9, n_sink=2)),
    "non_causal": (dict(n_q=23, left_pad=[3, 0]), dict(causal=False)),
    "non_causal_window": (dict(n_q=19, n_k=29), dict(causal=False, window=7)),
    "n_sink": (dict(n_q=33), dict(n_sink=4)),
    "alibi": (dict(n_q=37, alibi=True), dict()),
    "alibi_padding_window": (dict(heads=4, kv_heads=2, n_q=17, n_k=31, left_pad=[5, 2], alibi=True),
                             dict(window=11, n_sink=3)),
    "scale": (dict(d=7), dict(scale=0.6)),
}

# Blocks: smaller and larger than the sizes, block_k < block_q and the reverse, and odd.
BLOCKS = [(8, 16), (16, 8), (5, 3), (None, None)]


def run_case(name, backend="torch", block_q=None, block_k=None, with_tokens=True, dtype=torch.float32, **overrides):
    data_kw, stats_kw = CASES[name]
    q, k, tokens, extra = make_inputs(**{**data_kw, **overrides}, dtype=dtype)
    tokens = tokens if with_tokens else None
    got = attention_stats(q, k, tokens, **scored(backend=backend, block_q=block_q, block_k=block_k, **stats_kw, **extra))
    ref = reference_stats(q, k, tokens, **scored(**stats_kw, **extra))
    return got, ref


# --------------------------------------------------------------------------------------------
# Torch backend against the reference
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("blocks", BLOCKS, ids=lambda b: f"{b[0]}x{b[1]}")
@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("backend", BACKENDS)
def test_backend_matches_materialised_pattern(backend, name, blocks):
    got, ref = run_case(name, backend, *blocks)
    diffs = max_abs_diff(got, ref)
    assert max(diffs.values()) < TOL, diffs
    for value in got.to_dict().values():
        assert value.dtype == torch.float32 and value.shape == ref["sink"].shape


@pytest.mark.parametrize("backend", BACKENDS)
def test_left_padding_queries_are_nan(backend):
    got, ref = run_case("left_padding", backend)
    # sequence 1 has 7 padding keys at the start: under the causal mask its first 7 queries see
    # only padding -> NaN in every statistic; sequence 0 has none.
    for value in got.to_dict().values():
        assert value[1, :, :7].isnan().all() and not value[1, :, 7:].isnan().any()
        assert not value[0].isnan().any()


@pytest.mark.parametrize("backend", BACKENDS)
def test_without_tokens_duplicate_and_induction_are_nan(backend):
    got, ref = run_case("gqa", backend, with_tokens=False)
    assert got.duplicate.isnan().all() and got.induction.isnan().all()
    assert max(max_abs_diff(got, ref).values()) < TOL


@pytest.mark.parametrize("case", ["suffix_window_gqa", "alibi_padding_window", "mha"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("backend", BACKENDS)
def test_half_precision_inputs_computed_in_float32(backend, dtype, case):
    got, ref = run_case(case, backend, dtype=dtype)  # reference sees the same rounded values
    assert got.sink.dtype == torch.float32
    assert max(max_abs_diff(got, ref).values()) < TOL


# --------------------------------------------------------------------------------------------
# The fused route: its pieces, the block merging, and checks that must fail
# --------------------------------------------------------------------------------------------


def _fused(name, attend=None, block_q=None, **overrides):
    """The fused route on a case, straight (optionally with another fused call), and the oracle."""
    from interp.kernels.stats.common import validate
    from interp.kernels.stats.fused import attention_stats_fused

    data_kw, stats_kw = CASES[name]
    q, k, tokens, extra = make_inputs(**{**data_kw, **overrides})
    causal = stats_kw.get("causal", True)
    scoring = Scoring(scale=stats_kw.get("scale"), window=stats_kw.get("window"), alibi_slopes=extra.get("alibi_slopes"),
                      causal=causal)
    args = validate(q, k, tokens, scoring, n_sink=stats_kw.get("n_sink", 1), key_padding_mask=extra.get("key_padding_mask"))
    got = attention_stats_fused(q, k, attend=attend, block_q=block_q, **args)
    return AttentionStats.from_stacked(got), reference_stats(q, k, tokens, **scored(**stats_kw, **extra))


@pytest.mark.parametrize("block_q", [None, 4, 7])
@pytest.mark.parametrize("name", list(CASES))
def test_fused_route_with_the_plain_torch_call_matches(name, block_q):
    """The blocks, their masks and the logsumexp merging, through the fused call written in torch ops
    (what a device without a fused kernel runs; on CUDA the same blocks go to the efficient kernel)."""
    from interp.kernels.stats.fused import attend_math

    got, ref = _fused(name, attend_math, block_q)
    assert max(max_abs_diff(got, ref).values()) < TOL


def test_fused_route_over_several_default_blocks():
    """Past one default block (2,048 queries): the keys before a block come in one unmasked call and the
    block's own square in a causal one; their logsumexps merge. The distance stays accurate to
    ~eps * (distance + block), not eps * position. GQA, a sequence of 2,500 with a suffix of queries."""
    got, ref = run_case("gqa", "fused", n_q=2300, n_k=2500, heads=2, kv_heads=1, d=8, vocab=50, batch=1)
    diffs = max_abs_diff(got, ref)
    assert max(diffs.values()) < TOL, diffs  # distance: relative to distances up to 2,500


@pytest.mark.parametrize("backend", BACKENDS)
def test_learned_sink_logits_equal_the_oracle(backend):
    """gpt-oss's sink logits join each row's denominator: the fused route scales the separable
    statistics by the keys' share r and takes the entropy as r (H_keys - log r)."""
    g = torch.Generator().manual_seed(3)
    for name in ("gqa", "window", "left_padding", "alibi_padding_window", "suffix_window_gqa"):
        data_kw, stats_kw = CASES[name]
        q, k, tokens, extra = make_inputs(**data_kw)
        sinks = torch.randn(q.shape[1], generator=g) * 3
        got = attention_stats(q, k, tokens, **scored(backend=backend, sink_logits=sinks, **stats_kw, **extra))
        ref = reference_stats(q, k, tokens, **scored(sink_logits=sinks, **stats_kw, **extra))
        assert max(max_abs_diff(got, ref).values()) < TOL, name
        plain = attention_stats(q, k, tokens, **scored(**stats_kw, **extra))
        assert float((got.entropy - plain.entropy).nan_to_num().abs().max()) > 1e-2  # the sinks matter


def test_auto_runs_fused_without_max_where_it_is_exact_and_the_tiles_elsewhere(monkeypatch):
    """As measured (BENCHMARKS.md): the fused route for statistics without `max` off CUDA; with `max` (the
    default: all seven) the tiles, which get the row max free; and the tiles for layers it cannot do."""
    import interp.kernels.stats as stats_module
    from interp.kernels import resolve_backend

    atlas = ("sink", "previous", "duplicate", "induction")
    assert resolve_backend("auto", "cpu", stats=atlas) == "fused" and resolve_backend("auto", "mps", stats=atlas) == "fused"
    assert resolve_backend("auto", "cpu") == "torch" and resolve_backend("auto", "cpu", stats=["max"]) == "torch"
    assert resolve_backend("auto", "cpu", stats=atlas, softcap=True) == "torch"
    assert resolve_backend("auto", "cpu", stats=atlas, causal=False, alibi=True) == "torch"
    assert resolve_backend("auto", "cpu", stats=atlas, causal=True, alibi=True) == "fused"
    monkeypatch.setattr(stats_module, "_triton_available", lambda: True)
    assert resolve_backend("auto", "cuda", stats=atlas) == "triton"  # until the GPU table says otherwise
    assert resolve_backend("auto", "cuda", stats=atlas, sink_logits=True) == "torch"
    calls = []
    real = stats_module.attention_stats_fused
    monkeypatch.setattr(stats_module, "attention_stats_fused", lambda *a, **k: calls.append(1) or real(*a, **k))
    q, k, tokens, extra = make_inputs(n_q=19)
    attention_stats(q, k, tokens, stats=atlas)
    attention_stats(q, k, tokens)
    assert calls == [1]  # only the call without max went the fused way
    with pytest.raises(ValueError, match="soft-capped scores are not linear"):
        attention_stats(q, k, tokens, **scored(backend="fused", softcap=2.0))
    with pytest.raises(ValueError, match="ALiBi without causality"):
        attention_stats(q, k, tokens, **scored(backend="fused", causal=False, alibi_slopes=torch.ones(3)))
    for kw in (dict(softcap=2.0), dict(causal=False, alibi_slopes=torch.full((3,), 0.25))):
        got = attention_stats(q, k, tokens, **scored(**kw))  # auto: the torch tiles, exact
        assert max(max_abs_diff(got, reference_stats(q, k, tokens, **scored(**kw))).values()) < TOL


def test_asking_for_some_statistics_leaves_the_others_nan():
    q, k, tokens, extra = make_inputs(heads=4, kv_heads=2, n_q=29, left_pad=[0, 4])
    full = attention_stats(q, k, tokens, **scored(backend="fused", **extra))
    for wanted in (["sink", "entropy", "distance"], ["max"], ["previous"], ("duplicate", "induction"), "induction"):
        some = attention_stats(q, k, tokens, **scored(stats=wanted, backend="fused", **extra))
        names = [wanted] if isinstance(wanted, str) else list(wanted)
        for name in STAT_NAMES:
            value = getattr(some, name)
            if name in names:
                assert torch.equal(value.isnan(), getattr(full, name).isnan()), name
                torch.testing.assert_close(value, getattr(full, name), equal_nan=True, atol=0, rtol=0)
            else:
                assert value.isnan().all(), (wanted, name)
    for bad in (["entropy", "bogus"], []):
        with pytest.raises(ValueError, match="stats must name some of"):
            attention_stats(q, k, tokens, stats=bad)


@pytest.mark.parametrize("tile", [4, 128])
def test_pairs_found_by_sorting_equal_the_quadratic_search_in_small_chunks(tile, monkeypatch):
    """Many pairs (a sequence of 3 tokens, so runs of ~25) in tiles of 4 sorted entries and products of 4
    keys (runs crossing many tiles), or one tile, with a window and padding: the same masses as the
    detection patterns written out."""
    import interp.kernels.stats.fused as fused
    from interp.kernels.stats.fused import pairwise_masses

    monkeypatch.setattr(fused, "TILE", tile)

    q, k, tokens, extra = make_inputs(heads=4, kv_heads=2, n_q=23, n_k=37, vocab=3, left_pad=[3, 0])
    kpm = extra["key_padding_mask"]
    for window in (None, 6):
        ref = reference_stats(q, k, tokens, **scored(window=window, key_padding_mask=kpm))
        lse = torch.logsumexp(_masked_scores(q, k, window, kpm), -1).float()
        for budget in (1, 1 << 20):
            got = pairwise_masses(q, k, tokens, lse, Scoring(window=window, scale=16**-0.5), key_padding_mask=kpm,
                                  budget=budget)
            for name in ("previous", "duplicate", "induction"):
                ok = ~ref[name].isnan()
                assert float((got[name].double()[ok] - ref[name][ok]).abs().max()) < TOL, (window, budget, name)


def _masked_scores(q, k, window, kpm):
    n_q, n_k = q.shape[2], k.shape[2]
    kk = k.double().repeat_interleave(q.shape[1] // k.shape[1], 1)
    s = q.double() @ kk.transpose(-1, -2) * q.shape[-1] ** -0.5
    p = torch.arange(n_k - n_q, n_k)[:, None]
    j = torch.arange(n_k)[None]
    ok = (j <= p) & ((p - j) < window if window else True) & kpm[:, None, None, :]
    return s.masked_fill(~ok, float("-inf"))


def test_a_mutated_pair_rule_fails(monkeypatch):
    """Induction counted at tok[j + 1] = tok[p] (the key before an earlier occurrence, not after it), or
    duplicate at the occurrence's successor: the comparison with the oracle must catch both."""
    import interp.kernels.stats.fused as fused

    for name, shift in (("induction", -1), ("duplicate", 1)):
        monkeypatch.setitem(fused.PAIR_RULES, name, shift)
        got, ref = run_case("mha", "fused")
        assert max_abs_diff(got, ref)[name] > 1e-2, name
        monkeypatch.setitem(fused.PAIR_RULES, name, {"induction": 1, "duplicate": 0}[name])
    got, ref = run_case("mha", "fused")
    assert max(max_abs_diff(got, ref).values()) < TOL  # and restored, it passes


@pytest.mark.parametrize("error", [1e-3, -1e-3])
def test_a_wrong_logsumexp_fails(error):
    """A logsumexp off by 1e-3 moves every pairwise mass, the entropy and the max by ~1e-3 relative:
    far outside the tolerance, so the oracle comparison must fail."""
    from interp.kernels.stats.fused import attend_for

    def off(*args):
        o, lse = attend_for(torch.device("cpu"))(*args)
        return o, lse + error

    got, ref = _fused("gqa", off)
    diffs = max_abs_diff(got, ref)
    for name in ("previous", "duplicate", "induction", "entropy", "max"):
        assert diffs[name] > 1e-4, (name, diffs)


def test_non_contiguous_inputs():
    """Hooks give [batch, pos, head, d]; a transposed view must work as it is."""
    q, k, tokens, extra = make_inputs(heads=6, kv_heads=2, n_q=19, n_k=29)
    q_t = q.transpose(1, 2).contiguous().transpose(1, 2)
    k_t = k.transpose(1, 2).contiguous().transpose(1, 2)
    assert not q_t.is_contiguous() and not k_t.is_contiguous()
    got = attention_stats(q_t, k_t, tokens.t().contiguous().t(), block_q=8, block_k=16)
    assert max(max_abs_diff(got, reference_stats(q, k, tokens)).values()) < TOL


def test_statistics_on_a_repeated_sequence_are_sensible():
    """A hand-built induction head: on the second copy it attends to the token after the match."""
    n, half = 24, 12
    tokens = torch.randperm(100)[:half].repeat(2)[None]  # distinct tokens, repeated once
    d = n + 1
    q = torch.zeros(1, 1, n, d)
    k = torch.zeros(1, 1, n, d)
    k[0, 0, torch.arange(n), torch.arange(n)] = 1.0  # key j is one-hot at j
    q[0, 0, torch.arange(half, n), torch.arange(1, half + 1)] = 50.0  # query p looks at p - half + 1
    got = attention_stats(q, k, tokens, **scored(scale=1.0))
    second = got.induction[0, 0, half:]
    assert torch.allclose(second, torch.ones_like(second), atol=1e-6)
    assert got.distance[0, 0, half:].sub(half - 1).abs().max() < 1e-4


# --------------------------------------------------------------------------------------------
# The reference itself follows TransformerLens
# --------------------------------------------------------------------------------------------


def test_detection_patterns_match_transformer_lens():
    head_detector = pytest.importorskip("transformer_lens.head_detector")
    tokens = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 3, 1, 4]])
    n = tokens.shape[1]
    tl_dup = head_detector.get_duplicate_token_head_detection_pattern(tokens[0])
    tl_ind = head_detector.get_induction_head_detection_pattern(tokens[0])
    tl_prev = head_detector.get_previous_token_head_detection_pattern(tokens)
    assert torch.equal(duplicate_detection_pattern(tokens)[0], tl_dup.double())
    assert torch.equal(induction_detection_pattern(tokens)[0], tl_ind.double())
    assert torch.equal(previous_detection_pattern(n), tl_prev.double())


# --------------------------------------------------------------------------------------------
# Result type
# --------------------------------------------------------------------------------------------


def test_result_type_api():
    got, _ = run_case("left_padding")
    assert isinstance(got, AttentionStats)
    assert list(got.to_dict()) == list(STAT_NAMES)
    assert got.stack().shape == (len(STAT_NAMES), 2, 3, 31)
    assert got.shape == (2, 3, 31)
    text = repr(got)
    assert "AttentionStats(batch=2, heads=3, n_q=31" in text and "induction" in text and "(NaN): 21" in text

    per_seq = got.mean()
    assert per_seq["entropy"].shape == (2, 3) and not per_seq["entropy"].isnan().any()
    expected = got.entropy[1, :, 7:].mean(-1)  # NaN queries are skipped
    assert torch.allclose(per_seq["entropy"][1], expected)

    pooled = got.mean(reduce_batch=True)
    assert pooled["sink"].shape == (3,)
    valid = ~got.sink.isnan()
    assert torch.allclose(pooled["sink"], torch.where(valid, got.sink, 0).sum((0, 2)) / valid.sum((0, 2)))

    query_mask = torch.zeros(2, 31, dtype=torch.bool)
    query_mask[:, 20:] = True
    masked = got.mean(query_mask)
    assert torch.allclose(masked["max"], got.max[:, :, 20:].mean(-1))
    assert got.mean(torch.zeros(31, dtype=torch.bool))["max"].isnan().all()

    with pytest.raises(ValueError, match="query_mask"):
        got.mean(torch.ones(3, 31, dtype=torch.bool))
    with pytest.raises(dataclasses.FrozenInstanceError):
        got.sink = got.max


# --------------------------------------------------------------------------------------------
# Errors
# --------------------------------------------------------------------------------------------


def test_clear_errors():
    q, k, tokens, _ = make_inputs(batch=2, heads=6, kv_heads=3, n_q=7, d=8)
    with pytest.raises(ValueError, match=r"\[2, 6, 7, 8\].*\[2, 3, 7, 5\]"):
        attention_stats(q, k[..., :5], tokens)
    with pytest.raises(ValueError, match=r"\[2, 6, 7, 8\].*\[1, 3, 7, 8\]"):
        attention_stats(q, k[:1], tokens)
    with pytest.raises(ValueError, match="multiple of kv_heads"):
        attention_stats(q, torch.randn(2, 4, 7, 8), tokens)
    with pytest.raises(ValueError, match=r"tokens must be \[batch, n_k\] = \[2, 7\]"):
        attention_stats(q, k, tokens[:, :5])
    with pytest.raises(TypeError, match="integer"):
        attention_stats(q, k, tokens.float())
    with pytest.raises(ValueError, match="suffix"):
        attention_stats(q, k[:, :, :4], tokens[:, :4])
    with pytest.raises(ValueError, match="'fused', 'torch', 'triton', 'auto'"):
        attention_stats(q, k, tokens, backend="cuda")
    with pytest.raises(ValueError, match=r"key_padding_mask must be \[batch, n_k\]"):
        attention_stats(q, k, tokens, key_padding_mask=torch.ones(2, 6, dtype=torch.bool))
    with pytest.raises(TypeError, match="bool"):
        attention_stats(q, k, tokens, key_padding_mask=torch.ones(2, 7))
    with pytest.raises(ValueError, match=r"alibi_slopes must be a tensor \[heads\] = \[6\]"):
        attention_stats(q, k, tokens, **scored(alibi_slopes=torch.ones(3)))
    with pytest.raises(ValueError, match="window"):
        attention_stats(q, k, tokens, **scored(window=0))
    with pytest.raises(ValueError, match="n_sink"):
        attention_stats(q, k, tokens, n_sink=-1)
    with pytest.raises(ValueError, match=r"q must be \[batch, heads, n_q, d\]"):
        attention_stats(q[0], k, tokens)


def test_triton_missing_is_a_clear_error(monkeypatch):
    import interp.kernels.stats as stats_module

    monkeypatch.setattr(stats_module, "_triton_available", lambda: False)
    q, k, tokens, _ = make_inputs(n_q=5)
    with pytest.raises(ImportError, match="triton"):
        attention_stats(q, k, tokens, backend="triton")
    # auto runs the torch tiles or the fused route on CPU tensors
    assert isinstance(attention_stats(q, k, tokens, backend="auto"), AttentionStats)
    assert isinstance(attention_stats(q, k, tokens, backend="auto", stats=["sink"]), AttentionStats)
    assert isinstance(attention_stats(q, k, tokens, **scored(backend="auto", softcap=3.0)), AttentionStats)


# --------------------------------------------------------------------------------------------
# Triton kernel under the interpreter (one subprocess for all cases)
# --------------------------------------------------------------------------------------------

# Tiny sizes: the interpreter runs every tl op through numpy, so most cases use one sequence
# (batch strides are covered by the two-sequence padding cases).
ONE = dict(batch=1)
TRITON_CASES = {
    # name: (case, make_inputs overrides, block_q, block_k, with_tokens, dtype)
    "mha": ("mha", {}, 16, 16, True, "float32"),
    "gqa_blocks_32x16": ("gqa", ONE, 32, 16, True, "float32"),
    "mqa": ("mqa", ONE, 16, 32, True, "float32"),
    "window": ("window", ONE, 16, 16, True, "float32"),
    "left_padding": ("left_padding", {}, 16, 16, True, "float32"),
    "suffix_window_gqa": ("suffix_window_gqa", ONE, 16, 16, True, "float32"),
    "non_causal": ("non_causal", {}, 16, 16, True, "float32"),
    "non_causal_window": ("non_causal_window", ONE, 16, 16, True, "float32"),
    "alibi_padding_window": ("alibi_padding_window", {}, 16, 16, True, "float32"),
    "d7_scale": ("scale", ONE, 16, 16, True, "float32"),
    "no_tokens": ("n_sink", ONE, 16, 16, False, "float32"),
    "float16": ("suffix_window_gqa", ONE, 16, 16, True, "float16"),
    "bfloat16": ("mha", ONE, 16, 16, True, "bfloat16"),
    "default_blocks": ("gqa", ONE, None, None, True, "float32"),
}


def _interpreter_worker() -> None:
    """With TRITON_INTERPRET=1: print ``RESULTS {case: {stat: max abs diff}}`` as JSON."""
    results = {}
    for label, (case, overrides, block_q, block_k, with_tokens, dtype) in TRITON_CASES.items():
        try:
            got, ref = run_case(case, "triton", block_q, block_k, with_tokens, getattr(torch, dtype), **overrides)
            results[label] = max_abs_diff(got, ref)
        except Exception as error:  # reported by the test, not hidden
            results[label] = {"error": f"{type(error).__name__}: {error}"}
    q, k, tokens, _ = make_inputs(n_q=16)
    try:
        attention_stats(q, k, tokens, backend="triton", block_q=24)
        results["bad_block_error"] = "no error"
    except ValueError as error:
        results["bad_block_error"] = str(error)
    print("RESULTS " + json.dumps(results))


def _native_worker() -> None:
    """Without TRITON_INTERPRET: CPU tensors must be refused with a clear message, and the kernel
    must compile for sm_90 (no GPU needed). Prints ``CPU_ERROR ...`` and ``USAGE ...`` lines."""
    import tempfile

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from interp.kernels.stats.triton_kernel import _attention_stats_kernel as kernel, default_blocks

    try:
        attention_stats(torch.randn(1, 1, 4, 16), torch.randn(1, 1, 4, 16), backend="triton")
        print("CPU_ERROR none")
    except ValueError as error:
        print("CPU_ERROR", error)

    pointers = {"Q": "*{dt}", "K": "*{dt}", "KPM": "*i8", "SLOPES": "*fp32", "OUT": "*fp32", "LSE": "*fp32"}
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    configs = (("fp16", torch.float16, 64), ("bf16", torch.bfloat16, 128), ("fp32", torch.float32, 128))
    for dt, torch_dtype, d in configs:
        block_m, block_n = default_blocks(torch_dtype, d)
        constexprs = dict(CAUSAL=True, HAS_WINDOW=True, HAS_KPM=True, HAS_ALIBI=True, HAS_SOFTCAP=False,
                          IEEE_DOT=dt == "fp32", BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=d)
        signature = {
            name: pointers[name].format(dt=dt) if name in pointers
            else "constexpr" if name in constexprs else "fp32" if name in ("qk_scale", "cap_scale") else "i32"
            for name in kernel.arg_names
        }
        compiled = triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constexprs),
                                  target=GPUTarget("cuda", 90, 32), options={"num_warps": 8})
        with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
            cubin.write(compiled.asm["cubin"])
            cubin.flush()
            usage = subprocess.run([cuobjdump, "--dump-resource-usage", cubin.name], capture_output=True, text=True, cwd=tempfile.gettempdir())
        line = next(line for line in usage.stdout.splitlines() if "REG:" in line)
        fields = dict(item.split(":") for item in line.split() if ":" in item)
        print(f"USAGE {dt} d={d} blocks={block_m}x{block_n} REG={fields['REG']} STACK={fields['STACK']}")


@pytest.fixture(scope="module")
def triton_workers():
    """Run both workers at once (2 cores): {"interpreter": results dict, "native": stdout}."""
    pytest.importorskip("triton")
    support = str(Path(__file__).resolve().parents[1] / "support")  # the worker imports the support modules too
    native_env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"} | {"PYTHONPATH": support}
    procs = {
        name: subprocess.Popen(
            [sys.executable, __file__, f"--{name}-worker"], env=env,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tempfile.gettempdir(),
        )
        for name, env in (("interpreter", dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=support)), ("native", native_env))
    }
    outputs = {}
    for name, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=600)
        assert proc.returncode == 0, f"{name} worker failed:\n{stdout}\n{stderr}"
        outputs[name] = stdout
    lines = [line for line in outputs["interpreter"].splitlines() if line.startswith("RESULTS ")]
    assert lines, outputs["interpreter"]
    return {"interpreter": json.loads(lines[-1][len("RESULTS "):]), "native": outputs["native"]}


@pytest.mark.triton
@pytest.mark.parametrize("label", list(TRITON_CASES))
def test_triton_interpreter_matches_materialised_pattern(triton_workers, label):
    diffs = triton_workers["interpreter"][label]
    assert "error" not in diffs, diffs.get("error")
    assert max(diffs.values()) < TOL, diffs


@pytest.mark.triton
def test_triton_rejects_bad_block_sizes(triton_workers):
    assert "power of two >= 16, got 24" in triton_workers["interpreter"]["bad_block_error"]


@pytest.mark.triton
def test_triton_rejects_cpu_tensors_without_interpreter(triton_workers):
    line = next(line for line in triton_workers["native"].splitlines() if line.startswith("CPU_ERROR"))
    assert "needs CUDA tensors" in line and "TRITON_INTERPRET=1" in line, line


@pytest.mark.triton
def test_triton_kernel_compiles_for_sm90_without_spills(triton_workers):
    """The GPU path cannot run here, but it must compile (the interpreter accepts code that the
    compiler rejects) and fit in registers at the default block sizes."""
    usages = [line for line in triton_workers["native"].splitlines() if line.startswith("USAGE")]
    assert len(usages) == 3, triton_workers["native"]
    for line in usages:
        assert line.endswith("STACK=0"), line  # no register spills


# --------------------------------------------------------------------------------------------
# Memory: O(n), not O(n^2)
# --------------------------------------------------------------------------------------------

_MEMORY_SCRIPT = """
import resource, time, torch
from interp.kernels import attention_stats
torch.manual_seed(0)
torch.set_num_threads(1)  # memory does not depend on it; a shared CPU's OpenMP barriers do
n, heads, d = {n}, 4, 64
q = torch.randn(1, heads, n, d)
k = torch.randn(1, heads, n, d)
tokens = torch.randint(0, 1000, (1, n // 2)).repeat(1, 2)
attention_stats(q[:, :, :300], k[:, :, :300], tokens[:, :300])  # warm up allocator and BLAS
try:  # reset the high-water mark (Linux >= 4.0) so that earlier spikes do not hide this run
    open("/proc/self/clear_refs", "w").write("5")
except OSError:
    pass
before = int(open("/proc/self/statm").read().split()[1]) * resource.getpagesize() // 1024  # KiB
start = time.perf_counter()
stats = attention_stats(q, k, tokens)
seconds = time.perf_counter() - start
# The peak of this process image (VmHWM, which clear_refs reset above), not getrusage's ru_maxrss: that
# one also keeps the resident size of the forked parent before exec (a pytest worker holding models).
status = open("/proc/self/status").read()
after = int(status.split("VmHWM:")[1].split()[0]) if "VmHWM:" in status else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
assert not stats.entropy.isnan().any()
print("PEAK_KIB", after - before, "SECONDS", seconds)
"""


@pytest.mark.heavy  # peaks of GBs: never beside another heavy test (tests/conftest.py)
@pytest.mark.slow
def test_memory_stays_linear_at_16k():
    n = 16384
    pattern_gib = 4 * n * n * 4 / 2**30  # one fp32 pattern for 4 heads: 4 GiB
    proc = subprocess.run(
        [sys.executable, "-c", _MEMORY_SCRIPT.format(n=n)], capture_output=True, text=True, timeout=900,
        cwd=tempfile.gettempdir(),
    )
    assert proc.returncode == 0, proc.stderr
    fields = proc.stdout.split()
    peak_gib = int(fields[fields.index("PEAK_KIB") + 1]) / 2**20  # ru_maxrss is in KiB on Linux
    seconds = float(fields[fields.index("SECONDS") + 1])
    print(f"n={n}: peak RSS increase {peak_gib * 1024:.1f} MiB in {seconds:.1f} s "
          f"(an fp32 pattern would be {pattern_gib:.0f} GiB)")
    assert peak_gib < 1.0, f"peak RSS grew by {peak_gib:.2f} GiB"


if __name__ == "__main__" and "--interpreter-worker" in sys.argv:
    _interpreter_worker()
if __name__ == "__main__" and "--native-worker" in sys.argv:
    _native_worker()
