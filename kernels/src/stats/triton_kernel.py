"""Streaming attention statistics on the GPU: one Triton kernel for what the pattern applied to values
gives, the pairs gathered outside it (the same split as :mod:`interp.kernels.stats.fused`).

The kernel is triton-lang/triton's ``python/tutorials/06-fused-attention.py`` forward pass with the value
matrix replaced by the keys themselves. Each program owns ``BLOCK_M`` queries of one (batch, head) and
walks the key blocks they can see, with the tutorial's running state per query row (``m_i`` the running
max of the base-2 scores, ``l_i`` the sum of ``exp2(s - m_i)``, ``alpha`` the rescale when ``m_i`` grows),
and accumulates

    P @ K            on the tensor cores (float32 accumulators; ``tf32x3`` for the 16-bit inputs' weights,
                     IEEE products for float32 inputs): the entropy is ``lse - scale * q . E[k]`` (plus
                     ALiBi's ``slope * E[p - j]`` under causality);
    P @ (p - j)      the distance, and ``P`` on ``j < n_sink`` (the first key blocks only), as row sums.

It writes the sink mass, entropy, top weight (``exp(m - lse) = 1 / l``), distance and each row's
logsumexp; nothing of size ``n_q x n_k`` leaves the chip. The pairwise statistics (previous, duplicate,
induction) are ``exp(s_ij - lse_i)`` at exactly their pairs, found by sorting the tokens
(:func:`interp.kernels.stats.fused.pairwise_masses`, dense products over the sorted order). Where the
expected score is not linear in k (soft-capped scores, ALiBi without causality) the kernel carries
``sum p (s - m)`` per element instead of ``P @ K``.

Differences from the tutorial, all deliberate:

* one masked loop instead of the off-diagonal / diagonal stages: the masks (causal, window,
  padding, ragged edges) are a few integer compares next to the exp2, and one loop keeps the
  kernel readable; the loop bounds still skip key blocks that are wholly masked;
* ``input_precision="ieee"`` for float32 inputs: these are statistics to compare against a
  materialised pattern, so no TF32 rounding of the scores. fp16 / bf16 inputs go to the tensor
  cores as they are (their products are exact in the fp32 accumulator);
* rows that see no key (left padding) are guarded (``m_use``) and come out NaN (their logsumexp too).

Importing this module imports Triton and decides, from ``TRITON_INTERPRET``, whether the kernel
runs compiled (CUDA tensors) or in Triton's interpreter (CPU tensors, for tests); set that
variable before the first ``backend="triton"`` call. ``interp.kernels.stats`` imports this
module lazily, so machines without Triton never load it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from .common import LOG2E, STAT_NAMES
from .fused import pairwise_masses
from .scoring import Scoring

__all__ = ["attention_stats_triton"]


@triton.jit
def _tanh(x):
    """tanh in float32 from exp2 (Triton's interpreter has no tanh): odd, (1 - e) / (1 + e) with
    e = exp(-2|x|), which never overflows; below |x| = 1/8 its Taylor series to x^5 instead, where
    1 - e would cancel (both within ~1e-7 of tanh)."""
    a = tl.abs(x)
    e = tl.exp2(a * -2.8853900817779268)  # exp(-2|x|): 2 log2(e)
    far = (1.0 - e) / (1.0 + e)
    a2 = a * a
    near = a * (1.0 - a2 * (0.3333333333333333 - a2 * 0.13333333333333333))
    t = tl.where(a < 0.125, near, far)
    return tl.where(x < 0, -t, t)


@triton.jit
def _attention_stats_kernel(
    Q, K, KPM, SLOPES, OUT, LSE,  # pointers (KPM / SLOPES: dummies when unused)
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_pb, stride_pn,
    stride_os, stride_ob, stride_oh, stride_om,
    stride_lb, stride_lh, stride_lm,
    n_q, n_k, d, heads, group, n_sink, window,
    qk_scale,  # scale * log2(e): scores are kept in base 2
    cap_scale,  # softcap * log2(e): the soft cap in base 2 (unused without HAS_SOFTCAP)
    CAUSAL: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_KPM: tl.constexpr,
    HAS_ALIBI: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    IEEE_DOT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """One program: BLOCK_M queries of one (batch, head) against every key block they can see. The
    signature is the launch's (pointers, strides, sizes, the constexpr features); the work is in the
    helpers below, one step each (key tile, scores, online softmax, epilogue)."""
    start_m = tl.program_id(0)
    off_bh = tl.program_id(1)
    off_b = (off_bh // heads).to(tl.int64)  # int64 offsets: batch * heads * n * d may pass 2^31
    off_h = (off_bh % heads).to(tl.int64)
    off_kvh = off_h // group  # GQA / MQA: query head h reads key head h // group

    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)  # query index in [0, n_q)
    offs_d = tl.arange(0, BLOCK_D)
    pos = n_k - n_q + offs_m  # absolute query positions: queries are the last n_q keys
    row_ok = offs_m < n_q
    d_ok = offs_d < d

    q = tl.load(
        Q + off_b * stride_qb + off_h * stride_qh + offs_m[:, None] * stride_qm + offs_d[None, :] * stride_qd,
        mask=row_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    k_base = K + off_b * stride_kb + off_kvh * stride_kh
    slope = 0.0
    if HAS_ALIBI:
        slope = tl.load(SLOPES + off_h) * 1.4426950408889634  # base 2, like the scores

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc_k = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)  # sum p k: the entropy's E[score] = scale q . (P K)
    acc_ent = tl.zeros([BLOCK_M], dtype=tl.float32)  # sum p (s - m), base 2: only where E[score] is not linear in k
    acc_sink = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc_dist = tl.zeros([BLOCK_M], dtype=tl.float32)  # sum p (pos - j)

    # Key blocks this query block can see: causal stops at its last query, a window starts
    # (window - 1) keys before its first.
    p_first = n_k - n_q + start_m * BLOCK_M
    lo = 0
    hi = n_k
    if CAUSAL:
        hi = tl.minimum(p_first + BLOCK_M, n_k)
    if HAS_WINDOW:
        lo = (tl.maximum(p_first - window + 1, 0) // BLOCK_N) * BLOCK_N  # aligned loads

    for start_n in tl.range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        k, real = _key_tile(k_base, KPM, off_b, offs_n, offs_d, d_ok, n_k, stride_kn, stride_kd, stride_pb, stride_pn,
                            HAS_KPM)
        s, delta_f, visible = _masked_scores(q, k, pos, offs_n, row_ok, real, window, qk_scale, cap_scale, slope,
                                             CAUSAL, HAS_WINDOW, HAS_ALIBI, HAS_SOFTCAP, IEEE_DOT)
        m_i, l_i, acc_k, acc_ent, acc_sink, acc_dist = _online_step(
            s, delta_f, visible, k, offs_n, n_sink, start_n, m_i, l_i, acc_k, acc_ent, acc_sink, acc_dist,
            CAUSAL, HAS_ALIBI, HAS_SOFTCAP, IEEE_DOT)

    _epilogue(q, m_i, l_i, acc_k, acc_ent, acc_sink, acc_dist, slope, qk_scale, row_ok,
              OUT + off_b * stride_ob + off_h * stride_oh + offs_m * stride_om, stride_os,
              LSE + off_b * stride_lb + off_h * stride_lh + offs_m * stride_lm,
              CAUSAL, HAS_ALIBI, HAS_SOFTCAP)


@triton.jit
def _key_tile(k_base, KPM, off_b, offs_n, offs_d, d_ok, n_k, stride_kn, stride_kd, stride_pb, stride_pn,
              HAS_KPM: tl.constexpr):
    """The tile's keys [BLOCK_N, BLOCK_D] (0 past the ends) and which of them are real: inside the keys and,
    with a padding mask, not padding."""
    col_ok = offs_n < n_k
    k = tl.load(
        k_base + offs_n[:, None] * stride_kn + offs_d[None, :] * stride_kd,
        mask=col_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    real = col_ok
    if HAS_KPM:
        real = col_ok & (tl.load(KPM + off_b * stride_pb + offs_n * stride_pn, mask=col_ok, other=0) != 0)
    return k, real


@triton.jit
def _masked_scores(q, k, pos, offs_n, row_ok, real, window, qk_scale, cap_scale, slope,
                   CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_ALIBI: tl.constexpr,
                   HAS_SOFTCAP: tl.constexpr, IEEE_DOT: tl.constexpr):
    """The tile's base-2 scores (soft cap, ALiBi), -inf where the key is not seen; with p - j and the mask."""
    if IEEE_DOT:
        s = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))
    s = s * qk_scale
    if HAS_SOFTCAP:  # cap * tanh(score / cap), in base 2 like the scores
        s = cap_scale * _tanh(s / cap_scale)
    delta = pos[:, None] - offs_n[None, :]  # p - j
    delta_f = delta.to(tl.float32)
    if HAS_ALIBI:
        s = s - slope * tl.abs(delta_f)  # -slope * |p - j|, as the model

    visible = row_ok[:, None] & real[None, :]  # real: inside the keys and not padding
    if CAUSAL:
        visible = visible & (delta >= 0)
    if HAS_WINDOW:
        visible = visible & (delta < window)
    s = tl.where(visible, s, float("-inf"))
    return s, delta_f, visible


