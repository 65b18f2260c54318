"""Streaming attention statistics as one fused Triton kernel: the GPU path of ``attention_stats``.

This is triton-lang/triton's ``python/tutorials/06-fused-attention.py`` forward pass with the
value matrix replaced. Each program owns ``BLOCK_M`` queries of one (batch, head) and walks the
key blocks they can see, keeping the tutorial's running state per query row:

    m_i    running max of the (base-2) scores
    l_i    sum_j exp2(s_ij - m_i)
    alpha  exp2(m_old - m_new), the rescale applied to every accumulator when m_i grows

Where the tutorial accumulates ``P @ V``, this kernel accumulates ``P @ F`` for a *virtual*
value matrix F of indicator features computed in registers from the tile's positions and
tokens (see :mod:`interp.kernels.stats` for the definitions): sink, previous, duplicate,
induction, the centred score ``s - m`` (entropy) and ``p - j`` (distance). Nothing of size
``n_q x n_k`` ever leaves the chip; the output is 7 floats per query.

Differences from the tutorial, all deliberate:

* one masked loop instead of the off-diagonal / diagonal stages: the masks (causal, window,
  padding, ragged edges) are a few integer compares next to the exp2, and one loop keeps the
  kernel readable; the loop bounds still skip key blocks that are wholly masked;
* ``input_precision="ieee"`` for float32 inputs: these are statistics to compare against a
  materialised pattern, so no TF32 rounding of the scores. fp16 / bf16 inputs go to the tensor
  cores as they are (their products are exact in the fp32 accumulator);
* rows that see no key (left padding) are guarded (``m_use``) and come out NaN.

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

from .stats_common import LOG2E, STAT_NAMES

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
    Q, K, TOKENS, KPM, SLOPES, OUT,  # pointers (TOKENS / KPM / SLOPES: dummies when unused)
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_tb, stride_tn,
    stride_pb, stride_pn,
    stride_os, stride_ob, stride_oh, stride_om,
    n_q, n_k, d, heads, group, n_sink, window,
    qk_scale,  # scale * log2(e): scores are kept in base 2
    cap_scale,  # softcap * log2(e): the soft cap in base 2 (unused without HAS_SOFTCAP)
    CAUSAL: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_TOKENS: tl.constexpr,
    HAS_KPM: tl.constexpr,
    HAS_ALIBI: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    IEEE_DOT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
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
    if HAS_TOKENS:
        tok_base = TOKENS + off_b * stride_tb
        tok_q = tl.load(tok_base + pos * stride_tn, mask=row_ok, other=0)
    if HAS_ALIBI:
        slope = tl.load(SLOPES + off_h) * 1.4426950408889634  # base 2, like the scores

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc_sink = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc_prev = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc_dup = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc_ind = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc_ent = tl.zeros([BLOCK_M], dtype=tl.float32)  # sum p (s - m), base 2
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
        col_ok = offs_n < n_k
        k = tl.load(
            k_base + offs_n[:, None] * stride_kn + offs_d[None, :] * stride_kd,
            mask=col_ok[:, None] & d_ok[None, :],
            other=0.0,
        )
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

        visible = row_ok[:, None] & col_ok[None, :]
        if CAUSAL:
            visible = visible & (delta >= 0)
        if HAS_WINDOW:
            visible = visible & (delta < window)
        if HAS_KPM:
            real = tl.load(KPM + off_b * stride_pb + offs_n * stride_pn, mask=col_ok, other=0)
            visible = visible & (real != 0)[None, :]
        s = tl.where(visible, s, float("-inf"))

        # -- the tutorial's online softmax; m_use keeps fully masked rows at exp2(-inf) = 0 --
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_use)
        s = s - m_use[:, None]
        p = tl.exp2(s)  # unnormalised weights, 0 where masked
        s = tl.where(visible, s, 0.0)  # centred score, the entropy feature (0, not -inf, if masked)

        # -- accumulate P @ F for the virtual value matrix F --
        # entropy: sum p (s - m) re-centred on m_new: alpha * (C + l (m_old - m_new))
        shift = l_i * tl.where(l_i > 0, m_i - m_use, 0.0)  # no -inf * 0, even in dead lanes
        acc_ent = acc_ent * alpha + alpha * shift + tl.sum(p * s, 1)
        acc_dist = acc_dist * alpha + tl.sum(p * delta_f, 1)
        acc_sink = acc_sink * alpha + tl.sum(tl.where(offs_n[None, :] < n_sink, p, 0.0), 1)
        acc_prev = acc_prev * alpha + tl.sum(tl.where(delta == 1, p, 0.0), 1)
        if HAS_TOKENS:
            tok_k = tl.load(tok_base + offs_n * stride_tn, mask=col_ok, other=0)
            tok_before = tl.load(tok_base + (offs_n - 1) * stride_tn, mask=col_ok & (offs_n >= 1), other=0)
            same = (tok_k[None, :] == tok_q[:, None]) & (delta > 0)  # earlier key, same token
            after = (tok_before[None, :] == tok_q[:, None]) & (delta >= 0) & (offs_n[None, :] >= 1)
            acc_dup = acc_dup * alpha + tl.sum(tl.where(same, p, 0.0), 1)
            acc_ind = acc_ind * alpha + tl.sum(tl.where(after, p, 0.0), 1)
        l_i = l_i * alpha + tl.sum(p, 1)
        m_i = m_new

    # -- epilogue: divide by l; a row that saw no key is NaN --
    seen = l_i > 0
    l_safe = tl.where(seen, l_i, 1.0)  # no 1/0 or log(0), even in lanes that are thrown away
    inv_l = tl.where(seen, 1.0 / l_safe, float("nan"))
    out = OUT + off_b * stride_ob + off_h * stride_oh + offs_m * stride_om
    tl.store(out + 0 * stride_os, acc_sink * inv_l, mask=row_ok)
    tl.store(out + 1 * stride_os, acc_prev * inv_l, mask=row_ok)
    if HAS_TOKENS:
        tl.store(out + 2 * stride_os, acc_dup * inv_l, mask=row_ok)
        tl.store(out + 3 * stride_os, acc_ind * inv_l, mask=row_ok)
    tl.store(out + 4 * stride_os, tl.log(l_safe) - acc_ent * inv_l * 0.6931471805599453, mask=row_ok)
    tl.store(out + 5 * stride_os, inv_l, mask=row_ok)  # the top weight is exp2(m - m) / l
    tl.store(out + 6 * stride_os, acc_dist * inv_l, mask=row_ok)


def default_blocks(dtype: torch.dtype, d: int) -> tuple[int, int]:
    """(BLOCK_M, BLOCK_N) for num_warps=8 that compile without register spills.

    Checked with ``triton.compile`` for sm_90 and sm_80 (``cuobjdump --dump-resource-usage``),
    every feature on: fp16 / bf16 64 x 32 uses 105-158 registers for d = 32..256; fp32 (FMA
    path, ``input_precision="ieee"``) 64 x 32 uses 106 at d <= 64 but spills at d = 128, where
    64 x 16 uses 136 (d = 128) and 122 (d = 256). 64 x 64 with 4 warps, the tutorial's shape,
    needs 255 registers and spills for fp32: the feature masks are extra live tiles.
    """
    if dtype == torch.float32 or dtype not in (torch.float16, torch.bfloat16):
        return (64, 32) if d <= 64 else (64, 16)
    return 64, 32


def _interpreting() -> bool:
    """True when the kernel was built by Triton's interpreter (TRITON_INTERPRET=1 at import)."""
    return not isinstance(_attention_stats_kernel, triton.runtime.JITFunction)


