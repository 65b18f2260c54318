"""Exact per-head attention statistics in O(n) memory, never the pattern: the entry point and the tiled kernels.

Detecting head types needs a handful of numbers per query, not the ``n_q x n_k`` pattern
(``p`` is the query's absolute position, ``j`` the key's; see :func:`attention_stats`):

============  ==========================================  ==================================
statistic     the pattern's mass on / mean of             TransformerLens counterpart
============  ==========================================  ==================================
sink          ``j < n_sink``                              (Xiao et al. 2023, attention sinks)
previous      ``j == p - 1``                              previous-token detection pattern
duplicate     ``j < p and tok[j] == tok[p]``              duplicate-token detection pattern
induction     ``1 <= j <= p and tok[j - 1] == tok[p]``    induction detection pattern
distance      ``p - j``                                   (mean attention distance)
entropy       ``-sum_j P log P``                          ``-sum p log p``
max           ``max_j P_ij``                              ``pattern.max(-1)``
============  ==========================================  ==================================

The induction row is TransformerLens's ``get_induction_head_detection_pattern``: the
duplicate pattern shifted one key to the right, first column zeroed, then ``tril``.

Three implementations share the names, constants, validation and result type of
:mod:`interp.kernels.stats_common`:

* ``backend="fused"`` (:mod:`interp.kernels.stats_fused`): the separable statistics (sink, distance,
  entropy) from ONE call of torch's fused attention kernel per block of queries on the values
  ``[K | position | sink]`` and its logsumexp, the pairwise ones (previous, duplicate, induction) as
  ``exp(s_ij - lse_i)`` at the few pairs found by sorting the tokens, the max from a row-max pass.
  About the cost of an attention forward without ``max`` (BENCHMARKS.md); ``"auto"`` runs it off CUDA
  when ``max`` is not asked for (:func:`resolve_backend`). Not for soft-capped scores or non-causal
  ALiBi (:func:`interp.kernels.stats_fused.unsupported`).
* ``backend="torch"`` (here): a tiled flash-style loop that carries every statistic as an indicator
  feature of the (query, key) pair through the online softmax (Dao et al. 2022; triton-lang/triton
  ``python/tutorials/06-fused-attention.py``): keep the running row max ``m_i`` and normaliser ``l_i``;
  for every key block, rescale all accumulators by ``alpha = exp(m_old - m_new)``, add
  ``sum_j exp(s_ij - m_new) * feature_ij``; ``accumulator / l_i`` at the end. Any device, every
  geometry (soft-capping included); the fused route's exact cross-check, and its fallback.
* ``backend="triton"`` (:mod:`interp.kernels.stats_triton`): the tiled loop as one GPU kernel; imported
  lazily, so machines without Triton still import :mod:`interp.kernels`.

All compute in float32 whatever the input dtype, and match statistics computed from a
materialised float64 pattern (``kernels/stats_reference.py``) to float32 round-off
(``tests/test_attention_stats.py``).
"""

from __future__ import annotations

import importlib.util
import os
from typing import Literal

import torch
from torch import Tensor

from .stats_common import LOG2E, STAT_NAMES, AttentionStats, validate
from .stats_fused import attention_stats_fused, unsupported
from .visibility import visible

__all__ = ["AttentionStats", "attention_stats", "resolve_backend", "STAT_NAMES"]

Backend = Literal["fused", "torch", "triton", "auto"]
BACKENDS = ("fused", "torch", "triton", "auto")

# Torch: a tile is [batch, heads, block_q, block_k] float32 and ~4 are alive at once. 256 x 512
# keeps per-op overhead (Python, OpenMP fork/join) small next to the work: on 2 CPU cores it is
# ~1.2x faster than 128 x 256 when idle and several times faster when the cores are shared.
# For wide batch * heads, block_q halves until a tile holds at most TORCH_TILE_ELEMENTS.
TORCH_BLOCKS = (256, 512)
TORCH_TILE_ELEMENTS = 1 << 22  # 16 MiB of float32 per tile-sized temporary


# --------------------------------------------------------------------------------------------
# Public entry point
# --------------------------------------------------------------------------------------------


