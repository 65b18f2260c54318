"""Adding a statistic is one file plus its test: a separable statistic defined here, in the test file,
registered, and held to the float64 materialised-pattern oracle by every route that computes separable
statistics (the fused route, with its device call and with the torch-ops call; the torch tiles), with a
window, padding, GQA, ALiBi, learned sink logits and several blocks."""

from __future__ import annotations

import pytest
import torch

from interp.kernels import Scoring, attention_stats
from interp.kernels.stats import STAT_NAMES, Separable, register
from interp.kernels.stats.reference import reference_stats
from interp.kernels.stats.separable import unregister

TOL = 1e-5


# ---- the new statistic: the mass on keys at even positions, and the mean "token parity" of the keys ------------

EVEN = Separable("even_keys", lambda j, tokens: (j % 2 == 0).float())
TOKEN_PARITY = Separable("odd_tokens", lambda j, tokens: (tokens[:, j] % 2).float(), needs_tokens=True)


@pytest.fixture
def added():
    for stat in (EVEN, TOKEN_PARITY):
        register(stat)
    yield (EVEN.name, TOKEN_PARITY.name)
    for stat in (EVEN, TOKEN_PARITY):
        unregister(stat.name)


def _inputs(seed=0, batch=2, heads=4, kv_heads=2, n_q=29, n_k=37, d=16):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, n_q, d, generator=g)
    k = torch.randn(batch, kv_heads, n_k, d, generator=g)
    tokens = torch.randint(0, 9, (batch, n_k), generator=g)
    kpm = torch.arange(n_k)[None, :] >= torch.tensor([0, 5])[:, None]
    return q, k, tokens, kpm


LAYERS = {
    "plain": Scoring(),
    "window": Scoring(window=7),
    "alibi": Scoring(alibi_slopes=2.0 ** -torch.arange(1, 5, dtype=torch.float32)),
    "sinks_scale": Scoring(scale=0.3, sink_logits=torch.tensor([0.5, -1.0, 2.0, 0.0])),
    "non_causal": Scoring(causal=False, window=9),
    "softcap": Scoring(softcap=2.0),  # the tiles only (the fused route refuses a soft cap)
}


def _diff(got, want, name=""):
    """max |got - want| where finite (the NaNs must agree); the distance, in positions, relative to its largest
    value (as tests/kernels/test_attention_stats.py measures it)."""
    assert torch.equal(got.isnan(), want.isnan())
    ok = ~want.isnan()
    if not ok.any():
        return 0.0
    diff = float((got.double()[ok] - want[ok]).abs().max())
    return diff / max(1.0, float(want[ok].abs().max())) if name == "distance" else diff


@pytest.mark.parametrize("blocks", [(None, None), (8, 16)])
@pytest.mark.parametrize("backend", ["torch", "fused"])
@pytest.mark.parametrize("layer", list(LAYERS))
def test_an_added_separable_statistic_equals_the_oracle(added, layer, backend, blocks):
    scoring = LAYERS[layer]
    if backend == "fused" and (scoring.softcap is not None or (scoring.alibi_slopes is not None and not scoring.causal)):
        pytest.skip("not the fused route's layer")
    q, k, tokens, kpm = _inputs()
    got = attention_stats(q, k, tokens, scoring, key_padding_mask=kpm, backend=backend, block_q=blocks[0],
                          block_k=blocks[1] if backend == "torch" else None)
    ref = reference_stats(q, k, tokens, scoring, key_padding_mask=kpm)
    assert list(got.to_dict()) == list(STAT_NAMES) + list(added)  # the built-in seven, then the added ones
    for name in STAT_NAMES + added:
        assert _diff(got.to_dict()[name], ref[name], name) < TOL, name
    assert float(getattr(got, "even_keys").nan_to_num().max()) > 0.1  # it measures something


def test_asked_alone_and_through_the_torch_ops_call(added):
    """`stats=[name]` computes only it (the fused route leaves the rest NaN), and the block merging of the
    fused call written in torch ops carries the added column too."""
    from interp.kernels.stats.common import validate
    from interp.kernels.stats.fused import attend_math, attention_stats_fused

    q, k, tokens, kpm = _inputs(seed=1, n_q=41, n_k=41)
    ref = reference_stats(q, k, tokens, key_padding_mask=kpm)
    alone = attention_stats(q, k, tokens, key_padding_mask=kpm, stats=["even_keys"], backend="fused")
    assert list(alone.added) == ["even_keys"] and alone.sink.isnan().all()
    assert _diff(alone.even_keys, ref["even_keys"]) < TOL
    args = validate(q, k, tokens, Scoring(window=6), key_padding_mask=kpm)
    stacked = attention_stats_fused(q, k, stats=STAT_NAMES + added, block_q=7, attend=attend_math, **args)
    ref = reference_stats(q, k, tokens, Scoring(window=6), key_padding_mask=kpm)
    for i, name in enumerate(added):
        assert _diff(stacked[len(STAT_NAMES) + i], ref[name]) < TOL, name


def test_without_tokens_a_statistic_that_needs_them_is_nan(added):
    q, k, _, _ = _inputs(seed=2)
    for backend in ("torch", "fused"):
        got = attention_stats(q, k, None, backend=backend, stats=list(added))
        assert got.odd_tokens.isnan().all() and not got.even_keys.isnan().any(), backend


def test_the_triton_kernel_refuses_an_added_statistic_and_auto_avoids_it(added, monkeypatch):
    import interp.kernels.stats as stats_module

    monkeypatch.setattr(stats_module, "_triton_available", lambda: True)
    assert stats_module.resolve_backend("auto", "cuda", stats=("sink", "even_keys")) == "torch"
    assert stats_module.resolve_backend("auto", "cuda", stats=("sink",)) == "triton"
    with pytest.raises(ValueError, match="seven built-in statistics only, not even_keys"):
        stats_module.resolve_backend("triton", "cuda", stats=("even_keys",))


def test_a_built_in_name_cannot_be_taken_and_unknown_names_are_refused(added):
    with pytest.raises(ValueError, match="built-in"):
        register(Separable("sink", lambda j, tokens: j.float()))
    q, k, tokens, _ = _inputs(seed=3)
    with pytest.raises(ValueError, match="stats must name some of .*even_keys"):
        attention_stats(q, k, tokens, stats=["bogus"])
