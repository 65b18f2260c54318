"""Per-head KV-cache policies against computations written out here: every policy's logits equal a
plain forward whose attention scores are masked, in a hook, to exactly the keys that head holds
(streaming: the sink + window rule; H2O and SnapKV: what the cache says it holds before each step);
KIVI equals a forward whose cached keys and values are quantized by hand (keys per channel over
groups of tokens, values per token over groups of channels, the latest tokens in full precision);
a cache that is `full` everywhere is the unmodified model bit for bit; bytes are what the policy
holds; bad policies are refused in one line."""

from __future__ import annotations

import pytest
import torch
from core_models import build, small, tokens
from near_ties import argmax_loop, assert_greedy_agrees
from smol import needs_smol

import interp
from interp.errors import BadValue
from interp.models.kv.policy_cache import PolicyKVCache, theory_bytes_per_token
from interp.models.kv.policies import H2O, Dense, Kivi, SnapKV, Streaming, parse_policies, parse_policy

N_LAYERS, N_HEADS, N_KV = 3, 6, 2


@pytest.fixture(scope="module")
def gqa():
    """Rotary, RMSNorm, gated MLP, 6 query heads on 2 KV heads (3 per group)."""
    return build(small(positional="rotary", normalization="rmsnorm", act_fn="silu", gated_mlp=True, d_model=48,
                       n_heads=N_HEADS, n_kv_heads=N_KV, n_ctx=96, n_layers=N_LAYERS))