def attention_stats(
    q: Tensor,
    k: Tensor,
    tokens: Tensor | None = None,
    *,
    n_sink: int = 1,
    causal: bool = True,
    window: int | None = None,
    scale: float | None = None,
    key_padding_mask: Tensor | None = None,
    alibi_slopes: Tensor | None = None,
    softcap: float | None = None,
    sink_logits: Tensor | None = None,
    backend: Backend = "auto",
    stats=None,
    block_q: int | None = None,
    block_k: int | None = None,
) -> AttentionStats:
    """Exact per-query statistics of ``softmax(q k^T * scale + mask)``, without the pattern.

    About one fused attention forward of time; memory ``O(batch * heads * n_q)`` plus one block.

    Args:
        q: queries ``[batch, heads, n_q, d]`` (after RoPE if the model uses it). Any float dtype;
            statistics are computed in float32.
        k: keys ``[batch, kv_heads, n_k, d]``, ``n_k >= n_q``. ``heads % kv_heads == 0``;
            query head ``h`` reads key head ``h // (heads // kv_heads)`` (GQA; MQA when
            ``kv_heads == 1``).
        tokens: int ``[batch, n_k]``, the token id at every key position. The query at
            absolute position ``p`` holds ``tokens[b, p]``. If None, ``duplicate`` and
            ``induction`` are NaN-filled (every other statistic is computed).
        n_sink: the first ``n_sink`` keys count as the attention sink (``>= 0``).
        causal: key ``j`` is visible only to queries at ``p >= j``.
        window: sliding window: key ``j`` is visible only if ``p - j < window``; None for none.
        scale: score scale; default ``1 / sqrt(d)``.
        key_padding_mask: bool ``[batch, n_k]``, True for a real token; None for all real.
        alibi_slopes: float ``[heads]``; adds ``-slope[h] * |p - j|`` to every score (the
            model's ALiBi; the absolute value only matters for future keys when ``causal=False``).
        softcap: Gemma 2's soft-capping: the scaled scores become ``softcap * tanh(scores / softcap)``
            before ALiBi and the mask, as the model computes them; None for none.
        sink_logits: float ``[heads]``, learned sink logits (gpt-oss): each joins its head's softmax
            denominator, ``P_ij = exp(s_ij) / (exp(sink_h) + sum_j exp(s_ij))``, and is no key, so the
            statistics are of a pattern whose rows sum to less than 1. The fused route and the torch
            tiles (``"triton"`` is refused). None for none.
        backend: ``"auto"`` (the default: the fused route off CUDA for statistics without ``max``, the
            device's tiled kernel otherwise, as measured; :func:`resolve_backend` says which and why),
            ``"fused"`` (torch's fused
            attention kernel plus gathers, :mod:`interp.kernels.stats_fused`; any device, not for
            ``softcap`` or non-causal ALiBi), ``"torch"`` (tiled, any device, every geometry), or
            ``"triton"`` (CUDA tensors, or CPU tensors with ``TRITON_INTERPRET=1`` set before the
            first Triton call).
        stats: the statistics wanted (names from :data:`STAT_NAMES`); None for all. The fused route
            skips the work of the others and leaves them NaN: ``max`` alone costs a pass of
            ``q k^T`` tiles, the pairwise ones a sort and a gather. The tiled kernels compute all.
        block_q, block_k: block sizes; None picks the backend's default (fused: 2,048 queries per
            call, fewer with ALiBi, a window or a large mask; torch 256 x 512, with block_q shrunk for
            large ``batch * heads``; Triton 64 x 32, or 64 x 16 for float32 with ``d > 64``: no
            register spills on sm_80 / sm_90). Triton needs powers of two >= 16.

    Returns:
        :class:`AttentionStats`, float32 ``[batch, heads, n_q]`` per statistic, on q's device.

    Positions and masks. Queries are the *last* ``n_q`` positions of the key sequence (decoding
    from a KV cache): query ``i`` sits at absolute position ``p = n_k - n_q + i``; key ``j`` at
    ``j``. Key ``j`` is visible to the query at ``p`` iff all of::

        (not causal or j <= p)  and  (window is None or p - j < window)
                                and  (key_padding_mask is None or key_padding_mask[b, j])

    For ``n_q = 3``, ``n_k = 6`` (x visible, . masked)::

                          causal              causal, window=3
           key j:     0 1 2 3 4 5           0 1 2 3 4 5
        i=0 (p=3)     x x x x . .           . x x x . .
        i=1 (p=4)     x x x x x .           . . x x x .
        i=2 (p=5)     x x x x x x           . . . x x x

    i.e. the causal diagonal sits at the *bottom right* (as flash-attention's ``causal=True``
    with ``seqlen_q < seqlen_k``), not at the top left.

    A query with no visible key (e.g. a left-padding position, which under a causal mask sees
    only padding) gets NaN in every statistic; so does ``duplicate``/``induction`` when
    ``tokens`` is None.

    Raises:
        ValueError / TypeError: on malformed inputs (messages name the offending shapes).
        ImportError: ``backend="triton"`` without Triton installed.
    """
    if sink_logits is not None:  # not in the Triton kernel: "triton" is refused
        sink_logits = _check_sink_logits(sink_logits, q, backend)
    wanted = _check_stats(stats)
    backend = resolve_backend(backend, q.device if isinstance(q, Tensor) else "cpu", causal=causal,
                              alibi=alibi_slopes is not None, softcap=softcap is not None,
                              sink_logits=sink_logits is not None, stats=wanted)
    args = validate(q, k, tokens, n_sink, window, scale, key_padding_mask, alibi_slopes, softcap)
    if backend == "fused":
        if block_q is not None and block_q < 1:
            raise ValueError(f"block_q must be positive, got {block_q}")
        stacked = attention_stats_fused(q, k, causal=causal, sink_logits=sink_logits, stats=wanted,
                                        block_q=block_q, **args)
    elif backend == "triton":
        # Imported here because it imports triton, an optional third-party package (GPU path).
        from .stats_triton import attention_stats_triton

        stacked = attention_stats_triton(q, k, causal=causal, block_q=block_q, block_k=block_k, **args)
    else:
        default_q, default_k = _torch_blocks(q.shape[0] * q.shape[1])
        block_q, block_k = block_q or default_q, block_k or default_k
        if block_q < 1 or block_k < 1:
            raise ValueError(f"block sizes must be positive, got block_q={block_q}, block_k={block_k}")
        stacked = _attention_stats_torch(q, k, causal=causal, block_q=block_q, block_k=block_k,
                                         sink_logits=sink_logits, **args)
    return AttentionStats.from_stacked(stacked)


