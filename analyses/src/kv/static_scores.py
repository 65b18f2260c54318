"""Retrieval heads from the weights alone: a static score per query head, from W_Q, W_K and the model's RoPE
frequencies, with no forward pass (`static_retrieval_scores`), and how far it agrees with a measured score
(`agreement`).

Source. "Revealing Long-context Potential of Attention Heads via Frequency Kernels" (ICML 2026; the poster page
https://icml.cc/virtual/2026/poster/65465). Only its abstract was available here, not its text: it analyses "static
frequency kernels formed by different rotation frequency components of attention heads" and designs a Long-context
Potential Score (LPS); "kernels of heads with high LPS exhibit concentrated low-frequency energy and low effective
rank". The paper's formulas were not available, so the definitions below are ours, written from that sentence; they
are not the paper's LPS, and a number here is not a number of the paper's.

Definitions (head h of layer l; under GQA its KV head g = h // (n_heads / kv_heads) gives W_K):
    A = diag(w_ln1) W_Q[l, h] diag(w_qn), B = diag(w_ln1) W_K[l, g] diag(w_kn), both [d_model, d_head]: the
        weights as the head reads the residual stream. w_ln1 is the pre-attention norm's weight (a LayerNorm's
        reading rows are also centred over d_model), folded as `fold_ln` folds it, so the score is the same however
        the model was loaded; w_qn, w_kn are QK-norm's per-dimension weights (Gemma 3, OLMo 2), folded the same way.
        QK-norm's division by the RMS is one positive number per token (per head, or per projection for OLMo 2):
        it scales the whole kernel, which neither a share nor an effective rank sees. Biases (b_Q, b_K) are not in
        the kernel.
    planes: RoPE's rotary planes i = 0 .. rotary_dim/2 - 1, dims (i, i + rotary_dim/2) (rotate half) or (2i, 2i+1)
        (adjacent pairs), turning at theta_i, the layer's own frequencies as loaded (`model.rotary.inv_freq` of the
        layer's table: its base, Gemma 3's local base on sliding layers, the RoPE scaling: dynamic NTK and LongRoPE at
        their short-context frequencies). The dims past rotary_dim (partial rotary) are one more block, theta = 0.
    frequency kernel of plane i: K_i = A[:, plane_i] B[:, plane_i]^T (d_model x d_model, rank <= 2): what the plane
        adds to q . k at relative distance 0 (at distance d, A_i R(theta_i d) B_i^T). The head's kernel
        K = A B^T = sum_i K_i (+ the non-rotary block).
    energy_i = ||K_i||_F^2 = <A_i^T A_i, B_i^T B_i> (two 2 x 2 Gram matrices: never d_model^2 per head).
    low frequency: the planes whose wavelength 2 pi / theta_i exceeds `cut` tokens (default the model's trained
        context n_ctx: they never complete a period within it, as `interp extrapolate`'s never-completed pairs), and
        the non-rotary block (theta = 0, never turns).
    low_freq_share = sum of the low-frequency planes' energies / sum of every plane's (and the block's) energy.
    effective_rank of K (Roy & Vetterli 2007, "The effective rank: a measure of effective dimensionality"):
        exp(-sum_k p_k log p_k), p_k = s_k / sum s, s the singular values of K; computed through QR, A = Q_a R_a and
        B = Q_b R_b, as the singular values of R_a R_b^T (d_head x d_head).
    score = low_freq_share x (1 - (effective_rank - 1) / (r - 1)), r = min(d_head, d_model) the most K can have:
        high when the kernel's energy sits in frequencies that never turn within the context and in few directions.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import torch
from torch import Tensor

from interp.errors import BadValue, check_int
from interp.models.placement.device import to_numpy

from .._common import spearman

def planes(cfg) -> Tensor:
    """[rotary_dim / 2, 2] long: the two dims of each rotary plane (rotate half: i and i + r/2; adjacent: 2i, 2i+1)."""
    r = cfg.rot_dim
    i = torch.arange(r // 2)
    return torch.stack((2 * i, 2 * i + 1) if cfg.rotary_adjacent_pairs else (i, i + r // 2), dim=-1)


def _norm_weight(module, length: int, heads: int) -> Tensor | None:
    """A QK-norm's per-dimension weight as [heads, d_head] (shared by the heads, or one slice each for a norm over
    the whole projection), or None without one."""
    w = getattr(module, "w", None) if module is not None else None
    if w is None:
        return None
    w = w.detach().double()
    return w.expand(heads, length) if w.numel() == length else w.view(heads, length)


def _folded(model, layer: int, W: Tensor, norm) -> Tensor:
    """[heads, d_model, d_head] float64: W with the pre-attention norm's weight on d_model (a LayerNorm's rows also
    centred) and QK-norm's weight on d_head."""
    W = W.detach().double()
    block = model.blocks[layer]
    ln1 = getattr(block, "ln1", None)
    w = getattr(ln1, "w", None) if ln1 is not None else None
    if w is not None:
        W = w.detach().double().to(W.device)[:, None] * W
        if model.cfg.normalization == "layernorm":
            W = W - W.mean(-2, keepdim=True)
    qk = _norm_weight(norm, W.shape[-1], W.shape[0])
    return W if qk is None else W * qk.to(W.device)[:, None, :]