def attention_stats_triton(
    q: Tensor,
    k: Tensor,
    *,
    tokens: Tensor | None,
    n_sink: int,
    causal: bool,
    window: int | None,
    scale: float,
    key_padding_mask: Tensor | None,
    alibi_slopes: Tensor | None,
    softcap: float | None = None,
    block_q: int | None = None,
    block_k: int | None = None,
    num_warps: int = 8,
) -> Tensor:
    """Launch the kernel; returns float32 ``[len(STAT_NAMES), batch, heads, n_q]``.

    Arguments are those of :func:`interp.kernels.attention_stats`, already validated by it
    (shapes: q ``[batch, heads, n_q, d]``, k ``[batch, kv_heads, n_k, d]``, tokens int
    ``[batch, n_k]``, key_padding_mask bool ``[batch, n_k]``, alibi_slopes ``[heads]``, softcap a
    float or None).
    ``block_q`` / ``block_k`` are the kernel's BLOCK_M / BLOCK_N (powers of two, >= 16, the
    minimum ``tl.dot`` tile); None picks :func:`default_blocks`.
    """
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
    batch, heads, n_q, d = q.shape
    kv_heads, n_k = k.shape[1], k.shape[2]
    if n_k >= 2**31 // 2:
        raise ValueError(f"n_k={n_k} overflows the kernel's int32 positions")

    # tl.dot wants both operands in one of fp16 / bf16 / fp32. Triton's interpreter multiplies
    # the raw bit patterns of bf16 operands (triton-lang/triton#11584, "not supported yet"), so
    # under the interpreter bf16 goes in as fp32, which holds every bf16 value exactly.
    half = (torch.float16,) if _interpreting() else (torch.float16, torch.bfloat16)
    dtype = q.dtype if q.dtype == k.dtype and q.dtype in half else torch.float32
    q, k = q.to(dtype), k.to(dtype)
    out = torch.full((len(STAT_NAMES), batch, heads, n_q), float("nan"), dtype=torch.float32, device=q.device)
    dummy = out  # any tensor: the kernel never reads an unused pointer
    tokens_arg = tokens.contiguous() if tokens is not None else dummy
    kpm_arg = key_padding_mask.to(torch.int8).contiguous() if key_padding_mask is not None else dummy
    slopes_arg = alibi_slopes.to(torch.float32).contiguous() if alibi_slopes is not None else dummy
    tok_strides = tokens_arg.stride()[:2] if tokens is not None else (0, 0)
    kpm_strides = kpm_arg.stride()[:2] if key_padding_mask is not None else (0, 0)

    grid = (triton.cdiv(n_q, block_q), batch * heads)
    _attention_stats_kernel[grid](
        q, k, tokens_arg, kpm_arg, slopes_arg, out,
        *q.stride(), *k.stride(), *tok_strides, *kpm_strides, *out.stride(),
        n_q, n_k, d, heads, heads // kv_heads, n_sink, window or 0,
        scale * LOG2E,
        (softcap or 1.0) * LOG2E,
        CAUSAL=causal,
        HAS_WINDOW=window is not None,
        HAS_TOKENS=tokens is not None,
        HAS_KPM=key_padding_mask is not None,
        HAS_ALIBI=alibi_slopes is not None,
        HAS_SOFTCAP=softcap is not None,
        IEEE_DOT=dtype == torch.float32,
        BLOCK_M=block_q,
        BLOCK_N=block_k,
        BLOCK_D=max(16, triton.next_power_of_2(d)),
        num_warps=num_warps,
    )
    return out