def _check_stats(stats) -> tuple[str, ...]:
    """The statistics asked for, in STAT_NAMES order; None for all."""
    if stats is None:
        return STAT_NAMES
    names = (stats,) if isinstance(stats, str) else tuple(stats)
    unknown = [n for n in names if n not in STAT_NAMES]
    if unknown or not names:
        raise ValueError(f"stats must name some of {', '.join(STAT_NAMES)}; got {list(names)!r}")
    return tuple(n for n in STAT_NAMES if n in names)


def _check_sink_logits(sink_logits, q: Tensor, backend: str) -> Tensor:
    """Learned sink logits [heads] as float32 on q's device; refused with the Triton kernel, which lacks them."""
    if backend == "triton":
        raise ValueError("learned sink logits (gpt-oss) are in the fused route and the torch statistics kernel only: "
                         "pass backend='auto', 'fused' or 'torch'")
    heads = q.shape[1] if isinstance(q, Tensor) and q.ndim == 4 else None
    if not isinstance(sink_logits, Tensor) or sink_logits.shape != (heads,):
        shape = list(sink_logits.shape) if isinstance(sink_logits, Tensor) else type(sink_logits).__name__
        raise ValueError(f"sink_logits must be a tensor [heads] = [{heads}], got {shape}")
    if not bool(torch.isfinite(sink_logits).all()):
        raise ValueError("sink_logits must be finite")
    return sink_logits.detach().to(device=q.device, dtype=torch.float32)


