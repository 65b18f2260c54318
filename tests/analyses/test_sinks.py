"""Attention sinks (Gu et al. 2024) against materialised patterns, a hand-built sink head, the
StreamingLLM mask (keys j < n_sink kept past the window) and window_eval through the KV cache."""

from __future__ import annotations

import math

import pytest
import torch
from analyses_fixtures import build, force_attention, tokens

from interp import HookedTransformer
from interp.analyses import attention_sinks, sink_rate, window_eval
from interp.analyses.streaming import streaming_loss
from interp.kernels.attention import AttentionMask
from interp.models import lm_loss


@pytest.mark.parametrize("name", ["learned", "rotary-gqa", "alibi-window"])
def test_alpha_and_value_norms_match_the_pattern(name):
    model = build(name)
    toks = tokens(3, 20, seed=1)
    n_sink, eps = 3, 0.3
    frame = attention_sinks(model, toks, n_sink=n_sink, epsilon=eps).set_index(["layer", "head", "key"])
    _, cache = model.run_with_cache(toks, names_filter=lambda n: n.endswith(("hook_pattern", "hook_v")))
    window = model.cfg.sliding_window
    group = model.cfg.n_heads // model.cfg.kv_heads
    for l in range(model.cfg.n_layers):
        a = cache["pattern", l]  # [batch, head, q, k]
        v_norm = cache["v", l].norm(dim=-1).repeat_interleave(group, dim=2)  # [batch, pos, head]
        for k in range(n_sink):
            last = 20 if window is None else min(20, k + window)  # queries that can see key k
            alpha = a[:, :, k:last, k].mean((0, 2))  # Gu et al.: mean over t >= k
            for h in range(model.cfg.n_heads):
                row = frame.loc[(l, h, k)]
                assert row["alpha"] == pytest.approx(float(alpha[h]), abs=1e-5)
                assert row["is_sink"] == (float(alpha[h]) > eps)
                assert row["value_norm"] == pytest.approx(float(v_norm[:, k, h].mean()), rel=1e-5)
                assert row["value_norm_others"] == pytest.approx(float(v_norm[:, n_sink:, h].mean()), rel=1e-5)


def test_forced_sink_head_shows_and_counts_in_the_sink_rate():
    model = build("wide-head")
    toks = tokens(2, 16, seed=2)
    with model.hooks(force_attention(model, 1, 1, lambda p: 0)):
        frame = attention_sinks(model, toks, n_sink=2, epsilon=0.3)
    row = frame.set_index(["layer", "head", "key"])
    assert row.loc[(1, 1, 0), "alpha"] == pytest.approx(1.0, abs=1e-6)
    assert row.loc[(1, 1, 1), "alpha"] == pytest.approx(0.0, abs=1e-6)
    assert bool(row.loc[(1, 1, 0), "is_sink"])
    rates = sink_rate(frame).set_index(["layer", "key"])["sink_rate"]
    first = frame[frame.key == 0]
    assert rates[("all", 0)] == pytest.approx(first["is_sink"].mean())
    assert rates[(1, 0)] == pytest.approx(first[first.layer == 1]["is_sink"].mean())
    assert rates[(1, 0)] >= 1 / 3
    assert frame.attrs["sink_rate"] == pytest.approx(rates[("all", 0)])


def test_attention_mask_keeps_sinks_visible_past_the_window():
    n_q, n_k, window, n_sink = 4, 9, 3, 2
    got = AttentionMask(n_q, n_k, n_sink=n_sink).visible(window, torch.device("cpu"))[0, 0]
    want = torch.zeros(n_q, n_k, dtype=torch.bool)
    for i in range(n_q):
        p = n_k - n_q + i
        for j in range(n_k):
            want[i, j] = j <= p and (p - j < window or j < n_sink)
    assert torch.equal(got, want)
    plain = AttentionMask(n_q, n_k).visible(window, torch.device("cpu"))[0, 0]
    pos = torch.arange(n_k - n_q, n_k)[:, None] - torch.arange(n_k)[None]
    assert torch.equal(plain, (pos >= 0) & (pos < window))
    assert torch.equal(AttentionMask(n_q, n_k, n_sink=n_sink).visible(None, torch.device("cpu")), AttentionMask(n_q, n_k).visible(None, torch.device("cpu")))


def _masked_reference_loss(model, toks, window, n_sink):
    """Per-token loss with a hand-built mask applied to the materialised scores (instrumented path)."""
    n = toks.shape[1]
    p, j = torch.arange(n)[:, None], torch.arange(n)[None]
    visible = (j <= p) & ((p - j < window) | (j < n_sink))

    def mask(scores, hook):
        return scores.masked_fill(~visible, float("-inf"))

    hooks = [(f"blocks.{l}.attn.hook_attn_scores", mask) for l in range(model.cfg.n_layers)]
    with torch.no_grad():
        logits = model.run_with_hooks(toks, fwd_hooks=hooks)
    return lm_loss(logits, toks, per_token=True)


