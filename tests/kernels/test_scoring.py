"""One `Scoring` per attention layer: what `attn.scoring` says of a native layer (and `scoring_of` of a
wrapped one), that it follows a window narrowed by an analysis, that the model's statistics use it, and
that the old call style (separate geometry keywords, the old positional `validate`) gives the same
numbers for one release, with a DeprecationWarning."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import interp
from interp.kernels import Scoring, attention_stats
from interp.kernels.stats.common import validate
from interp.models.native.attention_layer import narrow_windows, scoring_of
from interp.models.readouts.head_statistics import for_each_layer_qk, layer_scoring

from wrapped_cases import build_wrapped_hf


def _model(positional="alibi", window=7):
    cfg = interp.ModelConfig(n_layers=2, d_model=36, n_heads=6, n_kv_heads=3, d_head=6, d_vocab=11, n_ctx=64,
                             positional=positional, sliding_window=window, normalization="rmsnorm", d_mlp=20)
    return interp.HookedTransformer(cfg, seed=2).eval()


def test_a_native_layers_scoring_is_its_geometry_and_follows_a_narrowed_window():
    model = _model()
    attn = model.blocks[1].attn
    s = attn.scoring
    assert isinstance(s, Scoring)
    assert (s.scale, s.window, s.softcap, s.causal) == (attn.scale, 7, None, True)
    assert s.alibi_slopes is attn.alibi_slopes and s.sink_logits is None
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.window = 3
    with narrow_windows(model, 3):
        assert attn.scoring.window == 3 and layer_scoring(model, 1).window == 3
    assert attn.scoring.window == 7


def test_the_models_statistics_are_the_kernels_with_each_layers_scoring():
    model = _model()
    tokens = torch.randint(0, 11, (2, 19), generator=torch.Generator().manual_seed(0))
    stats = model.attention_stats(tokens)
    seen = []

    def fn(layer, q, k, v):
        want = attention_stats(q, k, tokens, model.blocks[layer].attn.scoring)
        for name, value in want.to_dict().items():
            torch.testing.assert_close(getattr(stats[layer], name), value, equal_nan=True, atol=0, rtol=0)
        seen.append(layer)

    for_each_layer_qk(model, tokens, fn)
    assert seen == [0, 1]


def test_a_wrapped_layers_scoring_reads_the_same_attributes():
    hf = build_wrapped_hf("ministral")  # a sliding window on layer 0 only
    model = interp.from_hf(hf)
    for layer in range(model.cfg.n_layers):
        attn = model.blocks[layer].attn
        s = layer_scoring(model, layer)
        assert (s.scale, s.window, s.alibi_slopes, s.softcap) == (attn.scale, attn.window, None, attn.softcap)
        assert scoring_of(attn).window == s.window
    assert layer_scoring(model, 0).window == 5 and layer_scoring(model, 1).window is None


def test_the_geometry_is_one_scoring_and_the_old_keywords_are_gone():
    """No compatibility layer before a release (CHANGELOG.md): the separate keywords are misspelt arguments."""
    g = torch.Generator().manual_seed(1)
    q, k = torch.randn(2, 4, 13, 8, generator=g), torch.randn(2, 2, 17, 8, generator=g)
    tokens = torch.randint(0, 5, (2, 17), generator=g)
    for old in ({"scale": 0.3}, {"window": 6}, {"windw": 6}):
        with pytest.raises(TypeError, match="unexpected keyword argument"):
            attention_stats(q, k, tokens, backend="torch", **old)
    with pytest.raises(TypeError, match="scoring must be a Scoring"):
        attention_stats(q, k, tokens, {"window": 6})


def test_validate_takes_a_scoring():
    g = torch.Generator().manual_seed(2)
    q, k = torch.randn(1, 2, 5, 4, generator=g), torch.randn(1, 1, 7, 4, generator=g)
    kpm = torch.ones(1, 7, dtype=torch.bool)
    new = validate(q, k, None, Scoring(window=3), n_sink=2, key_padding_mask=kpm)
    assert new.keys() == {"tokens", "n_sink", "key_padding_mask", "scoring"}
    assert new["n_sink"] == 2 and new["scoring"].window == 3
    assert new["scoring"].scale == 0.5  # resolved: 1 / sqrt(d)
    with pytest.raises(TypeError, match="scoring must be a Scoring"):
        validate(q, k, None, 2)  # the old positional call: n_sink where the Scoring goes
    with pytest.raises(ValueError, match="softcap must be None or a finite number > 0"):
        validate(q, k, None, Scoring(softcap=float("nan")))
    with pytest.raises(ValueError, match=r"sink_logits must be a tensor \[heads\] = \[2\]"):
        validate(q, k, None, Scoring(sink_logits=torch.zeros(3)))