def _effective_rank(A: Tensor, G_B: Tensor) -> Tensor:
    """[heads] the effective rank of each A[h] B[h]^T from A [heads, d_model, d_head] and B's Gram matrices
    G_B = B^T B [heads, d_head, d_head]: with A = Q R (QR), the squared singular values of A B^T are the
    eigenvalues of R G_B R^T (d_head x d_head, symmetric: `eigvalsh`, never d_model x d_model)."""
    R = torch.linalg.qr(A, mode="r").R if A.shape[-2] >= A.shape[-1] else A
    s = torch.linalg.eigvalsh(R @ G_B @ R.transpose(-2, -1)).clamp(min=0).sqrt()
    p = s / s.sum(-1, keepdim=True).clamp(min=torch.finfo(s.dtype).tiny)
    return torch.exp(-(torch.where(p > 0, p * p.log(), torch.zeros_like(p))).sum(-1))


def _plane_energies(G_A: Tensor, G_B: Tensor, pl: Tensor, rot: int) -> tuple[Tensor, Tensor]:
    """([heads, planes] energy of each rotary plane's kernel, [heads] the non-rotary block's) from the d_head x d_head
    Gram matrices: ||A_i B_i^T||_F^2 = sum of (A_i^T A_i) * (B_i^T B_i), elementwise."""
    prod = G_A * G_B  # [heads, d_head, d_head]
    a, b = pl[:, 0], pl[:, 1]
    per_plane = prod[:, a, a] + prod[:, a, b] + prod[:, b, a] + prod[:, b, b]
    return per_plane, prod[:, rot:, rot:].sum((-1, -2))


