"""The atlas's shared pass (`interp.analyses.atlas.atlas_pass`): head detection, attention sinks and the ICL
score's residual stream from ONE forward, with the numbers each analysis gives alone."""

from __future__ import annotations

import pandas as pd
import pytest
import torch

import interp
from interp.analyses import heads as heads_module
from interp.analyses.atlas.atlas_pass import atlas_pass
from interp.analyses.heads import detect_heads, icl_score
from interp.analyses.atlas.registry import ANALYSES, Context
from interp.analyses.sinks import attention_sinks
from interp.models.readouts.head_statistics import attention_logsumexp, attention_weights_at, for_each_layer_qk, layer_scoring

KINDS = ("previous_token", "duplicate_token", "induction")


@pytest.fixture(scope="module")
def model():
    return interp.load("rope-gqa-4l")


def _tokens(model, n, batch=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    half = torch.randint(1, model.cfg.d_vocab, (batch, n // 2), generator=g)
    return torch.cat([half, half], 1).to(model.device)  # repeats: duplicate and induction mass


def test_one_pass_gives_each_analysis_its_own_numbers(model):
    tokens = _tokens(model, 200)  # past detect_heads' pattern length: it streams
    shared = atlas_pass(model, tokens, KINDS)
    alone = detect_heads(model, tokens, kinds=KINDS, method="auto")
    assert set(alone["method"]) == {"streaming"}
    pd.testing.assert_frame_equal(shared.detect, alone, check_exact=True)  # the same stream, the same sums
    sinks = attention_sinks(model, tokens, n_sink=1)
    pd.testing.assert_frame_equal(shared.sinks, sinks, check_exact=True)
    assert shared.sinks.attrs["sink_rate"] == sinks.attrs["sink_rate"]
    with torch.no_grad():
        resid = model(tokens, stop_at_layer=model.cfg.n_layers)
    torch.testing.assert_close(shared.resid, resid, atol=0, rtol=0)  # the same forward
    pd.testing.assert_frame_equal(icl_score(model, tokens, early=40, resid=shared.resid), icl_score(model, tokens, early=40))


def test_sinks_alpha_is_the_weight_on_key_0_from_the_rows_logsumexp(model):
    """alpha_0 from the streaming `sink` statistic equals the old route (each row's logsumexp, then the
    pattern's column 0), and n_sink = 2 (which keeps that route) agrees with it on key 0."""
    tokens = _tokens(model, 120, seed=1)
    frame = attention_sinks(model, tokens, n_sink=1)
    two = attention_sinks(model, tokens, n_sink=2)
    want = {}

    def fn(layer, q, k, v):
        scoring = layer_scoring(model, layer)
        lse = attention_logsumexp(q, k, scoring)
        w = attention_weights_at(q, k, lse, torch.arange(1), scoring)[..., 0]  # [b, h, pos]
        want[layer] = w.mean((0, 2))

    for_each_layer_qk(model, tokens, fn)
    for layer, alpha in want.items():
        got = torch.tensor(frame[frame.layer == layer].sort_values("head")["alpha"].to_numpy())
        torch.testing.assert_close(got.float(), alpha.float(), atol=1e-6, rtol=0)
        key0 = two[(two.layer == layer) & (two.key == 0)].sort_values("head")["alpha"].to_numpy()
        torch.testing.assert_close(torch.tensor(key0).float(), alpha.float(), atol=1e-6, rtol=0)


def test_the_registry_runs_one_forward_for_detection_induction_and_sinks(model, monkeypatch):
    calls = []
    monkeypatch.setattr(heads_module, "for_each_layer_qk", lambda *a, **k: calls.append(1) or for_each_layer_qk(*a, **k))
    tokens = _tokens(model, 200, seed=2)
    ctx = Context(model=model, tokens=tokens, data=None)
    rows = {name: ANALYSES[name].run(ctx) for name in ("previous_token", "duplicate_token", "induction", "sinks")}
    assert len(calls) == 1, "detection, sinks and the ICL score share one streaming forward"
    alone = detect_heads(model, tokens, kinds=KINDS)
    for kind in ("previous_token", "duplicate_token"):
        got = rows[kind].sort_values(["layer", "head"])["value"].to_numpy()
        want = alone[alone.kind == kind].sort_values(["layer", "head"])["score"].to_numpy()
        assert (got == want).all(), kind
    sinks = attention_sinks(model, tokens)
    got = rows["sinks"]
    alpha = got[got.metric == "sink_alpha"].sort_values(["layer", "head"])["value"].to_numpy()
    assert (alpha == sinks.sort_values(["layer", "head"])["alpha"].to_numpy()).all()
    icl = icl_score(model, tokens, early=min(50, tokens.shape[1] // 4))
    ind = rows["induction"]
    assert float(ind[ind.metric == "icl_score"]["value"].iloc[0]) == pytest.approx(float(icl["icl_score"].iloc[0]), abs=0)


def test_short_sequences_keep_the_pattern_detection_and_run_alone(model):
    tokens = _tokens(model, 40, seed=3)
    shared = atlas_pass(model, tokens, KINDS)
    assert set(shared.detect["method"]) == {"pattern"} and shared.sinks is None and shared.resid is None