@pytest.mark.parametrize("name", ["learned", "rotary-gqa"])
def test_streaming_loss_equals_a_materialised_masked_attention(name):
    model = build(name)
    toks = tokens(2, 24, seed=3)
    for window, n_sink, chunks in [(5, 0, (None, 7)), (5, 2, (None, 1)), (1, 1, (None,)), (8, 4, (7,))]:
        want = _masked_reference_loss(model, toks, window, n_sink)
        for chunk in chunks:  # 1: token by token, as in streaming generation
            got = streaming_loss(model, toks, window, n_sink, chunk_size=chunk)
            assert torch.allclose(got, want, atol=1e-5), (window, n_sink, chunk)
    assert all(b.attn.window is None for b in model.blocks)  # the override is undone


def test_window_eval_rows():
    model = build("rotary-gqa")
    toks = tokens(2, 24, seed=4)
    frame = window_eval(model, toks, window=[4, 8], n_sink=2, positions="original")
    assert list(frame["setting"]) == ["full", "window", "window+sink", "window", "window+sink"]
    with torch.no_grad():
        assert frame.loc[0, "loss"] == pytest.approx(float(model(toks, return_type="loss")), abs=1e-5)
    # a plain window is Hugging Face's sliding window: the same model built with sliding_window=4
    windowed = HookedTransformer(model.cfg.replace(sliding_window=4), seed=None)
    windowed.load_state_dict(model.state_dict())
    with torch.no_grad():
        assert frame.loc[1, "loss"] == pytest.approx(float(windowed(toks, return_type="loss")), abs=1e-5)
    want = float(_masked_reference_loss(model, toks, 8, 2).mean())
    assert frame.loc[4, "loss"] == pytest.approx(want, abs=1e-5)
    assert (frame["perplexity"] - frame["loss"].map(math.exp)).abs().max() < 1e-6


# ---- StreamingLLM as published: positions inside the rolling cache ------------------------------
def _rolling_cache_by_hand(model, toks, window, n_sink):
    """Xiao et al.'s streaming decode written out: one token at a time; per layer a cache of the
    n_sink first and the `window` latest tokens (the current one included), keys kept before RoPE
    and rotated by their slot in the cache, the query by its own (last) slot. Per-token losses."""
    from interp.models.positions import Rotary

    b, n = toks.shape
    group = model.cfg.n_heads // model.cfg.kv_heads
    caches = [[] for _ in model.blocks]
    logits = []
    with torch.no_grad():
        for t in range(n):
            resid = model.embed(toks[:, t : t + 1])
            for l, block in enumerate(model.blocks):
                x = block.ln1(resid)[:, 0]
                q = torch.einsum("bd,hde->bhe", x, model.W_Q[l])
                k = torch.einsum("bd,hde->bhe", x, model.W_K[l])
                v = torch.einsum("bd,hde->bhe", x, model.W_V[l])
                caches[l].append((k, v))
                if len(caches[l]) > n_sink + window:
                    del caches[l][n_sink]  # evict the oldest token that is not a sink
                K = torch.stack([c[0] for c in caches[l]], 1)  # [b, slots, kv, dh], before RoPE
                V = torch.stack([c[1] for c in caches[l]], 1)
                slots = K.shape[1]
                cos, sin = model.rotary.cos_sin(torch.arange(slots)[None].expand(b, slots), K.dtype)
                K = Rotary.rotate(K, cos, sin).repeat_interleave(group, dim=2)
                q = Rotary.rotate(q[:, None], cos[:, -1:], sin[:, -1:])[:, 0]  # the query's slot is the last
                pattern = torch.softmax(torch.einsum("bhe,bshe->bhs", q, K) * block.attn.scale, dim=-1)
                z = torch.einsum("bhs,bshe->bhe", pattern, V.repeat_interleave(group, dim=2))
                out = torch.einsum("bhe,hed->bd", z, model.W_O[l])
                if block.attn.b_O is not None:
                    out = out + block.attn.b_O
                resid = block.after_attention(resid, out[:, None])
            logits.append(model.unembed(model.ln_final(resid)))
    return lm_loss(torch.cat(logits, 1), toks, per_token=True)


@pytest.mark.parametrize("window, n_sink", [(5, 2), (3, 4), (1, 1), (9, 1)])
def test_cache_positions_equal_a_rolling_cache_decoded_by_hand(window, n_sink):
    model = build("rotary-gqa")
    toks = tokens(2, 22, seed=5)
    want = _rolling_cache_by_hand(model, toks, window, n_sink)
    got = streaming_loss(model, toks, window, n_sink, positions="cache")
    assert torch.allclose(got, want, atol=2e-5), (got - want).abs().max()
    # the sinks moved: with the original positions the numbers differ once the cache is full
    original = streaming_loss(model, toks, window, n_sink, positions="original")
    assert torch.allclose(original[:, : n_sink + window - 1], want[:, : n_sink + window - 1], atol=2e-5)
    assert not torch.allclose(original, want, atol=1e-3)
    # and window_eval's per-position rows are these losses, averaged over the batch
    rows = window_eval(model, toks, window=window, n_sink=n_sink, per_position=True)
    mine = rows[rows["setting"] == "window+sink"]["loss"].to_numpy()
    assert torch.allclose(torch.tensor(mine, dtype=torch.float32), want.mean(0), atol=2e-5)


