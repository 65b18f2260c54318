"""Composition scores against TransformerLens 4's `all_composition_scores` (same HF weights in a
TransformerBridge), against the d_model x d_model products formed explicitly, and hand-built cases."""

from __future__ import annotations

import pytest
import torch
from analyses_fixtures import build
from hf_cases import build_hf

import interp
from interp.analyses import composition_matrix, composition_scores
from interp.analyses.composition import random_baseline


@pytest.mark.parametrize("name", ["gpt2", "llama-gqa"])
def test_matches_transformer_lens(name):
    pytest.importorskip("transformer_lens")
    from transformer_lens.model_bridge.sources._bridge_builder import build_bridge_from_module

    hf = build_hf(name)
    ours = interp.from_hf(hf)
    bridge = build_bridge_from_module(hf, type(hf).__name__, hf_config=hf.config)
    L = ours.cfg.n_layers
    for kind in "qkv":
        theirs = bridge.all_composition_scores(kind.upper()).scores.float()  # zeros where layer_a >= layer_b
        mine = composition_matrix(ours, kind)
        later = torch.arange(L)[:, None, None, None] < torch.arange(L)[None, None, :, None]
        later = later.expand_as(mine)
        assert torch.isnan(mine[~later]).all()
        assert (mine[later] - theirs[later]).abs().max() < 1e-4, kind


def test_matches_explicit_products_with_gqa():
    model = build("rotary-gqa")
    group = model.cfg.n_heads // model.cfg.kv_heads
    with torch.no_grad():
        W_Q, W_O = model.W_Q.double(), model.W_O.double()
        W_K = model.W_K.double().repeat_interleave(group, 1)
        W_V = model.W_V.double().repeat_interleave(group, 1)
    OV = W_V @ W_O  # [layer, head, d_model, d_model]
    QK = W_Q @ W_K.transpose(-1, -2)
    right = {"q": QK, "k": QK.transpose(-1, -2), "v": OV}
    score = lambda a, b: float(torch.linalg.norm(a @ b) / (torch.linalg.norm(a) * torch.linalg.norm(b)))
    for kind in "qkv":
        m = composition_matrix(model, kind)
        for ha, hb in [(0, 0), (1, 5), (4, 2), (5, 3)]:
            assert m[0, ha, 1, hb] == pytest.approx(score(OV[0, ha], right[kind][1, hb]), rel=1e-4)


def test_hand_built_projectors_give_the_exact_scores():
    """Head (0, 0) has W_OV = P, the projector onto residual dims [0, d_head). Head (1, 1) reads queries,
    keys and values through the same P (W_QK = W_OV = P): every score is ||P P|| / ||P||^2 = 1/sqrt(d_head).
    Head (1, 0) reads only dims [d_head, 2 d_head): every score is 0."""
    model = build("attn-only-3l", sharpen=1.0)
    d, dh = model.cfg.d_model, model.cfg.head_dim
    E0, E1 = torch.eye(d)[:, :dh], torch.eye(d)[:, dh : 2 * dh]  # [d_model, d_head] embeddings of the two subspaces
    with torch.no_grad():
        a0, a1 = model.blocks[0].attn, model.blocks[1].attn
        a0.W_V[0].copy_(E0)
        a0.W_O[0].copy_(E0.T)
        for W, E in ((a1.W_Q[1], E0), (a1.W_K[1], E0), (a1.W_V[1], E0), (a1.W_O[1], E0.T),
                     (a1.W_Q[0], E1), (a1.W_K[0], E1), (a1.W_V[0], E1)):
            W.copy_(E)  # the views write through to W_qkv / W_O_flat
    for k in "qkv":
        m = composition_matrix(model, k)
        assert m[0, 0, 1, 1] == pytest.approx(dh**-0.5, rel=1e-6), k
        assert m[0, 0, 1, 0] == pytest.approx(0.0, abs=1e-7), k


def test_baseline_subtraction_and_rows():
    model = build("attn-only-3l")
    raw = composition_scores(model)
    sub = composition_scores(model, subtract_baseline=True)
    H = model.cfg.n_heads
    assert len(raw) == 3 * H * H * (1 * 2 + 1 * 1)  # layer pairs (0,1), (0,2), (1,2)
    assert (raw["layer_a"] < raw["layer_b"]).all()
    assert ((sub["score"] - (raw["raw_score"] - raw["baseline"])).abs() < 1e-9).all()
    b = raw["baseline"].iloc[0]
    assert 0 < b < 1 and b == pytest.approx(random_baseline(model.cfg.d_model, model.cfg.head_dim), rel=1e-12)
