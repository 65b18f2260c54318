"""The static retrieval score (`interp.analyses.kv.static_scores`) against a hand computation in plain torch: the
explicit d_model x d_model kernel of every rotary plane and its energy, the low-frequency planes from the RoPE base
written out, the effective rank from `torch.linalg.svdvals` of the explicit head kernel; GQA reads each query head's
KV head; partial rotary counts the dims that never turn as low-frequency; QK-norm's and the pre-attention norm's
weights are folded; a model without RoPE is refused in one line; the agreement with a measured score; the `static`
ranking of `kv select`; and `interp kv static` on the command line."""

from __future__ import annotations

import math
import subprocess
import sys
import tempfile
import time

import numpy as np
import pandas as pd
import pytest
import torch
from core_models import GEMMA3_LIKE, build, small

import interp
from interp.analyses.kv.roles import kv_roles, ranking
from interp.analyses.kv.static_scores import agreement, static_retrieval_scores
from interp.cli import main as cli
from interp.errors import BadValue

# GQA (6 query heads on 2 KV heads), RMSNorm, RoPE base 100 over d_head 8: planes 0, 1 turn within n_ctx = 32
# tokens (wavelengths 6.3 and 19.9), planes 2, 3 do not (62.8 and 198.7)
GQA = small(positional="rotary", normalization="rmsnorm", d_model=48, n_heads=6, n_kv_heads=2, rotary_base=100.0,
            qkv_bias=False)
PARTIAL = small(positional="rotary", rotary_dim=4, rotary_base=100.0)  # LayerNorm; dims 4..7 never turn
ADJACENT = small(positional="rotary", rotary_adjacent_pairs=True, rotary_base=100.0, n_kv_heads=1)