def test_cache_positions_need_rotary_and_windows_shorter_than_the_sequence():
    with pytest.raises(NotImplementedError, match="positions='original'"):
        window_eval(build("learned"), tokens(1, 20), window=4, n_sink=2)
    with pytest.raises(ValueError, match="not smaller than the 20-token"):
        window_eval(build("rotary-gqa"), tokens(1, 20), window=20)


# ---- a model's own windows are respected: an analysis narrows them, never widens them -----------
def _with_own_windows(model, window, layer_types=None):
    """The same weights under a config with sliding windows of its own (a windowed zoo copy)."""
    own = HookedTransformer(model.cfg.replace(sliding_window=window, layer_types=layer_types), seed=None)
    own.load_state_dict(model.state_dict())
    return own.eval()


def _masked_loss_per_layer(model, toks, rule):
    """Per-token loss with `rule(layer, delta, j) -> bool` applied to every layer's materialised scores."""
    n = toks.shape[1]
    p, j = torch.arange(n)[:, None], torch.arange(n)[None]

    def hook_for(l):
        ok = (p >= j) & rule(l, p - j, j)
        return lambda scores, hook: scores.masked_fill(~ok, float("-inf"))

    hooks = [(f"blocks.{l}.attn.hook_attn_scores", hook_for(l)) for l in range(model.cfg.n_layers)]
    with torch.no_grad():
        return lm_loss(model.run_with_hooks(toks, fwd_hooks=hooks), toks, per_token=True)


@pytest.mark.parametrize("positions", ["original", "cache"])
def test_streaming_never_widens_a_models_own_window(positions):
    base = build("rotary-gqa")
    toks = tokens(2, 24, seed=5)
    model = _with_own_windows(base, 6)
    with torch.no_grad():
        own = lm_loss(model(toks), toks, per_token=True)
    # "full" is the model as configured, and a wider window changes nothing
    for window in (None, 6, 16):
        got = streaming_loss(model, toks, window, 0, positions=positions)
        assert torch.allclose(got, own, atol=1e-5), window
    assert not torch.allclose(own, lm_loss(base(toks), toks, per_token=True), atol=1e-3)  # the window matters
    # a narrower window narrows: equal to the model built with it
    narrow = _with_own_windows(base, 3)
    with torch.no_grad():
        want = lm_loss(narrow(toks), toks, per_token=True)
    assert torch.allclose(streaming_loss(model, toks, 3, 0, positions=positions), want, atol=1e-5)
    # sinks are kept past the analysis window, but never past the model's own
    if positions == "original":
        want = _masked_loss_per_layer(base, toks, lambda l, d, j: (d < 3) | ((j < 2) & (d < 6)))
        for chunk in (None, 1):
            got = streaming_loss(model, toks, 3, 2, chunk_size=chunk)
            assert torch.allclose(got, want, atol=1e-5), chunk
    assert all(b.attn.window == 6 for b in model.blocks)  # the model's windows are restored


def test_streaming_keeps_per_layer_windows():
    base = build("rotary-gqa")
    toks = tokens(2, 24, seed=6)
    model = _with_own_windows(base, 5, layer_types=("sliding", "full"))
    frame = window_eval(model, toks, window=[3, 8], n_sink=2, positions="original")
    with torch.no_grad():
        assert frame.loc[0, "loss"] == pytest.approx(float(model(toks, return_type="loss")), abs=1e-5)
    own = {0: 5, 1: None}

    def rule(window, n_sink):
        def ok(l, d, j):
            eff = window if own[l] is None else min(own[l], window)
            keep = (d < eff) | (j < n_sink)
            return keep if own[l] is None else keep & (d < own[l])
        return ok

    for row, (window, n_sink) in zip(range(1, 5), [(3, 0), (3, 2), (8, 0), (8, 2)]):
        want = float(_masked_loss_per_layer(base, toks, rule(window, n_sink)).mean())
        assert frame.loc[row, "loss"] == pytest.approx(want, abs=1e-5), (window, n_sink)
    assert [b.attn.window for b in model.blocks] == [5, None]


@pytest.mark.parametrize("block", [4, 7])
@pytest.mark.parametrize("window, n_sink", [(5, 2), (9, 1)])
def test_cache_positions_in_blocks_of_queries_equal_the_rolling_cache(monkeypatch, block, window, n_sink):
    """The cache positions are written out in blocks of BLOCK queries (each with its band of keys): with
    blocks far smaller than the sequence, every block edge, band start and sink overlap is crossed."""
    import interp.analyses.streaming as streaming

    monkeypatch.setattr(streaming, "BLOCK", block)
    model = build("rotary-gqa")
    toks = tokens(2, 22, seed=6)
    want = _rolling_cache_by_hand(model, toks, window, n_sink)
    assert torch.allclose(streaming_loss(model, toks, window, n_sink, positions="cache"), want, atol=2e-5)
