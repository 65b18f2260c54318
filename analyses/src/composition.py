"""Q-, K- and V-composition scores between heads (Elhage et al. 2021, "A Mathematical Framework for
Transformer Circuits", Sec. "Virtual attention heads" / the composition-score appendix).

An earlier head A writes x W_OV^A into the residual stream (row vectors, TransformerLens layout:
W_OV = W_V W_O, [d_model, d_model]); a later head B reads it through
    Q-composition   W_OV^A W_QK^B       (A's output feeds B's queries;  W_QK = W_Q W_K^T)
    K-composition   W_OV^A W_QK^B^T     (A's output feeds B's keys)
    V-composition   W_OV^A W_OV^B       (A's output feeds B's values)
and the score of a product W_A W_B is ||W_A W_B||_F / (||W_A||_F ||W_B||_F), in [0, 1].

No d_model x d_model matrix is formed: with W_A = U P V^T-style factors every norm reduces to traces
of d_head x d_head Gram matrices, ||V_A (O_A X_B) Y_B^T||_F^2 = tr(P^T (V_A^T V_A) P (Y_B^T Y_B)),
P = O_A X_B. Biases and layer norms are ignored (as in the paper), and so is a gated model's output
gate (`attn_output_gate`: sigmoid(x W_gate_attn) scales z per position, not a weight). GQA/MQA: a query head uses the
key/value head of its group (h // (n_heads / n_kv_heads)).

Random baseline: the mean score of the same products built from i.i.d. Gaussian factors of the same
shapes (one value for Q, K and V: the three products have the same distribution), as in
TransformerLens's composition demos; subtract it to read scores as "above chance".
"""

from __future__ import annotations

import functools
from typing import Sequence

import pandas as pd
import torch
from torch import Tensor

from interp.models.placement.device import to_numpy
from interp.models.readouts.factored import FactoredMatrix
from interp.models.readouts.factored import composition_scores as _scores

KINDS = ("q", "k", "v")


def composition_matrix(model, kind: str) -> Tensor:
    """[layer_a, head_a, layer_b, head_b] composition scores of `kind` ("q", "k", "v"); NaN unless
    layer_a < layer_b (`model.all_composition_scores`: head A's OV circuit against head B's QK (q),
    QK^T (k) or OV (v), kv heads expanded to their query heads)."""
    if kind not in KINDS:
        raise ValueError(f"composition kind must be one of {KINDS}, got {kind!r}")
    L = model.cfg.n_layers
    scores = model.all_composition_scores(kind.upper()).float().cpu()
    later = torch.arange(L)[:, None, None, None] < torch.arange(L)[None, None, :, None]
    return scores.masked_fill(~later, float("nan"))


@functools.lru_cache(maxsize=16)
def random_baseline(d_model: int, d_head: int, n_samples: int = 200, seed: int = 0) -> float:
    """Mean composition score of products of i.i.d. Gaussian factors of the model's shapes."""
    g = torch.Generator().manual_seed(seed)
    r = lambda *shape: torch.randn(*shape, generator=g, dtype=torch.float64)
    V, O, X, Y = r(n_samples, d_model, d_head), r(n_samples, d_head, d_model), r(n_samples, d_model, d_head), r(n_samples, d_model, d_head)
    return float(_scores(FactoredMatrix(V, O), FactoredMatrix(X, Y.transpose(-1, -2)), broadcast_dims=False).mean())


def composition_scores(
    model, kinds: Sequence[str] = KINDS, *, subtract_baseline: bool = False, n_baseline_samples: int = 200, seed: int = 0
) -> pd.DataFrame:
    """Composition scores between every earlier head A and later head B.

    Returns one row per (kind, A, B) with layer_a < layer_b: layer_a, head_a, layer_b, head_b, kind,
    score, raw_score, baseline, subtract_baseline. `score` is raw_score - baseline when
    `subtract_baseline`, else raw_score."""
    cfg = model.cfg
    baseline = random_baseline(cfg.d_model, cfg.head_dim, n_baseline_samples, seed)
    frames = []
    for kind in ([kinds] if isinstance(kinds, str) else kinds):
        m = composition_matrix(model, kind)
        idx = to_numpy((~m.isnan()).nonzero())
        raw = to_numpy(m[~m.isnan()])
        frames.append(pd.DataFrame({
            "layer_a": idx[:, 0], "head_a": idx[:, 1], "layer_b": idx[:, 2], "head_b": idx[:, 3], "kind": kind, "score": raw - baseline if subtract_baseline else raw,
            "raw_score": raw, "baseline": baseline, "subtract_baseline": subtract_baseline,
        }))
    return pd.concat(frames, ignore_index=True)
