"""Boundary protection (issue 68, part 1): every eviction policy takes `+protect(first,last)` or
`+protect(10%)`; the protected slots are held by every head of every layer after the prefill (the policy's
own, and a full prefill absorbed) and after every decoding step, read from the cache's own slots
(`held_mask`); without protect the same policies drop some of those slots (so the check is not vacuous);
protection changes neither the budget nor the bytes held; names round-trip; bad settings are one line.
`random(B)` keeps B uniformly drawn tokens, the same on every run, different per layer and head.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from core_models import build, small, tokens

from interp.errors import BadValue
from interp.models.kv.policies import (
    H2O,
    Candidates,
    Protect,
    Random,
    parse_policies,
    parse_policy,
    policy_table,
    theory_bytes_per_token,
)

N_LAYERS, N_HEADS, N_KV = 3, 6, 2
PROMPT, STEPS = 60, 12
FIRST, LAST = 3, 6  # beyond SnapKV's window (4) and H2O's recent (2): the policies' own rules do not hold them

POLICIES = ["h2o(16,2)", "snapkv(16,4,3)", "knorm(16)", "tova(16)", "random(16)"]


@pytest.fixture(scope="module")
def gqa():
    """Rotary, 6 query heads on 2 KV heads, 3 layers: 60-token prompts into a 16-token budget."""
    return build(small(positional="rotary", normalization="rmsnorm", act_fn="silu", gated_mlp=True, d_model=48,
                       n_heads=N_HEADS, n_kv_heads=N_KV, n_ctx=96, n_layers=N_LAYERS))


def run_policy(model, policy: str, *, absorb: bool, seed: int = 3) -> tuple[list[torch.Tensor], list[int], object]:
    """Prefill a PROMPT-token prompt, then decode STEPS tokens one at a time through `policy`'s cache: the held
    slots after every call ([layer] -> bool [kv, length], stacked over layers), the held entries per head, and
    the cache."""
    toks = tokens(1, PROMPT + STEPS, seed=seed)
    cache = model.new_kv_cache(1, PROMPT + STEPS, policy=policy)
    if absorb:
        full = model.new_kv_cache(1, PROMPT, capture_queries=True)
        model(toks[:, :PROMPT], kv_cache=full)
        cache.absorb(full, model)
    else:
        model(toks[:, :PROMPT], kv_cache=cache)
    held, counts = [], []
    for i in range(PROMPT, PROMPT + STEPS + 1):
        masks = torch.stack([cache.held_mask(l)[0] for l in range(N_LAYERS)])  # [layer, kv, length]
        held.append(masks)
        counts.append(int(masks.sum(-1).max()))
        if i < PROMPT + STEPS:
            model(toks[:, i : i + 1], kv_cache=cache)
    return held, counts, cache


def boundary(length: int, first: int, last: int) -> torch.Tensor:
    """bool [length]: the first `first` and the last `last` slots."""
    j = torch.arange(length)
    return (j < first) | (j >= length - last)


@pytest.mark.parametrize("absorb", [False, True], ids=["own-prefill", "absorbed"])
@pytest.mark.parametrize("policy", POLICIES)
def test_a_protected_policy_never_evicts_a_protected_slot(gqa, policy, absorb):
    protected, _, _ = run_policy(gqa, f"{policy}+protect({FIRST},{LAST})", absorb=absorb)
    for step, masks in enumerate(protected):
        want = boundary(masks.shape[-1], FIRST, LAST)
        assert bool(masks[..., want].all()), f"{policy}: a protected slot is not held after call {step}"
    plain, _, _ = run_policy(gqa, policy, absorb=absorb)
    dropped = [bool((~m[..., boundary(m.shape[-1], FIRST, LAST)]).any()) for m in plain]
    assert any(dropped), f"{policy} keeps every boundary slot without protection: the check above is vacuous"


@pytest.mark.parametrize("policy", POLICIES)
def test_protection_changes_neither_the_budget_nor_the_bytes(gqa, policy):
    plain, protected = parse_policy(policy), parse_policy(f"{policy}+protect(10%)")
    assert protected.budget == plain.budget and protected.protected == (1, 1)  # round(1.6) = 2: one each end
    for length in (40, PROMPT + STEPS):
        assert theory_bytes_per_token(protected, n_layers=3, n_kv_heads=2, d_head=8, length=length) == \
            theory_bytes_per_token(plain, n_layers=3, n_kv_heads=2, d_head=8, length=length)
    _, counts_plain, cache_plain = run_policy(gqa, policy, absorb=False)
    _, counts_prot, cache_prot = run_policy(gqa, f"{policy}+protect({FIRST},{LAST})", absorb=False)
    assert counts_plain == counts_prot and counts_plain[0] == plain.budget
    assert cache_plain.held_nbytes == cache_prot.held_nbytes > 0


def test_protection_outranks_a_policys_own_always_kept_tokens(gqa):
    """h2o(16,14) always keeps its 14 most recent tokens; with protect(4,0) the 4 first are kept above them
    (4 + 14 > 16: the recent window gives way, the budget holds)."""
    held, counts, _ = run_policy(gqa, "h2o(16,14)+protect(4,0)", absorb=False)
    for masks in held:
        assert bool(masks[..., :4].all())
    assert max(counts) == 16
    plain, _, _ = run_policy(gqa, "h2o(16,14)", absorb=False)
    assert not all(bool(m[..., :4].all()) for m in plain)


def test_fractions_split_the_budget_between_first_and_last():
    assert parse_policy("h2o(132)+protect(10%)").protected == (4, 9)  # 13 of 132: a third first, the rest last
    assert parse_policy("snapkv(256)+protect(0.1)").protected == (8, 18)
    assert parse_policy("tova(20)+protect(5%)").protected == (1, 0)  # one entry: the first token
    assert parse_policy("knorm(64)+protect(0,12)").protected == (0, 12)
    assert H2O(132, protect=Protect(fraction=0.1)) == parse_policy("h2o(132)+protect(10%)")


def test_names_and_labels_round_trip():
    names = ["h2o(132)+protect(4,9)", "h2o(132)+protect(10%)", "snapkv(132,16,5)+protect(2.5%)", "random(132)",
             "random(132,7)+protect(0,13)", "knorm(132)+protect(10%)", "tova(132)+protect(1,1)"]
    policies = parse_policies(",".join(names))
    assert [p.name for p in policies] == names
    assert [parse_policy(p.name) for p in policies] == policies
    assert parse_policy("h2o(132)+protect(0.1)").name == "h2o(132)+protect(10%)"
    assert parse_policy(" H2O(132) + Protect( 4 , 9 ) ") == parse_policy("h2o(132)+protect(4,9)")
    assert parse_policy("h2o(132)+protect(4,9)") != parse_policy("h2o(132)")  # a different cache: its own storage
    assert "`+protect(first,last)` or `+protect(10%)`" in policy_table() and "`random(budget)" in policy_table()


@pytest.mark.parametrize("policy, match", [
    ("h2o(16)+protect(10,7)", r"protects 10 \+ 7 = 17 tokens, more than its budget of 16"),
    ("random(8)+protect(8,1)", "more than its budget of 8"),
    ("h2o(16)+protect(-1,4)", "cannot be negative"),
    ("tova(16)+protect(4,-2)", "cannot be negative"),
    ("h2o(16)+protect(0%)", "between 0 and 1"),
    ("h2o(16)+protect(100%)", "between 0 and 1"),
    ("h2o(16)+protect(1.5)", "between 0 and 1"),
    ("h2o(16)+protect(nan)", "between 0 and 1"),
    ("h2o(16)+protect(13)", "between 0 and 1"),
    ("h2o(16)+protect(a,b)", "two whole numbers"),
    ("h2o(16)+protect()", "two whole numbers"),
    ("h2o(16)+sinks(4)", "after '\\+' write protect"),
    ("full+protect(4,9)", "full keeps every token and evicts nothing"),
    ("int8+protect(10%)", "int8 keeps every token and evicts nothing"),
    ("kivi4+protect(4,9)", "kivi4 keeps every token and evicts nothing"),
    ("streaming(4,16)+protect(4,9)", "keeps only its first and last tokens already"),
])
def test_bad_protection_is_one_clear_line(gqa, policy, match):
    with pytest.raises(BadValue, match=match) as err:
        gqa.new_kv_cache(1, 48, policy=policy)
    assert "\n" not in str(err.value)


def test_protect_built_in_python_is_checked_too():
    with pytest.raises(BadValue, match="more than its budget"):
        H2O(8, protect=Protect(6, 6))
    with pytest.raises(BadValue, match="whole number >= 0"):
        Protect(-1, 2)
    with pytest.raises(BadValue, match="not both"):
        Protect(1, 2, fraction=0.1)
    with pytest.raises(BadValue, match="a Protect"):
        H2O(8, protect=(1, 2))


def _candidates(m: int, g: int, layer: int = 0) -> Candidates:
    keys = torch.zeros(1, g, m, 4)
    slots = torch.arange(m).expand(1, g, m)
    return Candidates(keys, keys, slots, None, None, 1.0, 0, m, 1, layer=layer, heads=torch.arange(g))


def test_random_keeps_a_uniform_seeded_draw_per_layer_and_head():
    policy = Random(100)
    view = _candidates(1000, 64)
    kept = policy.evict(view).index[0]  # [64, 100]
    assert kept.shape == (64, 100) and all(len(set(row.tolist())) == 100 for row in kept)
    deciles = torch.bincount((kept // 100).flatten(), minlength=10).float() / kept.numel()
    assert bool((deciles - 0.1).abs().max() < 0.02), deciles  # 6400 draws: a decile's share within 0.1 +- 0.02
    assert torch.equal(kept, Random(100).evict(_candidates(1000, 64)).index[0])  # the same on every run
    assert len({tuple(row.tolist()) for row in kept}) == 64  # a different draw per head
    assert not torch.equal(kept, Random(100).evict(_candidates(1000, 64, layer=1)).index[0])  # and per layer
    assert not torch.equal(kept, Random(100, 1).evict(_candidates(1000, 64)).index[0])  # and per seed
    assert Random(100).priority(_candidates(100, 2)) is None  # nothing to evict


def test_random_decoding_keeps_the_top_draws_of_every_token_seen(gqa):
    """Evicting one token a step by a fixed draw per slot keeps what one eviction over every token would."""
    _, _, stepped = run_policy(gqa, "random(16)", absorb=False)
    toks = tokens(1, PROMPT + STEPS, seed=3)
    once = gqa.new_kv_cache(1, PROMPT + STEPS, policy="random(16)")
    gqa(toks, kv_cache=once)
    for l in range(N_LAYERS):
        assert torch.equal(stepped.held_mask(l), once.held_mask(l))


def test_protect_survives_dataclass_replace_and_hashing():
    p = parse_policy("h2o(132)+protect(10%)")
    assert dataclasses.replace(p, size=264).protected == (8, 18)
    assert len({p, parse_policy("h2o(132)+protect(10%)"), parse_policy("h2o(132)")}) == 2