def masked_logits(model, toks, sees):
    """Logits of a plain forward over `toks` whose attention scores are masked by hand: `sees[layer]`
    is bool [kv_heads, n, n] (row i: the keys query i may see; None: that layer is untouched);
    query head h reads KV head h // (heads / kv_heads)."""
    rep = model.cfg.n_heads // model.cfg.kv_heads

    def hook(layer):
        def fn(scores, hook):
            s = scores.clone()
            for h in range(s.shape[1]):
                s[:, h] = s[:, h].masked_fill(~sees[layer][h // rep], float("-inf"))
            return s
        return fn

    hooks = [(f"blocks.{layer}.attn.hook_attn_scores", hook(layer)) for layer in range(len(sees))
             if sees[layer] is not None]
    return model.run_with_hooks(toks, fwd_hooks=hooks)


def streaming_rows(n: int, sinks: int, window: int) -> torch.Tensor:
    """bool [n, n]: StreamingLLM's rule written out: query i sees key j <= i when j is one of the
    first `sinks` or one of the last `window` (i - j < window)."""
    i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
    return (j <= i) & ((j < sinks) | (i - j < window))


def causal_rows(n: int) -> torch.Tensor:
    return torch.ones(n, n, dtype=torch.bool).tril()


def streaming_sees(n_keys: int, sinks: int, window: int) -> torch.Tensor:
    """The last query's keys under the rule: the first `sinks` and the last `window`."""
    return streaming_rows(n_keys, sinks, window)[-1]


def test_full_everywhere_is_the_unmodified_model_bit_for_bit(gqa):
    toks = tokens(2, 40, seed=1)
    plain, policy = gqa.new_kv_cache(2, 48), gqa.new_kv_cache(2, 48, policy="full")
    assert isinstance(policy, PolicyKVCache)
    assert torch.equal(gqa(toks, kv_cache=plain), gqa(toks, kv_cache=policy))
    for i in range(3):
        step = tokens(2, 1, seed=10 + i)
        assert torch.equal(gqa(step, kv_cache=plain), gqa(step, kv_cache=policy))
    assert torch.equal(gqa.generate(toks, 6, kv_policy="full", stop_at_eos=False),
                       gqa.generate(toks, 6, stop_at_eos=False))
    # One meaning on every cache: held = what the 43 tokens hold, allocated = the 48 preallocated slots
    assert policy.held_nbytes == plain.held_nbytes == plain.allocated_nbytes * 43 // 48 == policy.nbytes
    assert policy.allocated_nbytes == plain.allocated_nbytes == 2 * 3 * 2 * 2 * 48 * 8 * 4


@pytest.mark.parametrize("where", ["every head", "one KV head", "one layer"])
def test_streaming_equals_the_masked_model_in_prefill_and_decoding(gqa, where):
    sinks, window = 2, 8
    name = f"streaming({sinks},{window})"
    policy = {"every head": name, "one KV head": {(1, 0): name}, "one layer": {2: name}}[where]
    heads = {"every head": {(l, h) for l in range(N_LAYERS) for h in range(N_KV)},
             "one KV head": {(1, 0)}, "one layer": {(2, 0), (2, 1)}}[where]
    toks = tokens(1, 44, seed=3)
    cache = gqa.new_kv_cache(1, 48, policy=policy)

    def sees(n):
        return [torch.stack([streaming_rows(n, sinks, window) if (l, h) in heads else causal_rows(n)
                             for h in range(N_KV)]) for l in range(N_LAYERS)]

    prefill = gqa(toks[:, :30], kv_cache=cache)
    assert torch.allclose(prefill, masked_logits(gqa, toks[:, :30], sees(30)), atol=1e-5)
    for i in range(30, 44):
        got = gqa(toks[:, i : i + 1], kv_cache=cache)[:, 0]
        assert torch.allclose(got, masked_logits(gqa, toks[:, : i + 1], sees(i + 1))[:, -1], atol=1e-5)
    held = cache.held_mask(1)[0]  # [kv, length]
    for h in range(N_KV):
        want = streaming_sees(44, sinks, window) if (1, h) in heads else torch.ones(44, dtype=torch.bool)
        assert torch.equal(held[h], want)  # the rolling buffer holds exactly the sinks and the window


@pytest.mark.parametrize("policy", ["h2o(12)", "h2o(12,3)", "snapkv(12,4,3)"])
def test_eviction_equals_the_model_with_the_evicted_keys_masked(gqa, policy):
    """Before every step the cache says which keys each head holds; the step's logits equal a plain
    forward whose last query sees those keys and itself, nothing else."""
    toks = tokens(1, 46, seed=4)
    cache = gqa.new_kv_cache(1, 50, policy=policy)
    prefill = gqa(toks[:, :32], kv_cache=cache)
    assert torch.allclose(prefill, gqa(toks[:, :32]), atol=1e-5)  # prefill attends fully
    budget = parse_policy(policy).budget
    sees = [torch.stack([causal_rows(46)] * N_KV) for _ in range(N_LAYERS)]  # row i: what query i saw
    for i in range(32, 46):
        for l in range(N_LAYERS):
            held = cache.held_mask(l)[0]  # [kv, i]: what each head holds before step i
            extra = (i - 32) if isinstance(parse_policy(policy), SnapKV) else 0  # SnapKV keeps later tokens
            assert int(held.sum(-1).max()) <= budget + extra
            sees[l][:, i, :i] = held
        got = gqa(toks[:, i : i + 1], kv_cache=cache)[:, 0]
        want = masked_logits(gqa, toks[:, : i + 1], [s[:, : i + 1, : i + 1] for s in sees])[:, -1]
        assert torch.allclose(got, want, atol=1e-5)
    assert not bool(cache.held_mask(0).all())  # something was evicted
    # a call of several tokens (a chunk): each new query sees what was held before the call and the
    # call's tokens up to itself (eviction happens once, after the call)
    more = torch.cat([toks, tokens(1, 4, seed=12)], dim=1)
    for l in range(N_LAYERS):
        held = cache.held_mask(l)[0]
        sees[l] = _grow(sees[l], 50)
        sees[l][:, 46:, :46] = held[:, None, :]
        sees[l][:, 46:, 46:] = causal_rows(4)
    got = gqa(more[:, 46:], kv_cache=cache)
    assert torch.allclose(got, masked_logits(gqa, more, sees)[:, 46:], atol=1e-5)


def _grow(rows: torch.Tensor, n: int) -> torch.Tensor:
    """[kv, m, m] visibility rows, padded with False to [kv, n, n]."""
    out = torch.zeros(rows.shape[0], n, n, dtype=torch.bool)
    out[:, : rows.shape[1], : rows.shape[2]] = rows
    return out


def test_h2o_keeps_the_recent_window_and_the_heaviest_hitters_by_hand(gqa):
    """After a prefill, H2O(8, 3) holds the 3 most recent tokens and the 5 others that received the
    most attention, summed over every prompt query and the KV head's 3 query heads: computed here
    from the attention patterns of a plain forward."""
    toks = tokens(1, 20, seed=5)
    cache = gqa.new_kv_cache(1, 24, policy="h2o(8,3)")
    gqa(toks, kv_cache=cache)
    _, acts = gqa.run_with_cache(toks, names_filter=lambda n: n.endswith("hook_pattern"))
    for layer in range(N_LAYERS):
        mass = acts[f"blocks.{layer}.attn.hook_pattern"][0].sum(1)  # [heads, keys]: attention received
        mass = mass.view(N_KV, N_HEADS // N_KV, -1).sum(1)
        for h in range(N_KV):
            # the cache sums the same attention in another order: a key within round-off of the 5th heaviest
            # may be kept in its place, on another CPU (issue 36); every clearly heavier key must be kept
            got = set(cache.held_mask(layer)[0, h].nonzero().flatten().tolist())
            older = mass[h, :17].double()
            fifth = float(older.topk(5).values[-1])
            clear = set((older > fifth + 1e-5).nonzero().flatten().tolist())
            tied = set((older - fifth).abs().le(1e-5).nonzero().flatten().tolist())
            assert len(got) == 8 and {17, 18, 19} <= got and clear <= got and got - {17, 18, 19} <= clear | tied
            assert len(clear) >= 3  # mostly decided by clear margins: not a vacuous check


def _kivi_by_hand(x, bits, group, axis):
    """Asymmetric quantization written out: min/max over the group, scale and zero point rounded to
    float16, codes round((x - zero) / scale) in [0, 2^bits - 1]. axis "token": keys, one scale per
    channel over `group` consecutive tokens; "channel": values, one per token over `group` channels."""
    levels = 2**bits - 1
    x = x.float()
    out = torch.empty_like(x)
    t, d = x.shape[-2:]
    blocks = ([(slice(a, a + group), slice(None)) for a in range(0, t, group)] if axis == "token"
              else [(slice(None), slice(c, c + group)) for c in range(0, d, group)])
    for rows, cols in blocks:
        block = x[..., rows, cols]
        dim = -2 if axis == "token" else -1
        lo, hi = block.amin(dim, keepdim=True), block.amax(dim, keepdim=True)
        zero = lo.half().float()
        scale = ((hi - lo) / levels).half().float()
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        out[..., rows, cols] = ((block - zero) / scale).round().clamp(0, levels) * scale + zero
    return out


@pytest.mark.parametrize("bits", [4, 2])
@pytest.mark.parametrize("prompt", [37, 40, 43])
def test_kivi_equals_quantization_by_hand(gqa, bits, prompt):
    """KIVI(bits, G=8, R=8) after a prompt: the keys of complete groups of 8 tokens are quantized per
    channel, the values of those tokens per token, the rest (prompt % 8 tokens) is full precision.
    The step after the prompt equals a forward whose earlier keys and values, at every layer, are the
    full model's (what the prefill cached) quantized by hand that way."""
    group = 8
    toks = tokens(1, prompt + 1, seed=6)
    cache = gqa.new_kv_cache(1, 48, policy=f"kivi{bits}({group},{group})")
    prefill = gqa(toks[:, :prompt], kv_cache=cache)
    assert torch.allclose(prefill, gqa(toks[:, :prompt]), atol=1e-6)  # KIVI's prefill reads full precision
    _, acts = gqa.run_with_cache(toks[:, :prompt], names_filter=lambda n: n.endswith(("hook_rot_k", "hook_v")))
    nq = prompt // group * group  # complete groups flushed after the prompt

    def cached(name, axis):
        def fn(x, hook):  # [batch, pos, kv, d]: earlier positions as the cache holds them
            full = acts[hook.name]
            y = x.clone()
            y[:, :prompt] = full
            grouped = full[:, :nq].transpose(1, 2) if axis == "token" else full[:, :nq]
            q = _kivi_by_hand(grouped, bits, group, axis)
            y[:, :nq] = q.transpose(1, 2) if axis == "token" else q
            return y
        return fn

    hooks = [(f"blocks.{l}.attn.hook_rot_k", cached("k", "token")) for l in range(N_LAYERS)]
    hooks += [(f"blocks.{l}.attn.hook_v", cached("v", "channel")) for l in range(N_LAYERS)]
    want = gqa.run_with_hooks(toks, fwd_hooks=hooks)[:, -1]
    got = gqa(toks[:, prompt:], kv_cache=cache)[:, 0]
    assert torch.allclose(got, want, atol=1e-5), (got - want).abs().max()
    # read back: the dequantized codes, then the full-precision residual
    k = acts["blocks.0.attn.hook_rot_k"][0].transpose(0, 1)  # [kv, pos, d]
    assert torch.allclose(cache.k(0)[0, :, :nq], _kivi_by_hand(k[:, :nq], bits, group, "token"), atol=1e-6)
    assert torch.equal(cache.k(0)[0, :, nq:prompt], k[:, nq:prompt])
    assert not torch.allclose(cache.k(0)[0, :, :nq], k[:, :nq], atol=1e-4)  # the codes are lossy


def test_bytes_are_what_each_policy_holds(gqa):
    d, layers, kv = gqa.cfg.head_dim, N_LAYERS, N_KV
    toks = tokens(1, 40, seed=7)

    def measured(policy):
        cache = gqa.new_kv_cache(1, 40, policy=policy)
        gqa(toks, kv_cache=cache)
        return cache

    heads = layers * kv
    assert measured("full").nbytes == heads * 40 * 2 * d * 4
    assert measured("int8").nbytes == heads * 40 * 2 * (d + 4)  # codes and a float32 scale per vector
    # streaming(2,8): 10 entries per head, keys and values fp32, an int32 slot each
    assert measured("streaming(2,8)").nbytes == heads * 10 * (2 * d * 4 + 4)
    assert measured("h2o(12)").nbytes == heads * 12 * (2 * d * 4 + 4 + 4)  # and a float32 score
    assert measured("snapkv(12,4,3)").nbytes == heads * 12 * (2 * d * 4 + 4)
    # KIVI-4 (G=R=8) after 40 tokens: all 40 quantized (5 groups), no residual
    kivi = measured("kivi4(8,8)")
    codes = 2 * 40 * d // 2  # keys and values, two codes per byte
    scales = 2 * 2 * (40 // 8) * d + 2 * 2 * 40 * (d // 8)  # float16 scale and zero: per channel per group / per token per group
    assert kivi.nbytes == heads * (codes + scales)
    for name in ("full", "int8", "streaming(2,8)", "h2o(12)", "kivi4(8,8)"):
        want = theory_bytes_per_token(parse_policy(name), n_layers=layers, n_kv_heads=kv, d_head=d, length=40)
        assert measured(name).bytes_per_token() == pytest.approx(want)


def test_absorbing_a_full_prefill_equals_the_policys_own_prefill(gqa):
    toks = tokens(1, 36, seed=8)
    full = gqa.new_kv_cache(1, 44, capture_queries=True)
    gqa(toks, kv_cache=full)
    for name in ("h2o(12)", "snapkv(12,4,3)", "kivi4(8,8)", {1: "h2o(10)", (2, 1): "kivi2(8,8)"}):
        own, absorbed = gqa.new_kv_cache(1, 44, policy=name), gqa.new_kv_cache(1, 44, policy=name)
        gqa(toks, kv_cache=own)
        absorbed.absorb(full, gqa)
        for layer in range(N_LAYERS):
            assert torch.equal(own.held_mask(layer), absorbed.held_mask(layer))
            assert torch.allclose(own.k(layer), absorbed.k(layer), atol=1e-6)
        nxt = tokens(1, 3, seed=9)
        for i in range(3):
            assert torch.allclose(gqa(nxt[:, i : i + 1], kv_cache=own), gqa(nxt[:, i : i + 1], kv_cache=absorbed),
                                  atol=1e-5)


    for name in ("streaming(2,8)", {0: "int8"}):  # their prefill is not the full model's
        with pytest.raises(BadValue, match="run its own"):
            gqa.new_kv_cache(1, 44, policy=name).absorb(full, gqa)
    with pytest.raises(BadValue, match="capture_queries=True"):
        plain = gqa.new_kv_cache(1, 44)
        gqa(toks, kv_cache=plain)
        gqa.new_kv_cache(1, 44, policy="h2o(12)").absorb(plain, gqa)


def test_a_policy_narrows_a_models_own_window_never_widens():
    """On a model with a 6-token window, streaming(1,16) sees the 6-token window (its sink only
    inside it): the same logits as the model as configured."""
    model = build(small(positional="rotary", sliding_window=6, n_ctx=64))
    toks = tokens(1, 30, seed=2)
    cache = model.new_kv_cache(1, 30, policy="streaming(1,16)")
    assert torch.allclose(model(toks, kv_cache=cache), model(toks), atol=1e-5)
    narrow = model.new_kv_cache(1, 30, policy="streaming(1,3)")
    sees = [torch.stack([streaming_rows(30, 1, 3)] * model.cfg.kv_heads)] * model.cfg.n_layers
    assert torch.allclose(model(toks, kv_cache=narrow), masked_logits(model, toks, sees), atol=1e-5)


def test_hooked_patterns_through_split_heads_are_refused(gqa):
    cache = gqa.new_kv_cache(1, 20, policy={(0, 1): "streaming(1,4)"})
    with pytest.raises(interp.errors.UserError, match="hold different tokens"):
        gqa.run_with_cache(tokens(1, 10), kv_cache=cache, names_filter="blocks.0.attn.hook_pattern")


@pytest.mark.parametrize("policy, match", [
    ("lru", "unknown KV-cache policy 'lru'"),
    ("streaming(4)", r"streaming\(sinks,window\)"),
    ("streaming(4,0)", "window must be between 1"),
    ("streaming(40,40)", "sinks \\+ window = 80 tokens is more than the 48"),
    ("h2o(0)", "budget must be between 1"),
    ("h2o(100)", "budget must be between 1 and 48"),
    ("snapkv(8,16)", "observation window must be between 1 and 8"),
    ("kivi4(5,5)", "group size 5 must divide d_head"),
    ("kivi4(8,12)", "multiple of the group size"),
    ({7: "full"}, "layers 0..2"),
    ({(0, 2): "full"}, "KV heads 0..1"),
    ({"0": "full"}, "keyed by layer or"),
])
def test_bad_policies_are_one_clear_line(gqa, policy, match):
    with pytest.raises(BadValue, match=match):
        gqa.new_kv_cache(1, 48, policy=policy)


def test_policy_names_parse_and_print_back():
    assert parse_policy("streaming(4,128)") == Streaming(4, 128) == parse_policy("streaming:4:128")
    assert parse_policy("kivi2") == Kivi(2) and parse_policy("h2o(64,16)") == H2O(64, 16)
    assert parse_policy("snapkv(64)") == SnapKV(64) and parse_policy("int8") == Dense("int8")
    names = "full,kivi4,streaming(4,128),h2o(132),snapkv(132),kivi2(16,32)"
    assert [p.name for p in parse_policies(names)] == ["full", "kivi4", "streaming(4,128)", "h2o(132)", "snapkv(132)",
                                                       "kivi2(16,32)"]
    with pytest.raises(BadValue, match="listed twice"):
        parse_policies("full,full")


@pytest.mark.slow
@needs_smol
def test_policies_on_smollm2_equal_the_masked_model():
    """On SmolLM2 (30 layers, 9 query heads on 3 KV heads): streaming on a third of the KV heads and
    H2O on layer 20 equal the model with the same keys masked, over a 300-token prompt and 4 steps."""
    from smol import SMOL

    model = interp.load(SMOL)
    toks = model.to_tokens(__import__("pydoc_data.topics").topics.topics["for"] * 3)[:, :304]
    sinks, window = 4, 64
    policy = {(l, l % 3): f"streaming({sinks},{window})" for l in range(30)}
    policy[20] = "h2o(96)"
    cache = model.new_kv_cache(1, 304, policy=policy)
    model(toks[:, :300], kv_cache=cache)
    sees = [torch.stack([streaming_rows(304, sinks, window) if h == l % 3 else causal_rows(304) for h in range(3)])
            for l in range(30)]
    for i in range(300, 304):
        held = cache.held_mask(20)[0]
        sees[20][:, i, :i] = held  # H2O: what layer 20 held before step i
        for l in range(30):  # the streaming heads hold exactly the rule's keys
            if l != 20:
                assert torch.equal(cache.held_mask(l)[0, l % 3], streaming_sees(i, sinks, window))
        got = model(toks[:, i : i + 1], kv_cache=cache)[:, 0]
        want = masked_logits(model, toks[:, : i + 1], [s[:, : i + 1, : i + 1] for s in sees])[:, -1]
        assert (got - want).abs().max() < 1e-3 * want.abs().max()


def test_a_windowed_model_caches_only_what_each_layer_sees():
    """policy="window": a layer with its own sliding window holds a rolling buffer of that window,
    the others every token; logits and greedy generation equal the plain cache's, in less memory."""
    model = build(small(positional="rotary", sliding_window=6, layer_types=("sliding", "full"), n_ctx=64))
    toks = tokens(1, 20, seed=5)
    plain, window = model.new_kv_cache(1, 30), model.new_kv_cache(1, 30, policy="window")
    assert torch.allclose(model(toks, kv_cache=plain), model(toks, kv_cache=window), atol=1e-5)
    for i in range(8):  # decoding well past the window
        step = tokens(1, 1, seed=40 + i)
        assert torch.allclose(model(step, kv_cache=plain), model(step, kv_cache=window), atol=1e-5)
    held = window.held_mask(0)[0]
    assert held.sum(-1).tolist() == [6] * model.cfg.kv_heads and bool(held[:, -6:].all())  # the last 6 slots
    assert bool(window.held_mask(1).all())  # the full layer keeps everything
    per_token = 2 * model.cfg.kv_heads * model.cfg.head_dim * 4
    assert window.nbytes == 28 * per_token + 6 * (per_token + 4 * model.cfg.kv_heads)  # layer 1: 28 tokens; layer 0: 6 + slots
    out = model.generate(toks, 12, stop_at_eos=False)  # generate uses the window cache by default here
    seq, scores = argmax_loop(model, toks, 12)  # full forwards under the model's own window masks
    assert_greedy_agrees(out, seq, scores, start=20)  # the caches and the forwards round differently
    assert_greedy_agrees(model.generate(toks, 12, stop_at_eos=False, kv_precision="fp32"), seq, scores, start=20)