def _layer_terms(model, layer: int, W_Q: Tensor, W_K: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """One layer's ([head] effective rank, [head, planes] each rotary plane's energy, [head] the non-rotary dims'),
    from W_Q [head, d_model, d_head] and W_K [kv_head, ...] folded as the heads read the stream (`_folded`)."""
    cfg, attn = model.cfg, model.blocks[layer].attn
    A = _folded(model, layer, W_Q, getattr(attn, "q_norm", None))
    B = _folded(model, layer, W_K, getattr(attn, "k_norm", None))
    G_B = (B.transpose(-2, -1) @ B).repeat_interleave(cfg.n_heads // cfg.kv_heads, dim=0)  # each query head's KV head
    per_plane, rest = _plane_energies(A.transpose(-2, -1) @ A, G_B, planes(cfg).to(A.device), cfg.rot_dim)
    return _effective_rank(A, G_B), per_plane, rest


def check_rotary(cfg, what: str = "the static retrieval score") -> None:
    """One line refusing a model (its config) without RoPE: the score reads its rotary frequencies."""
    if cfg.positional != "rotary":
        raise BadValue(f"{what} reads RoPE's frequencies, and this model has {cfg.positional or 'no'} positions, "
                       "not rotary ones")


@torch.no_grad()
def static_retrieval_scores(model, *, cut: int | None = None) -> pd.DataFrame:
    """One row per query head from the weights alone (module docstring): layer, head, kv_head, low_freq_share,
    effective_rank, score, energy (the planes' summed energies), low_planes (how many of the layer's rotary planes
    are low-frequency), cut (the wavelength, in tokens, past which a plane is low-frequency: default cfg.n_ctx)."""
    cfg = model.cfg
    check_rotary(cfg)
    cut = cfg.n_ctx if cut is None else check_int("cut", cut, minimum=1)
    W_Q, W_K = model.W_Q, model.W_K  # [layer, head | kv_head, d_model, d_head]; a wrapped model refuses here
    group, L, H = cfg.n_heads // cfg.kv_heads, cfg.n_layers, cfg.n_heads
    terms = [_layer_terms(model, l, W_Q[l], W_K[l]) for l in range(L)]  # one layer at a time: float64 copies
    erank, per_plane, rest = (torch.stack(t) for t in zip(*terms))  # [layer, head], [layer, head, planes], [..]
    rotary = model.rotary
    theta = torch.stack([rotary.inv_freq[rotary.table_of_layer[l]] for l in range(L)]).detach().double()
    low = ((2 * math.pi / theta) > cut).to(per_plane.device)  # [layer, planes]
    total = per_plane.sum(-1) + rest
    share = ((per_plane * low[:, None]).sum(-1) + rest) / total.clamp(min=torch.finfo(total.dtype).tiny)
    r = min(cfg.head_dim, cfg.d_model)
    score = share * (1 - (erank - 1) / (r - 1)) if r > 1 else share
    heads = np.arange(H)
    frame = pd.DataFrame(dict(
        layer=np.repeat(np.arange(L), H), head=np.tile(heads, L), kv_head=np.tile(heads // group, L),
        low_freq_share=to_numpy(share).ravel(), effective_rank=to_numpy(erank).ravel(), score=to_numpy(score).ravel(),
        energy=to_numpy(total).ravel(), low_planes=np.repeat(to_numpy(low.sum(-1)), H), cut=cut))
    if not np.isfinite(frame[["low_freq_share", "effective_rank", "score"]].to_numpy()).all():
        raise FloatingPointError("a static retrieval score is not finite: NaN or inf is an error, not a ranking")
    return frame


STATIC_COLUMNS = ("static", "low_freq_share", "effective_rank")


def static_columns(model) -> pd.DataFrame:
    """layer, head and the static score as the roles study's head table holds it (`static`: `score`,
    `low_freq_share`, `effective_rank`); NaN for a model without RoPE, which has no static score."""
    cfg = model.cfg
    if cfg.positional != "rotary":
        return pd.DataFrame(dict(layer=np.repeat(np.arange(cfg.n_layers), cfg.n_heads),
                                 head=np.tile(np.arange(cfg.n_heads), cfg.n_layers),
                                 **{c: np.nan for c in STATIC_COLUMNS}))
    frame = static_retrieval_scores(model).rename(columns={"score": "static"})
    return frame[["layer", "head", *STATIC_COLUMNS]]


def agreement(frame: pd.DataFrame, measured: str = "retrieval", static: str = "static", k: int = 10) -> dict:
    """How far a static score agrees with a measured one over the query heads of `frame`: spearman (Spearman's rho
    over every head, ties at their mean rank), top (the `k` heads highest by each column, as (layer, head) lists;
    heads tied at a column's lowest value are never among its top, so a measured top holds fewer than k heads when
    fewer score at all), overlap (how many heads the two tops share), k, heads (how many were compared)."""
    both = frame[["layer", "head", measured, static]].dropna()
    if len(both) < 2:
        raise BadValue(f"agreement needs at least 2 heads with both {measured} and {static} scores, got {len(both)}")

    def top(column: str) -> list[tuple[int, int]]:
        above = both[both[column] > both[column].min()]
        ordered = above.sort_values([column, "layer", "head"], ascending=[False, True, True], kind="stable")
        return [(int(l), int(h)) for l, h in zip(ordered["layer"][:k], ordered["head"][:k])]

    tops = {measured: top(measured), static: top(static)}
    rho = spearman(torch.tensor(both[measured].to_numpy(float)), torch.tensor(both[static].to_numpy(float)))
    return dict(spearman=rho, overlap=len(set(tops[measured]) & set(tops[static])), k=k, heads=len(both), top=tops)