def by_hand(model, cut: int | None = None) -> pd.DataFrame:
    """Every head's low-frequency share, effective rank and score written out: explicit kernels, no Gram matrices,
    no QR, the frequencies from the RoPE base of each layer."""
    cfg = model.cfg
    cut = cfg.n_ctx if cut is None else cut
    dh, rot, rows = cfg.head_dim, cfg.rot_dim, []
    for l in range(cfg.n_layers):
        block = block_weights(model, l)
        theta = [cfg.rope_base(l) ** (-2 * i / rot) for i in range(rot // 2)]
        pairs = [(2 * i, 2 * i + 1) if cfg.rotary_adjacent_pairs else (i, i + rot // 2) for i in range(rot // 2)]
        for h in range(cfg.n_heads):
            A, B = block["q"][h], block["k"][h // (cfg.n_heads // cfg.kv_heads)]
            energies = [(A[:, list(p)] @ B[:, list(p)].T).pow(2).sum() for p in pairs]
            rest = (A[:, rot:] @ B[:, rot:].T).pow(2).sum()  # the dims past rotary_dim: never turn
            low = sum(e for e, t in zip(energies, theta) if 2 * math.pi / t > cut) + rest
            share = float(low / (sum(energies) + rest))
            s = torch.linalg.svdvals(A @ B.T)  # the d_model x d_model kernel itself
            p = s / s.sum()
            p = p[p > 0]
            erank = float(torch.exp(-(p * p.log()).sum()))
            score = share * (1 - (erank - 1) / (min(dh, cfg.d_model) - 1))
            rows.append(dict(layer=l, head=h, low_freq_share=share, effective_rank=erank, score=score))
    return pd.DataFrame(rows)


def block_weights(model, l: int) -> dict:
    """Layer l's W_Q [head, d_model, d_head] and W_K [kv_head, ...] in float64, as the head reads the stream: the
    pre-attention norm's weight on d_model (a LayerNorm's rows centred), QK-norm's on d_head."""
    a, ln1 = model.blocks[l].attn, model.blocks[l].ln1
    out = {}
    for name, W, norm in (("q", a.W_Q, getattr(a, "q_norm", None)), ("k", a.W_K, getattr(a, "k_norm", None))):
        W = W.detach().double() * ln1.w.detach().double()[:, None]
        if model.cfg.normalization == "layernorm":
            W = W - W.mean(1, keepdim=True)
        if norm is not None:
            W = W * norm.w.detach().double()
        out[name] = W
    return out


def check_equal(model, cut=None):
    got = static_retrieval_scores(model, cut=cut)
    want = by_hand(model, cut)
    for c in ("low_freq_share", "effective_rank", "score"):
        np.testing.assert_allclose(got[c].to_numpy(), want[c].to_numpy(), rtol=1e-9, atol=1e-12, err_msg=c)
    return got


@pytest.mark.parametrize("cfg", [GQA, PARTIAL, ADJACENT, GEMMA3_LIKE], ids=["gqa", "partial", "adjacent", "gemma3-like"])
def test_the_static_score_equals_a_hand_computation(cfg):
    """On GQA, partial rotary (LayerNorm), adjacent pairs (MQA) and Gemma 3's block (QK-norm, a local RoPE base on
    its sliding layers): every head's share, effective rank and score as written out by hand."""
    model = build(cfg)
    with torch.no_grad():  # a pre-attention norm far from 1, so a weight left unfolded shows
        for block in model.blocks:
            block.ln1.w.mul_(torch.linspace(0.2, 3.0, cfg.d_model))
    got = check_equal(model)
    assert 0 < got["low_freq_share"].min() and got["low_freq_share"].max() < 1
    check_equal(model, cut=10)  # another cut: plane 1 (wavelength 19.9) becomes low-frequency


def test_gemma3s_local_and_global_layers_read_their_own_frequencies():
    """Gemma 3-like: two sliding layers (base 100) and one full layer (base 10000): the full layer has more planes
    that never turn within n_ctx."""
    frame = static_retrieval_scores(build(GEMMA3_LIKE))
    per_layer = frame.groupby("layer")["low_planes"].first().tolist()
    assert per_layer == [2, 2, 3]  # base 100: 19.9 < 32 < 62.8; base 10000: 6.3 < 32 < 62.8 from plane 1 on


def test_query_heads_read_their_kv_head():
    """GQA: the kv_head column is h // 3, and changing KV head 1's W_K of layer 0 changes exactly query heads
    3, 4, 5 of layer 0."""
    model = build(GQA)
    before = static_retrieval_scores(model)
    assert before["kv_head"].tolist() == [h // 3 for h in range(6)] * 2
    with torch.no_grad():
        model.blocks[0].attn.W_K[1, :, 2:4] *= 5.0  # rotate half over 8 dims: plane 2 is dims (2, 6)
    after = static_retrieval_scores(model)
    changed = ~np.isclose(before["score"], after["score"], rtol=1e-12, atol=0)
    assert after.loc[changed, ["layer", "head"]].values.tolist() == [[0, 3], [0, 4], [0, 5]]


def test_partial_rotary_counts_the_dims_that_never_turn_as_low_frequency():
    """Weights only on the non-rotary dims: share 1; only on the fastest plane: share 0."""
    model = build(PARTIAL)
    with torch.no_grad():
        for block in model.blocks:
            keep = torch.zeros(8)
            keep[4:] = 1
            block.attn.W_Q.mul_(keep)
            block.attn.W_K.mul_(keep)
    assert np.allclose(static_retrieval_scores(model)["low_freq_share"], 1.0)
    with torch.no_grad():
        for block in model.blocks:
            fastest = torch.zeros(8)
            fastest[[0, 2]] = 1  # plane 0 of rotary_dim 4 (rotate half): dims 0 and 2, wavelength 2 pi
            block.attn.W_Q.copy_(torch.randn_like(block.attn.W_Q) * fastest)
            block.attn.W_K.copy_(torch.randn_like(block.attn.W_K) * fastest)
    assert np.allclose(static_retrieval_scores(model)["low_freq_share"], 0.0)


def test_a_model_without_rope_is_refused_in_one_line(capsys, monkeypatch):
    """From Python and from the CLI, before the model loads."""
    with pytest.raises(BadValue) as err:
        static_retrieval_scores(build(small()))
    assert "\n" not in str(err.value) and "RoPE" in str(err.value) and "learned" in str(err.value)

    def no_load(*a, **k):
        raise AssertionError("the model was loaded before the refusal")

    monkeypatch.setattr(interp, "load", no_load)
    assert cli(["kv", "static", "attn-only-2l"]) == 2
    assert capsys.readouterr().err.count("\n") == 1


def test_agreement_by_hand():
    """Spearman's rho over every head, and the top k: heads tied at a column's lowest value are never its top."""
    frame = pd.DataFrame(dict(layer=[0, 0, 1, 1], head=[0, 1, 0, 1], retrieval=[0.0, 0.9, 0.0, 0.5],
                              static=[0.1, 0.8, 0.3, 0.2]))
    a = agreement(frame, k=2)
    ranks_r, ranks_s = np.array([1.5, 4, 1.5, 3]), np.array([1, 4, 3, 2])
    assert a["spearman"] == pytest.approx(np.corrcoef(ranks_r, ranks_s)[0, 1])
    assert a["top"]["retrieval"] == [(0, 1), (1, 1)] and a["top"]["static"] == [(0, 1), (1, 0)]
    assert a["overlap"] == 1 and a["heads"] == 4
    a = agreement(frame.assign(retrieval=[0.0, 0.9, 0.0, 0.0]), k=2)
    assert a["top"]["retrieval"] == [(0, 1)] and a["overlap"] == 1  # one head scores at all


def test_the_static_ranking_of_kv_select_is_the_max_over_query_heads():
    query = pd.DataFrame(dict(layer=[0] * 4, head=range(4), kv_head=[0, 0, 1, 1], retrieval=[0.0] * 4,
                              static=[0.1, 0.4, 0.3, 0.2]))
    assert ranking(kv_roles(query), "static").tolist() == [0.4, 0.3]


def test_kv_select_refuses_the_static_ranking_without_rope(tmp_path, capsys, monkeypatch):
    """In one line, before the model loads."""

    def no_load(*a, **k):
        raise AssertionError("the model was loaded before the refusal")

    monkeypatch.setattr(interp, "load", no_load)
    assert cli(["kv", "select", "attn-only-2l", "--rankings", "static", "--fractions", "0.5", "--window", "32",
                "--lengths", "248", "--seq-len", "200", "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--rankings static" in err and "RoPE" in err


def test_kv_static_prints_the_heads_and_its_help_imports_no_torch(capsys):
    assert cli(["kv", "static", "rope-gqa-4l", "--top", "3"]) == 0
    out = capsys.readouterr().out
    assert "Static retrieval score of 16 query heads" in out and len([l for l in out.splitlines() if l.startswith("L")]) == 3
    code = ("import sys; from interp.cli import main\ntry:\n    main(['kv', 'static', '--help'])\nexcept SystemExit: pass\n"
            "print('TORCH' if 'torch' in sys.modules else 'NO-TORCH')")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=tempfile.gettempdir())
    assert run.stdout.splitlines()[-1] == "NO-TORCH", run.stdout[-300:]


@pytest.mark.slow
def test_smollm2s_static_score_takes_seconds_and_is_finite(smollm2):
    start = time.perf_counter()
    frame = static_retrieval_scores(smollm2)
    assert time.perf_counter() - start < 20  # ~0.4 s warm, ~3 s the first linear algebra of a process, here
    assert len(frame) == 270 and np.isfinite(frame[["low_freq_share", "effective_rank", "score"]].to_numpy()).all()
    assert frame["low_planes"].unique().tolist() == [12]  # base 1e5 over 32 planes: 12 never turn within 8192