@triton.jit
def _online_step(s, delta_f, visible, k, offs_n, n_sink, start_n, m_i, l_i, acc_k, acc_ent, acc_sink, acc_dist,
                 CAUSAL: tl.constexpr, HAS_ALIBI: tl.constexpr, HAS_SOFTCAP: tl.constexpr, IEEE_DOT: tl.constexpr):
    """The tutorial's online softmax over one tile, and P @ [K | position | sink] into the accumulators:
    the keys on the tensor cores (float32 accumulators; tf32x3 keeps ~float32 accuracy for P's products),
    position and sink as row sums. m_use keeps fully masked rows at exp2(-inf) = 0."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_use)
    p = tl.exp2(s - m_use[:, None])  # unnormalised weights, 0 where masked
    if HAS_SOFTCAP or (HAS_ALIBI and not CAUSAL):  # E[score] is not scale q . E[k] (- slope E[p - j]) here
        sc = tl.where(visible, s - m_use[:, None], 0.0)  # centred score (0, not -inf, if masked)
        shift = l_i * tl.where(l_i > 0, m_i - m_use, 0.0)  # no -inf * 0, even in dead lanes
        acc_ent = acc_ent * alpha + alpha * shift + tl.sum(p * sc, 1)
    else:
        if IEEE_DOT:
            acc_k = acc_k * alpha[:, None] + tl.dot(p, k.to(tl.float32), input_precision="ieee")
        else:
            acc_k = acc_k * alpha[:, None] + tl.dot(p, k.to(tl.float32), input_precision="tf32x3")
    acc_dist = acc_dist * alpha + tl.sum(p * delta_f, 1)
    acc_sink = acc_sink * alpha
    if start_n < n_sink:  # the sink keys live in the first block(s) only
        acc_sink += tl.sum(tl.where(offs_n[None, :] < n_sink, p, 0.0), 1)
    l_i = l_i * alpha + tl.sum(p, 1)
    return m_new, l_i, acc_k, acc_ent, acc_sink, acc_dist


@triton.jit
def _epilogue(q, m_i, l_i, acc_k, acc_ent, acc_sink, acc_dist, slope, qk_scale, row_ok, out, stride_os, lse_out,
              CAUSAL: tl.constexpr, HAS_ALIBI: tl.constexpr, HAS_SOFTCAP: tl.constexpr):
    """Divide by l and store; a row that saw no key is NaN (its lse too, so the pairs are NaN)."""
    seen = l_i > 0
    l_safe = tl.where(seen, l_i, 1.0)  # no 1/0 or log(0), even in lanes that are thrown away
    inv_l = tl.where(seen, 1.0 / l_safe, float("nan"))
    lse2 = m_i + tl.log2(l_safe)  # base 2, over the model's scores
    dist = acc_dist * inv_l
    if HAS_SOFTCAP or (HAS_ALIBI and not CAUSAL):
        entropy = tl.log(l_safe) - acc_ent * inv_l * 0.6931471805599453
    else:
        # H = lse - E[score]: E[score] = scale q . E[k], less slope * E[p - j] under (causal) ALiBi; base 2 -> e
        e_score = tl.sum(q.to(tl.float32) * acc_k, 1) * inv_l * qk_scale
        if HAS_ALIBI:
            e_score = e_score - slope * dist
        entropy = (lse2 - e_score) * 0.6931471805599453
    entropy = tl.where(seen, entropy, float("nan"))
    tl.store(out + 0 * stride_os, acc_sink * inv_l, mask=row_ok)
    tl.store(out + 4 * stride_os, entropy, mask=row_ok)
    tl.store(out + 5 * stride_os, inv_l, mask=row_ok)  # the top weight is exp2(m - m) / l
    tl.store(out + 6 * stride_os, dist, mask=row_ok)
    tl.store(lse_out, tl.where(seen, lse2 * 0.6931471805599453, float("nan")), mask=row_ok)


def default_blocks(dtype: torch.dtype, d: int) -> tuple[int, int]:
    """(BLOCK_M, BLOCK_N) for num_warps=8 that compile without register spills.

    Checked with ``triton.compile`` for sm_90 (``cuobjdump --dump-resource-usage``), every feature on,
    the ``P @ K`` accumulator [BLOCK_M, d] included: fp16 / bf16 64 x 32 uses 226 registers at d = 64 and
    247 at d = 128, and spills at d = 256 (64 x 32, 32 x 32 and 64 x 16 all do), where 32 x 16 uses 220;
    fp32 (FMA path, ``input_precision="ieee"``) 64 x 32 uses 138 at d = 64 and spills at d = 128
    (64 x 16 too), where 32 x 16 uses 103 (130 at d = 256).
    """
    if dtype in (torch.float16, torch.bfloat16):
        return (64, 32) if d <= 128 else (32, 16)
    return (64, 32) if d <= 64 else (32, 16)


def _interpreting() -> bool:
    """True when the kernel was built by Triton's interpreter (TRITON_INTERPRET=1 at import)."""
    return not isinstance(_attention_stats_kernel, triton.runtime.JITFunction)


