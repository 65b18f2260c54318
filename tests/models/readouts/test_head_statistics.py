"""`model.attention_stats`: the streaming kernel wired to the model equals statistics computed from
the materialised patterns of `run_with_cache`, for every layer and head, from tokens and from a KV
cache filled by a generation."""

import pytest
import torch

import interp
from interp.models.readouts.head_statistics import stats_frame


def _model(positional: str, kv_heads: int, window=None) -> interp.HookedTransformer:
    cfg = interp.ModelConfig(
        n_layers=3, d_model=36, n_heads=6, n_kv_heads=kv_heads, d_head=6, d_vocab=11, n_ctx=64,
        positional=positional, sliding_window=window, normalization="rmsnorm", d_mlp=20,
    )
    return interp.HookedTransformer(cfg, seed=1).eval()


def _from_pattern(pattern: torch.Tensor, tokens: torch.Tensor, n_sink: int) -> dict:
    """Reference statistics [batch, head, q] from a materialised pattern [batch, head, q, k]."""
    b, h, n, _ = pattern.shape
    p = torch.arange(n)[:, None]
    j = torch.arange(n)[None, :]
    same = tokens[:, :, None] == tokens[:, None, :]  # [batch, q, k]: t_p == t_j
    dup = same & (j < p)
    prev_tok = torch.cat([torch.full_like(tokens[:, :1], -1), tokens[:, :-1]], dim=1)  # t_{j-1}
    ind = (tokens[:, :, None] == prev_tok[:, None, :]) & (j - 1 < p) & (j >= 1)
    mass = lambda m: (pattern * m[:, None].float()).sum(-1)  # noqa: E731
    return {
        "sink": pattern[..., :n_sink].sum(-1),
        "previous": mass((j == p - 1).expand(b, n, n)),
        "duplicate": mass(dup),
        "induction": mass(ind),
        "entropy": -(pattern * pattern.clamp_min(1e-30).log()).sum(-1),
        "max": pattern.max(-1).values,
        "distance": (pattern * (p - j).float()).sum(-1),
    }


@pytest.mark.parametrize("positional,kv_heads,window", [("rotary", 2, None), ("learned", 6, None), ("alibi", 3, 7), ("rotary", 1, 9)])
def test_attention_stats_equal_pattern_statistics(positional, kv_heads, window):
    model = _model(positional, kv_heads, window)
    half = torch.randint(0, 11, (2, 13), generator=torch.Generator().manual_seed(0))
    tokens = torch.cat([half, half], dim=1)  # repeats: duplicate and induction mass is non-trivial
    _, cache = model.run_with_cache(tokens, names_filter=lambda n: n.endswith("hook_pattern"))
    stats = model.attention_stats(tokens, n_sink=2)
    assert sorted(stats) == [0, 1, 2]
    for layer, st in stats.items():
        want = _from_pattern(cache["pattern", layer], tokens, n_sink=2)
        for name, ref in want.items():
            got = getattr(st, name)
            assert got.shape == ref.shape
            tol = 1e-4 if name == "distance" else 1e-5
            assert (got - ref).abs().max() < tol, (layer, name)


def test_attention_stats_from_a_generation_kv_cache():
    model = _model("rotary", 2)
    prompt = torch.randint(0, 11, (2, 9), generator=torch.Generator().manual_seed(1))
    out, kv = model.generate(prompt, max_new_tokens=12, return_kv_cache=True, capture_queries=True)
    from_cache = model.attention_stats(kv_cache=kv)
    seen = out[:, : kv.length]  # the last generated token was never fed back
    fresh = model.attention_stats(seen)
    _, cache = model.run_with_cache(seen, names_filter=lambda n: n.endswith("hook_pattern"))
    for layer in range(model.cfg.n_layers):
        want = _from_pattern(cache["pattern", layer], seen, n_sink=1)
        for name in ("previous", "duplicate", "induction", "sink", "entropy", "max"):
            assert (getattr(from_cache[layer], name) - want[name]).abs().max() < 1e-5, (layer, name)
            assert (getattr(fresh[layer], name) - want[name]).abs().max() < 1e-5, (layer, name)


def test_stats_frame_is_tidy_and_attention_stats_checks_arguments():
    model = _model("rotary", 2)
    tokens = torch.randint(0, 11, (2, 10))
    stats = model.attention_stats(tokens, layers=[1])
    frame = stats_frame(stats)
    assert list(frame.columns[:4]) == ["layer", "batch", "head", "query"]
    assert len(frame) == 2 * 6 * 10 and set(frame["layer"]) == {1}
    row = frame[(frame["batch"] == 1) & (frame["head"] == 4) & (frame["query"] == 7)].iloc[0]
    assert row["previous"] == pytest.approx(float(stats[1].previous[1, 4, 7]))
    with pytest.raises(ValueError, match="exactly one of tokens or kv_cache"):
        model.attention_stats()
    with pytest.raises(ValueError, match="capture_queries=True"):
        kv = model.new_kv_cache(2, 16)
        model(tokens, kv_cache=kv)
        model.attention_stats(kv_cache=kv)


@pytest.mark.parametrize("extra", [dict(positional="rotary", n_kv_heads=2), dict(positional="alibi", sliding_window=7),
                                   dict(positional="rotary", n_kv_heads=3, attn_scores_soft_cap=2.0),
                                   dict(positional="rotary", n_kv_heads=1, learned_sinks=True)],
                         ids=["gqa", "alibi-window", "softcap", "learned-sinks"])
def test_attention_rows_are_the_materialised_patterns_rows(extra):
    """`attention_rows` at a few query positions equals those rows of the pattern the instrumented path builds
    (hook_pattern), for every layer and head: window, ALiBi, soft cap and learned sink logits (whose mass is
    missing from the row) included."""
    from interp.models.readouts.head_statistics import attention_rows, for_each_layer_qk, layer_scoring

    cfg = interp.ModelConfig(n_layers=2, d_model=36, n_heads=6, d_head=6, d_vocab=11, n_ctx=64, d_mlp=20,
                             normalization="rmsnorm", **{"n_kv_heads": 6, **extra})
    model = interp.HookedTransformer(cfg, seed=3).eval()
    if cfg.learned_sinks:
        with torch.no_grad():
            for block in model.blocks:
                block.attn.sinks.normal_(0, 2)  # large enough to take visible mass from each row
    tokens = torch.randint(0, 11, (2, 30), generator=torch.Generator().manual_seed(2))
    rows = torch.tensor([0, 5, 17, 29])
    _, cache = model.run_with_cache(tokens, names_filter=lambda n: n.endswith("hook_pattern"))
    got = {}
    for_each_layer_qk(model, tokens, lambda l, q, k, v: got.__setitem__(l, attention_rows(q, k, rows,
                                                                                           layer_scoring(model, l))))
    for layer in range(cfg.n_layers):
        want = cache["pattern", layer][:, :, rows]
        assert got[layer].shape == want.shape == (2, 6, 4, 30)
        torch.testing.assert_close(got[layer], want.float(), atol=1e-6, rtol=1e-5)
        if cfg.learned_sinks:
            assert float(want.sum(-1).min()) < 0.99  # the sink took mass: the rows sum to less than 1