def resolve_backend(backend: str = "auto", device: torch.device | str = "cpu", *, causal: bool = True,
                    alibi: bool = False, softcap: bool = False, sink_logits: bool = False, stats=None) -> str:
    """The statistics kernel that `backend` runs on tensors on `device`: ``"fused"``, ``"triton"`` or ``"torch"``.

    ``"auto"`` follows the measurements (BENCHMARKS.md, "Head statistics at the fused kernel's speed"):

    * the fused route (:mod:`interp.kernels.stats_fused`) off CUDA when `stats` leaves out ``max`` (the
      atlas's detectors and sinks): 0.9-1.3x the layer's SDPA forward on a CPU, where the tiles take
      0.7-1.6x; and it keeps that under load, where the tiles' many small parallel ops fall far behind;
    * the tiled kernel of the device otherwise: with ``max`` (all seven, the default) the tiles get the row
      maximum free while the fused route pays a pass of ``q k^T`` for it (1.3-2.0x against the tiles'
      0.7-1.6x on an idle CPU); on CUDA Triton when installed (its fused route runs torch's float32
      memory-efficient kernel, without tensor cores: `interp bench --sections gpu` compares them), and
      for the layers the fused route cannot compute exactly (soft-capped scores, ALiBi without causality:
      :func:`interp.kernels.stats_fused.unsupported`). Learned sink logits are not in the Triton kernel:
      the torch tiles there.

    An explicit backend the machine or the layer cannot run is refused here, before any work, in one
    line naming what can: ``"triton"`` without Triton, or on a non-CUDA device (unless
    ``TRITON_INTERPRET=1``, Triton's CPU interpreter, for tests); ``"fused"`` on such a layer."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; valid backends: {', '.join(map(repr, BACKENDS))}")
    device = torch.device(device)
    why = unsupported(causal=causal, alibi_slopes=torch.empty(0) if alibi else None, softcap=1.0 if softcap else None)
    if backend == "auto":
        triton = device.type == "cuda" and _triton_available() and not sink_logits
        wants_max = stats is None or "max" in stats
        if why is None and device.type != "cuda" and not wants_max:
            return "fused"
        return "triton" if triton else "torch"
    if backend == "fused" and why is not None:
        raise ValueError(f"backend='fused': {why}; backend='auto' picks one that can")
    if backend == "triton":
        if not _triton_available():
            raise ImportError("backend='triton' needs the `triton` package (pip install 'interp[triton]'); "
                              "backend='torch' runs anywhere")
        if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError(f"backend='triton' needs CUDA tensors (these are on {device}); use backend='auto' or "
                             "'torch' here, or set TRITON_INTERPRET=1 before the first Triton call to test it on the CPU")
    return backend


def _torch_blocks(batch_heads: int) -> tuple[int, int]:
    block_q, block_k = TORCH_BLOCKS
    while block_q > 16 and batch_heads * block_q * block_k > TORCH_TILE_ELEMENTS:
        block_q //= 2
    return block_q, block_k


def _triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


# --------------------------------------------------------------------------------------------
# Tiled torch implementation
# --------------------------------------------------------------------------------------------

# Rows of the running accumulator: the numerators of every statistic but `max` (which is 1/l).
_SINK, _PREV, _DUP, _IND, _ENT, _DIST = range(6)
LN2 = 0.6931471805599453


@torch.no_grad()
def _attention_stats_torch(
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
    softcap: float | None,
    block_q: int,
    block_k: int,
    sink_logits: Tensor | None = None,
) -> Tensor:
    """Tiled streaming statistics; returns ``[len(STAT_NAMES), batch, heads, n_q]`` float32.

    For each query block, loop over the key blocks it can see (``[lo, hi)`` from the causal
    and window masks; blocks that are all padding in every sequence are skipped too) and keep,
    per query row, ``m`` (running max score), ``l`` (``sum exp(s - m)``) and ``acc[f]``
    (``sum exp(s - m) * feature_f``). Masks are only built for tiles that cut through them.

    Scores are kept in base 2 (``log2(e)`` folded into the scale, ``exp2`` instead of ``exp``,
    as the Triton tutorial does): exp2 is ~1.6x faster than exp on CPU and exp dominates a tile.

    Learned sink logits (`sink_logits` [heads], gpt-oss) add one term, exp2(sink - m), to each row's
    normaliser at the end, and no feature: the statistics are those of the pattern over the real keys,
    whose rows then sum to less than 1 (as the model's hook_pattern shows it).
    """
    batch, heads, n_q, d = q.shape
    kv_heads, n_k = k.shape[1], k.shape[2]
    group = heads // kv_heads
    offset = n_k - n_q  # absolute position of query 0
    device = q.device
    f32 = torch.float32

    # Scale (and log2 e) folded into q once; [batch, kv_heads, group, n_q, d] so that one matmul
    # per tile serves a whole GQA group without repeating k.
    qf = (q.to(f32) * (scale * LOG2E)).reshape(batch, kv_heads, group, n_q, d)
    k_t = k.to(f32).transpose(-1, -2)  # [batch, kv_heads, d, n_k]
    slopes = None if alibi_slopes is None else (alibi_slopes * LOG2E).view(1, heads, 1, 1)
    sink2 = None if sink_logits is None else (sink_logits * LOG2E).view(1, heads, 1)  # base 2, like the scores
    if tokens is not None:
        tokens_prev = torch.cat([tokens[:, :1], tokens[:, :-1]], dim=1)  # tokens[j - 1]; j=0 masked
    if key_padding_mask is not None:
        # real_before[j]: number of real (batch, key) entries before key j -> O(1) block checks.
        real_before = [0] + key_padding_mask.sum(0).cumsum(0).tolist()
    # p - j for a tile is rel + (p0 - ks): small integers, exact in float32 below 2^24.
    rel = (torch.arange(block_q, device=device)[:, None] - torch.arange(block_k, device=device)).to(f32)

    out = torch.full((len(STAT_NAMES), batch, heads, n_q), float("nan"), dtype=f32, device=device)
    neg_inf = float("-inf")

    for qs in range(0, n_q, block_q):
        qe = min(qs + block_q, n_q)
        bq = qe - qs
        p0, p1 = offset + qs, offset + qe - 1  # absolute positions of the block's first/last query
        q_blk = qf[:, :, :, qs:qe].reshape(batch, kv_heads, group * bq, d)
        if tokens is not None:
            tok_q = tokens[:, p0 : p1 + 1, None]  # [batch, bq, 1]

        m = torch.full((batch, heads, bq), neg_inf, dtype=f32, device=device)  # running max
        l = torch.zeros((batch, heads, bq), dtype=f32, device=device)  # sum exp2(s - m)
        acc = torch.zeros((6, batch, heads, bq), dtype=f32, device=device)  # feature numerators

        lo = 0 if window is None else max(0, p0 - window + 1)
        hi = p1 + 1 if causal else n_k
        for ks in range(lo, hi, block_k):
            ke = min(ks + block_k, hi)
            bk = ke - ks
            if key_padding_mask is not None:
                n_real = real_before[ke] - real_before[ks]
                if n_real == 0:
                    continue  # all padding in every sequence: contributes nothing
                pad_cut = n_real < batch * bk
            else:
                pad_cut = False
            causal_cut = causal and ke - 1 > p0  # some query in the block sees only part of it
            window_cut = window is not None and p1 - ks >= window
            below = ke - 1 < p0  # every key strictly before every query

            s = torch.matmul(q_blk, k_t[..., ks:ke]).view(batch, heads, bq, bk)
            if softcap is not None:  # cap * tanh(score / cap), the score in nats, kept in base 2
                s = torch.tanh(s.mul_(1.0 / (softcap * LOG2E))).mul_(softcap * LOG2E)
            delta = rel[:bq, :bk] + float(p0 - ks)  # [bq, bk] p - j
            if slopes is not None:
                s.addcmul_(slopes, delta.abs(), value=-1.0)  # ALiBi: -slope * |p - j|, as the model

            ok = None  # only tiles that straddle a mask edge pay for one
            if causal_cut or window_cut:
                ok = visible(delta, causal=causal_cut, window=window if window_cut else None)  # the one rule
            if pad_cut:
                real = key_padding_mask[:, None, None, ks:ke]  # [batch, 1, 1, bk]
                ok = real if ok is None else ok & real
            if ok is not None:
                s.masked_fill_(~ok, neg_inf)

            # Running max and rescale; m_use avoids (-inf) - (-inf) on rows with nothing seen yet.
            m_new = torch.maximum(m, s.amax(-1))
            m_use = m_new.nan_to_num(neginf=0.0)
            alpha = torch.exp2(m - m_use)
            s.sub_(m_use[..., None])  # s - m_new: the entropy feature (-inf where masked)
            p = torch.exp2(s)  # [batch, heads, bq, bk] unnormalised weights, 0 where masked
            if ok is not None:
                s.masked_fill_(~ok, 0.0)  # so p * s is 0, not 0 * -inf, on masked keys

            # Entropy numerator C = sum_j p_j (s_j - m); moving m to m_new turns the old sum
            # into alpha * (C + l * (m - m_new)). Rows with l == 0 have no old terms.
            shift = torch.where(l > 0, l * (m - m_use), 0.0)
            acc.mul_(alpha)
            acc[_ENT] += alpha * shift + torch.linalg.vecdot(p, s)
            # Distance summed elementwise, not as pos * sum(p) - sum(p * j): that cancels and
            # loses ~pos * eps (1e-5 at n=100, 4e-3 at 64k) where this loses distance * eps.
            acc[_DIST] += torch.linalg.vecdot(p, delta)
            if ks < n_sink:
                acc[_SINK] += p[..., : min(n_sink, ke) - ks].sum(-1)
            if ks <= p1 - 1 and p0 - 1 < ke:  # key p - 1 falls in this block for some query
                col = torch.arange(p0 - 1 - ks, p1 - ks, device=device)  # [bq] column of p - 1
                in_blk = (col >= 0) & (col < bk)
                idx = col.clamp(0, bk - 1).view(1, 1, bq, 1).expand(batch, heads, bq, 1)
                acc[_PREV] += p.gather(-1, idx).squeeze(-1) * in_blk
            if tokens is not None:
                same = tok_q == tokens[:, None, ks:ke]  # [batch, bq, bk] tok[j] == tok[p]
                after = tok_q == tokens_prev[:, None, ks:ke]  # tok[j - 1] == tok[p]
                if not below:
                    same &= delta > 0  # strictly earlier keys
                    after &= delta >= 0  # j - 1 < p
                if ks == 0:
                    after[:, :, 0] = False  # key 0 has no predecessor
                # float masks: p * float is ~2x faster than p * bool on CPU
                acc[_DUP] += torch.linalg.vecdot(p, same.to(f32)[:, None])
                acc[_IND] += torch.linalg.vecdot(p, after.to(f32)[:, None])
            l = l * alpha + p.sum(-1)
            m = m_new

        seen = l > 0  # False: the query saw no key -> NaN everywhere
        if sink2 is None:
            inv_l = torch.where(seen, 1.0 / l, float("nan"))
            entropy = torch.log(l) - acc[_ENT] * inv_l * LN2  # ln l - E[s - m], s back in nats
        else:  # normaliser l + exp2(sink - m), rescaled to the larger of m and the sink
            top = torch.maximum(m, sink2)
            shrink = torch.exp2(m - top)
            inv_l = torch.where(seen, shrink / (l * shrink + torch.exp2(sink2 - top)), float("nan"))
            # -sum_j P_j ln P_j with ln P_j = ln 2 (s_j - m) + ln inv_l and sum_j P_j = l * inv_l
            entropy = -torch.log(inv_l) * l * inv_l - acc[_ENT] * inv_l * LN2
        blk = out[..., qs:qe]
        blk[0] = acc[_SINK] * inv_l
        blk[1] = acc[_PREV] * inv_l
        if tokens is not None:
            blk[2] = acc[_DUP] * inv_l
            blk[3] = acc[_IND] * inv_l
        blk[4] = entropy
        blk[5] = inv_l  # the top weight is exp2(m - m) / l (/ the sink's normaliser)
        blk[6] = acc[_DIST] * inv_l
    return out