def attention_stats_triton(q: Tensor, k: Tensor, scoring: Scoring | None = None, *, tokens: Tensor | None = None,
                           n_sink: int = 1, key_padding_mask: Tensor | None = None, block_q: int | None = None,
                           block_k: int | None = None, num_warps: int = 8) -> Tensor:
    """Launch the kernel; returns float32 ``[len(STAT_NAMES), batch, heads, n_q]``.

    Arguments are those of :func:`interp.kernels.attention_stats`, already validated by it
    (shapes: q ``[batch, heads, n_q, d]``, k ``[batch, kv_heads, n_k, d]``, tokens int
    ``[batch, n_k]``, key_padding_mask bool ``[batch, n_k]``; `scoring` checked, without sink logits).
    ``block_q`` / ``block_k`` are the kernel's BLOCK_M / BLOCK_N (powers of two, >= 16, the
    minimum ``tl.dot`` tile); None picks :func:`default_blocks`.
    """
    scoring = Scoring.of(scoring)
    block_q, block_k = _launch_blocks(q, k, block_q, block_k)
    batch, heads, n_q, d = q.shape
    kv_heads, n_k = k.shape[1], k.shape[2]
    # tl.dot wants both operands in one of fp16 / bf16 / fp32. Triton's interpreter multiplies
    # the raw bit patterns of bf16 operands (triton-lang/triton#11584, "not supported yet"), so
    # under the interpreter bf16 goes in as fp32, which holds every bf16 value exactly.
    half = (torch.float16,) if _interpreting() else (torch.float16, torch.bfloat16)
    dtype = q.dtype if q.dtype == k.dtype and q.dtype in half else torch.float32
    q, k = q.to(dtype), k.to(dtype)
    out = torch.full((len(STAT_NAMES), batch, heads, n_q), float("nan"), dtype=torch.float32, device=q.device)
    lse = torch.empty(batch, heads, n_q, dtype=torch.float32, device=q.device)
    dummy = out  # any tensor: the kernel never reads an unused pointer
    kpm_arg = key_padding_mask.to(torch.int8).contiguous() if key_padding_mask is not None else dummy
    slopes = scoring.alibi_slopes
    kpm_strides = kpm_arg.stride()[:2] if key_padding_mask is not None else (0, 0)

    grid = (triton.cdiv(n_q, block_q), batch * heads)
    _attention_stats_kernel[grid](
        q, k, kpm_arg, dummy if slopes is None else slopes.float().contiguous(), out, lse,
        *q.stride(), *k.stride(), *kpm_strides, *out.stride(), *lse.stride(),
        n_q, n_k, d, heads, heads // kv_heads, n_sink, scoring.window or 0,
        scoring.scale * LOG2E,
        (scoring.softcap or 1.0) * LOG2E,
        CAUSAL=scoring.causal,
        HAS_WINDOW=scoring.window is not None,
        HAS_KPM=key_padding_mask is not None,
        HAS_ALIBI=slopes is not None,
        HAS_SOFTCAP=scoring.softcap is not None,
        IEEE_DOT=dtype == torch.float32,
        BLOCK_M=block_q,
        BLOCK_N=block_k,
        BLOCK_D=max(16, triton.next_power_of_2(d)),
        num_warps=num_warps,
    )
    # the pairs (previous, duplicate, induction): exp(s - lse) at exactly those, found by sorting the tokens
    masses = pairwise_masses(q.float(), k.float(), tokens, lse, scoring, key_padding_mask=key_padding_mask)
    for name, value in masses.items():
        out[STAT_NAMES.index(name)] = value
    out[:, lse.isnan()] = float("nan")  # a row that saw no key: NaN everywhere
    return out


def _launch_blocks(q: Tensor, k: Tensor, block_q: int | None, block_k: int | None) -> tuple[int, int]:
    """The kernel's (BLOCK_M, BLOCK_N), checked, after checking that it can run on these tensors."""
    if not (q.is_cuda or _interpreting()):
        raise ValueError(
            f"backend='triton' needs CUDA tensors (q is on {q.device}); to run it on the CPU for "
            "testing, set TRITON_INTERPRET=1 before the first backend='triton' call, or use "
            "backend='torch'"
        )
    default_q, default_k = default_blocks(q.dtype, q.shape[-1])
    block_q, block_k = block_q or default_q, block_k or default_k
    for name, block in (("block_q", block_q), ("block_k", block_k)):
        if block < 16 or block & (block - 1):
            raise ValueError(f"backend='triton' needs {name} to be a power of two >= 16, got {block}")
    if k.shape[2] >= 2**31 // 2:
        raise ValueError(f"n_k={k.shape[2]} overflows the kernel's int32 positions")
    return block_q, block_k
