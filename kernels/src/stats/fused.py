"""Head statistics at the fused attention kernel's speed: ``attention_stats(backend="fused")``.

The statistics come in two kinds (DESIGN.md, "Streaming attention statistics"), and neither needs
the per-pair indicator features the tiled kernels (:mod:`interp.kernels.stats.tiles`, ``triton_kernel``)
compute in every tile:

* **Separable** statistics are the pattern applied to a value matrix, which is what a fused attention
  kernel computes at full speed. One call of torch's fused kernel per block of queries, with

      queries        [ q | slope_h / scale | 0 ... ]
      keys = values  [ k | j - c | j < n_sink | 0 ... ]      (width d + 2, rounded up to 8)

  returns ``o = sum_j P_ij [k_j | j - c | sink_j]`` and the row's logsumexp ``lse`` (the zero columns
  of the queries leave the scores ``scale * q . k`` unchanged). Then, exactly:

      sink      o[sink column]
      distance  (p - c) - o[position column]
      entropy   lse - scale * q' . o            (-sum_j P log P = lse - sum_j P s_j)

  ``c`` is the block's first query position, so the position column is small near the queries and
  its weighted sum loses ~eps * (distance + block) to round-off, never eps * p. ALiBi (causal) rides
  along in the same call: the query's extra column is ``slope_h / scale``, so every score gains
  ``slope_h * (j - c) = -slope_h * (p - j) + slope_h * (p - c)``: the model's bias plus a constant per
  row, which ``lse`` and ``q' . o`` both carry and the entropy cancels (``lse`` is shifted back).

* **Pairwise** statistics (previous ``j = p - 1``, duplicate ``tok[j] = tok[p], j < p``, induction
  ``tok[j - 1] = tok[p], 1 <= j <= p``) touch few pairs. ``P_ij = exp(s_ij - lse_i)`` for exactly those,
  found by sorting ``(token, position)``: each query's earlier occurrences of its token are one run of
  the sorted order (cut at the window's edge by a binary search), so the pairs cost O(n log n + pairs)
  to find and O(pairs * d) to score, gathered in chunks of bounded size (memory O(n)).

* **max** ``= exp(m_i - lse_i)`` needs the row maximum ``m_i``, which no fused kernel torch has returns:
  a pass of ``q k^T`` tiles and their row max, run only when ``max`` is asked for (on a CPU it costs
  about half an attention forward).

Learned sink logits (gpt-oss) join each row's denominator and take no value: ``lse`` gains them
(``logaddexp``), the pattern over real keys sums to ``r = exp(lse_keys - lse) < 1``, the separable
statistics scale by ``r`` and the entropy is ``r * (H_keys - log r)``; the pairs and the max use the full
``lse``. Soft-capped scores (Gemma 2) are not linear in k, so the entropy identity fails: those layers,
and ALiBi without causality (``|p - j|`` is not linear in j), are not this route's (:func:`unsupported`);
``backend="auto"`` sends them to the tiled kernels.

The fused kernel, per device: CPU ``aten._scaled_dot_product_flash_attention_for_cpu`` (returns the
logsumexp); CUDA ``aten._scaled_dot_product_efficient_attention`` with ``compute_log_sumexp``; any other
device the same in plain torch ops (:func:`attend_math`, also the tests' cross-check of the merging).
Everything runs in float32 whatever the input dtype (fp16/bf16 kernels round the pattern to 8-11 bits
before ``P @ V``), so the statistics equal the float64 materialised pattern's
(`kernels/src/stats/reference.py`) to float32 round-off.

Blocks. Causal without a window: the keys before the block are seen by all its queries (one call, no
mask, or the padding row), the block's own square is causal (``is_causal``, top-left = bottom-right on
a square). A window: each block's keys are the band its queries reach, with an explicit 0 / -inf mask
(the model's banded prefill does the same). Partial results merge through their logsumexps. Which
keys a query sees is :func:`interp.kernels.visibility.visible` plus the padding, and the count of them
per query (prefix sums of the padding) says which rows saw nothing (the CPU kernel reports ``lse = 0``
there): those are NaN in every statistic, as in the tiled kernels.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import Tensor

from ..visibility import visible
from .common import STAT_NAMES
from .scoring import Scoring
from .separable import SEPARABLE, columns
from .tiles import ScoreTiles

__all__ = ["attention_stats_fused", "unsupported", "pairwise_masses"]

CHUNK = 2048  # queries per block, causal without ALiBi
ALIBI_CHUNK = 64  # with ALiBi the scores near the diagonal are ~slope * block in the call: keep their round-off small
WINDOW_CHUNK_MIN = 128  # a window's blocks: max(this, window // 2) queries (keys: block + window - 1)
MASK_BUDGET = 1 << 22  # floats of one call's explicit mask (16 MiB); blocks shrink to fit
MAX_TILES = (256, 512)  # the row-max pass: queries x keys per tile (CPU: fits the caches; 2 threads share it)
CUDA_MAX_TILES = (1024, 4096)  # on a GPU: few large tiles (each op is a kernel launch)
PAIR_BUDGET = 1 << 22  # floats of scores at once (heads x TILE x key entries) in the pairwise statistics
TILE = 128  # the pairwise statistics' tiles of the sorted (token, position) order

# The pairwise rules: for each earlier occurrence j' < p of the query's token (tok[j'] = tok[p]), the
# statistic counts key j = j' + shift (when 0 <= j <= p): duplicate j' itself, induction the key after
# it (tok[j - 1] = tok[p], TransformerLens's induction detection pattern).
PAIR_RULES = {"duplicate": 0, "induction": 1}

_IDX = {name: i for i, name in enumerate(STAT_NAMES)}
NAN = float("nan")
NEG_INF = float("-inf")


def unsupported(scoring: Scoring) -> str | None:
    """Why this route cannot give the statistics of a layer scoring as `scoring` exactly (None: it can)."""
    if scoring.softcap is not None:
        return ("soft-capped scores are not linear in k, so the entropy is not lse - scale * q . E[k]: the tiled "
                "kernels (backend='torch' or 'triton') compute them")
    if scoring.alibi_slopes is not None and not scoring.causal:
        return "ALiBi without causality (-slope * |p - j|) is not linear in j: the tiled kernels compute it"
    return None


# --------------------------------------------------------------------------------------------
# Entry point
# --------------------------------------------------------------------------------------------


@torch.no_grad()
def attention_stats_fused(q: Tensor, k: Tensor, scoring: Scoring | None = None, *, tokens: Tensor | None = None,
                          n_sink: int = 1, key_padding_mask: Tensor | None = None, stats=STAT_NAMES,
                          block_q: int | None = None, attend=None) -> Tensor:
    """Float32 ``[len(STAT_NAMES) + added, batch, heads, n_q]``: the built-in statistics, then the added
    separable ones named in `stats` (`kernels/src/stats/separable.py`); those not in `stats` are NaN (not
    computed).

    Arguments as :func:`interp.kernels.attention_stats`, validated by it (`scoring` checked). `block_q`: queries per fused call (None:
    :data:`CHUNK`, or smaller for ALiBi, windows and explicit masks). `attend`: the fused call (None: the
    device's, :func:`attend_for`)."""
    scoring = Scoring.of(scoring)
    why = unsupported(scoring)
    if why is not None:
        raise ValueError(f"backend='fused': {why}")
    wanted = set(stats)
    added = tuple(n for n in stats if n not in _IDX)
    qf, kf = q.float(), k.float()
    if scoring.window is not None and scoring.window >= k.shape[2]:  # p - j <= n_k - 1 < window: hides nothing
        scoring = replace(scoring, window=None)
    out, lse_keys, seen = _separable(qf, kf, scoring, tokens, n_sink, key_padding_mask, added, block_q,
                                     attend or attend_for(q.device))
    lse_all = lse_keys
    if scoring.sink_logits is not None:  # one more term in each row's denominator, no value
        lse_all = torch.logaddexp(lse_keys, scoring.sink_logits[None, :, None])
        r = torch.exp(lse_keys - lse_all)  # the real keys' share of the row
        for i in [_IDX["sink"], _IDX["distance"], *range(len(STAT_NAMES), len(out))]:
            out[i] *= r
        out[_IDX["entropy"]] = r * (out[_IDX["entropy"]] - torch.log(r))
    if "max" in wanted:
        tiles = CUDA_MAX_TILES if q.device.type == "cuda" else MAX_TILES
        out[_IDX["max"]] = torch.exp(_row_max(qf, kf, scoring, key_padding_mask, tiles) - lse_all)
    if "previous" in wanted or (tokens is not None and wanted & {"duplicate", "induction"}):
        masses = pairwise_masses(qf, kf, tokens if wanted & {"duplicate", "induction"} else None, lse_all, scoring,
                                 key_padding_mask=key_padding_mask)
        for name, value in masses.items():
            out[_IDX[name]] = value
    batch, heads, n_q = lse_keys.shape
    out[:, ~seen[:, None, :].expand(batch, heads, n_q)] = NAN  # no visible key: NaN everywhere
    for name in STAT_NAMES:
        if name not in wanted or (tokens is None and name in ("duplicate", "induction")):
            out[_IDX[name]] = NAN
    for i, name in enumerate(added):
        if tokens is None and SEPARABLE[name].needs_tokens:
            out[len(STAT_NAMES) + i] = NAN
    return out


def _row_max(qf, kf, scoring: Scoring, key_padding_mask, tiles) -> Tensor:
    """max_j of the model's scores over the keys each query sees, float32 [batch, heads, n_q] (-inf: none):
    the tiles' masked scores, a pass of ``q k^T`` (which no fused kernel torch has returns)."""
    block_q, block_k = tiles
    cap = 1 << (27 if qf.device.type == "cuda" else 22)  # floats in one tile of scores
    while block_q > 16 and qf.shape[0] * qf.shape[1] * block_q * block_k > cap:
        block_q //= 2
    return ScoreTiles(qf, kf, scoring, key_padding_mask, block_q, block_k).row_max()


def _separable(qf, kf, scoring: Scoring, tokens, n_sink, kpm, added, block_q, attend):
    """The separable statistics (sink, distance, entropy, the `added` ones) from the fused calls on the
    values ``[K | position | sink | added columns]``: (out [stats, batch, heads, n_q] with those rows
    filled, each row's logsumexp over the real keys [batch, heads, n_q], whether each query saw a key
    [batch, n_q])."""
    batch, heads, n_q, d = qf.shape
    kv_heads, n_k = kf.shape[1], kf.shape[2]
    offset, device, scale = n_k - n_q, qf.device, scoring.scale
    real_before = None if kpm is None else F.pad(kpm.long().cumsum(1), (1, 0))  # [batch, n_k + 1]
    slopes = scoring.alibi_slopes
    out = torch.full((len(STAT_NAMES) + len(added), batch, heads, n_q), NAN, device=device)
    lse_keys = torch.empty(batch, heads, n_q, device=device)  # over the real keys, true scores
    seen = torch.empty(batch, n_q, dtype=torch.bool, device=device)
    width = (d + 2 + len(added) + 7) // 8 * 8
    col_pos, col_sink, col_added = d, d + 1, d + 2

    blocks = _blocks(n_q, n_k, scoring.causal, scoring.window, slopes is not None, kpm is not None, batch, block_q)
    for qs, qe, regions in blocks:
        c0, c1 = offset + qs, offset + qe  # absolute positions [c0, c1)
        pos = torch.arange(c0, c1, device=device)
        qx = qf.new_zeros(batch, heads, qe - qs, width)
        qx[..., :d] = qf[:, :, qs:qe]
        if slopes is not None:
            qx[..., col_pos] = (slopes / scale)[None, :, None]
        o = lse = None
        any_seen = torch.zeros(batch, qe - qs, dtype=torch.bool, device=device)
        for a, b, kind in regions:
            kx = kf.new_zeros(batch, kv_heads, b - a, width)
            kx[..., :d] = kf[:, :, a:b]
            j = torch.arange(a, b, device=device)
            kx[..., col_pos] = (j - c0).float()
            kx[..., col_sink] = (j < n_sink).float()
            if added:
                # a column without its tokens is NaN: 0 in the call (a NaN value would reach every column), NaN after
                kx[..., col_added:col_added + len(added)] = columns(added, j, tokens, batch).nan_to_num(0.0).permute(
                    1, 2, 0)[:, None]
            mask, is_causal = _region_mask(kind, pos, j, scoring.causal, scoring.window, kpm, a, b)
            o_r, lse_r = attend(qx, kx, mask, is_causal, scale)
            sees = _sees(pos, a, b, scoring.causal, scoring.window, real_before)  # [batch or 1, bq]
            any_seen |= sees
            if not bool(sees.all()):  # rows with no key here: the CPU kernel says lse 0, CUDA's may say NaN
                lse_r = lse_r.masked_fill(~sees[:, None], NEG_INF)
                o_r = o_r.masked_fill(~sees[:, None, :, None], 0.0)
            o, lse = _merge(o, lse, o_r, lse_r)
        blk = out[..., qs:qe]
        blk[_IDX["sink"]] = o[..., col_sink]
        blk[_IDX["distance"]] = (pos - c0).float() - o[..., col_pos]
        blk[_IDX["entropy"]] = lse - scale * (qx * o).sum(-1)  # lse - E[score]; ALiBi's row constant cancels
        blk[len(STAT_NAMES):] = o[..., col_added:col_added + len(added)].permute(3, 0, 1, 2)
        if slopes is not None:
            lse = lse - slopes[None, :, None] * (pos - c0).float()  # back to the model's scores
        lse_keys[..., qs:qe] = lse
        seen[:, qs:qe] = any_seen
    return out, lse_keys, seen


# --------------------------------------------------------------------------------------------
# Blocks of queries and the key regions each one reads
# --------------------------------------------------------------------------------------------


def _blocks(n_q, n_k, causal, window, alibi, padded, batch, block_q):
    """Yield (qs, qe, [(a, b, kind), ...]): query indices [qs, qe) and the key ranges [a, b) their fused
    calls read. kind "full": every query of the block sees every key (only padding can hide one);
    "square": keys = the block's own positions, causal; "band": an explicit mask."""
    offset = n_k - n_q
    if block_q is None:
        block_q = ALIBI_CHUNK if alibi else CHUNK
        if window is not None:
            block_q = min(block_q, max(WINDOW_CHUNK_MIN, window // 2))
    for qs in range(0, n_q, block_q):
        qe = min(qs + block_q, n_q)
        c0, c1 = offset + qs, offset + qe
        if window is None:
            if not causal:
                yield qs, qe, [(0, n_k, "full")]
                continue
            regions = [(0, c0, "full")] if c0 > 0 else []
            if padded:  # the square needs a mask anyway; keep it within the budget
                step = max(1, min(c1 - c0, MASK_BUDGET // max(1, batch * (c1 - c0))))
                if step < c1 - c0:  # split the block itself (rare: huge batch x block)
                    yield from _split_causal(qs, qe, offset, step)
                    continue
            yield qs, qe, regions + [(c0, c1, "square")]
            continue
        lo = max(0, c0 - window + 1)
        hi = c1 if causal else n_k
        rows = max(1, MASK_BUDGET // max(1, (batch if padded else 1) * (hi - lo)))
        if rows < qe - qs:  # a wide non-causal band: fewer queries per call
            for s in range(qs, qe, rows):
                e = min(s + rows, qe)
                yield s, e, [(max(0, offset + s - window + 1), (offset + e) if causal else n_k, "band")]
            continue
        yield qs, qe, [(lo, hi, "band")]


def _split_causal(qs, qe, offset, step):
    for s in range(qs, qe, step):
        e = min(s + step, qe)
        c0 = offset + s
        yield s, e, ([(0, c0, "full")] if c0 > 0 else []) + [(c0, offset + e, "square")]


def _region_mask(kind, pos, j, causal, window, kpm, a, b):
    """(float 0 / -inf mask broadcastable to [batch, 1, n_queries, n_keys] or None, is_causal)."""
    pad = None if kpm is None else kpm[:, None, None, a:b]  # [batch, 1, 1, keys]
    if kind == "full":
        return (None if pad is None else _additive(pad)), False
    if kind == "square" and pad is None:
        return None, True
    ok = visible(pos[:, None] - j[None, :], causal=causal, window=window)[None, None]
    if pad is not None:
        ok = ok & pad
    return _additive(ok), False


def _additive(ok: Tensor) -> Tensor:
    return torch.zeros(ok.shape, dtype=torch.float32, device=ok.device).masked_fill_(~ok, NEG_INF)


def _sees(pos, a, b, causal, window, real_before):
    """bool [batch or 1, queries]: does the query at `pos` see any real key in [a, b)?"""
    lo = torch.full_like(pos, a) if window is None else (pos - window + 1).clamp(min=a)
    hi = (pos + 1).clamp(max=b) if causal else torch.full_like(pos, b)
    hi = torch.maximum(hi, lo)
    if real_before is None:
        return (hi > lo)[None]
    return (real_before[:, hi] - real_before[:, lo]) > 0


def _merge(o, lse, o2, lse2):
    """Two partial softmax results over disjoint keys -> the one over both (rows with -inf have no keys)."""
    if o is None:
        return o2, lse2
    new = torch.logaddexp(lse, lse2)
    w1 = torch.exp(lse - new).nan_to_num_(0.0)
    w2 = torch.exp(lse2 - new).nan_to_num_(0.0)
    return o * w1[..., None] + o2 * w2[..., None], new


# --------------------------------------------------------------------------------------------
# The fused call, per device: (q [batch, heads, L, W], kv [batch, kv_heads, S, W], mask, is_causal, scale)
#   -> (out [batch, heads, L, W] = softmax(scale q kv^T + mask) kv, lse [batch, heads, L]), float32
# --------------------------------------------------------------------------------------------


def attend_for(device: torch.device):
    """The fused call for tensors on `device`."""
    kind = torch.device(device).type
    if kind == "cpu":
        return _attend_cpu
    if kind == "cuda":
        return _attend_cuda
    return attend_math


def _attend_cpu(qx, kx, mask, is_causal, scale):
    batch, heads, L, W = qx.shape
    kv_heads, S = kx.shape[1], kx.shape[2]
    group = heads // kv_heads
    op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    if mask is None or mask.shape[0] == 1 or mask.shape[2] == 1:
        # GQA without copying the keys: each kv head with its group of query heads as a "batch" entry.
        q4 = qx.reshape(batch * kv_heads, group, L, W)
        k4 = kx.reshape(batch * kv_heads, 1, S, W).expand(batch * kv_heads, group, S, W)
        m4 = None
        if mask is not None:
            m4 = mask if mask.shape[0] == 1 else mask[:, None].expand(batch, kv_heads, *mask.shape[1:]).reshape(
                batch * kv_heads, *mask.shape[1:])
        o, lse = op(q4, k4, k4, is_causal=is_causal, attn_mask=m4, scale=scale)
        return o.reshape(batch, heads, L, W), lse.reshape(batch, heads, L)
    k4 = kx[:, :, None].expand(batch, kv_heads, group, S, W).reshape(batch, heads, S, W)
    return op(qx, k4, k4, is_causal=is_causal, attn_mask=mask, scale=scale)


def _attend_cuda(qx, kx, mask, is_causal, scale):
    """The memory-efficient kernel (the one of torch's CUDA kernels that takes float32 and returns the
    logsumexp); its bias wants a last dimension aligned to 16 elements, so it is cut from a wider buffer
    (as SDPA's own wrapper does), and its logsumexp comes padded to a multiple of 32 queries. A GPU where
    that kernel refuses the call gets the same call in torch ops (said once, as a warning)."""
    global _CUDA_KERNEL_FAILED
    if _CUDA_KERNEL_FAILED:
        return attend_math(qx, kx, mask, is_causal, scale)
    try:
        return _attend_efficient(qx, kx, mask, is_causal, scale)
    except RuntimeError as error:
        _CUDA_KERNEL_FAILED = True
        warnings.warn(f"attention_stats(backend='fused'): the memory-efficient CUDA kernel refused the call ({error}); "
                      "running its blocks in torch ops instead", RuntimeWarning, stacklevel=2)
        return attend_math(qx, kx, mask, is_causal, scale)


_CUDA_KERNEL_FAILED = False


def _attend_efficient(qx, kx, mask, is_causal, scale):
    batch, heads, L, W = qx.shape
    kv_heads, S = kx.shape[1], kx.shape[2]
    k4 = kx[:, :, None].expand(batch, kv_heads, heads // kv_heads, S, W).reshape(batch, heads, S, W)
    bias = None
    if mask is not None:
        padded = (S + 15) // 16 * 16
        buf = torch.empty(*mask.shape[:-1], padded, dtype=mask.dtype, device=mask.device)
        buf[..., :S] = mask
        bias = buf[..., :S].expand(batch, heads, L, S)
    o, lse = torch.ops.aten._scaled_dot_product_efficient_attention(
        qx.contiguous(), k4, k4, bias, True, 0.0, is_causal, scale=scale)[:2]
    return o, lse[..., :L]


def attend_math(qx, kx, mask, is_causal, scale, budget: int = 1 << 24):
    """The fused call in plain torch ops, a few queries at a time (devices without a fused kernel that
    returns the logsumexp; and the tests' check of the merging on the CPU)."""
    batch, heads, L, W = qx.shape
    kv_heads, S = kx.shape[1], kx.shape[2]
    group = heads // kv_heads
    o = qx.new_empty(batch, heads, L, W)
    lse = qx.new_empty(batch, heads, L)
    step = max(1, budget // max(1, batch * heads * S))
    for s in range(0, L, step):
        e = min(s + step, L)
        sc = torch.matmul(qx[:, :, s:e].reshape(batch, kv_heads, group * (e - s), W), kx.transpose(-1, -2))
        sc = sc.view(batch, heads, e - s, S) * scale
        if mask is not None:
            sc = sc + (mask if mask.shape[2] == 1 else mask[:, :, s:e])
        if is_causal:
            sc = sc.masked_fill(torch.arange(s, e, device=qx.device)[:, None] < torch.arange(S, device=qx.device), NEG_INF)
        lse[:, :, s:e] = torch.logsumexp(sc, -1)
        p = torch.softmax(sc, -1).nan_to_num_(0.0).view(batch, kv_heads, group * (e - s), S)
        o[:, :, s:e] = torch.matmul(p, kx).view(batch, heads, e - s, W)
    return o, lse


# --------------------------------------------------------------------------------------------
# Pairwise statistics: exp(s_ij - lse_i) at the pairs found by sorting the tokens
# --------------------------------------------------------------------------------------------
# The pairwise statistics (previous, duplicate, induction): ``exp(s_ij - lse_i)`` at exactly their pairs,
# found by sorting the tokens. Shared by the fused route and the Triton kernel, which give each row's
# logsumexp.
#
# Every pair has ``j <= p`` (the detection patterns are lower triangular), so causality never hides one;
# the window and the padding can. Duplicate keys of the query at p are the earlier occurrences j' of
# tok[p]; induction keys are j' + 1 for the same j' (``tok[j - 1] = tok[p]``, ``j - 1 < p``). A global sort
# of (batch, token, position) puts each query's j' in one run of the sorted order, from its token's first
# occurrence (or the window's edge, by binary search) up to the query itself. The sorted order is cut into
# tiles of TILE rows; a tile reads the contiguous sorted keys its rows' runs reach (its own entries and a
# few before for most tokens; more for a frequent token) in one dense ``q k^T`` product, masked to the
# pairs (same token, earlier position, window, padding). So the work is about pairs x heads x d on dense
# matrix products, never a per-pair gather, and the scores held at once are at most `budget` floats.


@torch.no_grad()
def pairwise_masses(qf: Tensor, kf: Tensor, tokens: Tensor | None, lse: Tensor, scoring: Scoring | None = None, *,
                    key_padding_mask: Tensor | None = None, budget: int = PAIR_BUDGET) -> dict[str, Tensor]:
    """``{"previous", and with tokens "duplicate", "induction": float32 [batch, heads, n_q]}``: the mass of
    each query's row (``P_ij = exp(s_ij - lse_i)``, `lse` the row's full logsumexp) on those pairs.

    `scoring` as the layer's (scale resolved). Scores are capped (``cap * tanh(s / cap)``) before ALiBi, as
    the model and the Triton kernel score them (the fused route never sees a capped layer)."""
    scoring = Scoring.of(scoring)
    out = {"previous": _previous(qf, kf, lse, scoring, key_padding_mask)}
    if tokens is None:
        return out
    sorted_ = _SortedTokens.of(tokens, qf.shape[2], scoring.window)
    for name, value in _token_masses(qf, kf, lse, scoring, key_padding_mask, sorted_, budget).items():
        out[name] = value
    return out


def _capped(s: Tensor, softcap: float | None) -> Tensor:
    return s if softcap is None else softcap * torch.tanh(s / softcap)


def _previous(qf, kf, lse, scoring: Scoring, key_padding_mask) -> Tensor:
    """The mass on key p - 1: visible unless p = 0, a window of 1, or padding."""
    batch, heads, n_q, d = qf.shape
    kv_heads, n_k = kf.shape[1], kf.shape[2]
    pos = torch.arange(n_k - n_q, n_k, device=qf.device)  # query positions
    j = (pos - 1).clamp(min=0)
    k_prev = kf[:, :, j]  # [batch, kv_heads, n_q, d]
    s = (qf.view(batch, kv_heads, heads // kv_heads, n_q, d) * k_prev[:, :, None]).sum(-1).view(batch, heads, n_q)
    s = _capped(s * scoring.scale, scoring.softcap)
    if scoring.alibi_slopes is not None:
        s = s - scoring.alibi_slopes[None, :, None]
    ok = (pos >= 1)[None].expand(batch, n_q)
    if scoring.window is not None and scoring.window < 2:
        ok = torch.zeros_like(ok)
    if key_padding_mask is not None:
        ok = ok & key_padding_mask[:, j]
    return torch.exp(s - lse) * ok[:, None]


@dataclass
class _SortedTokens:
    """The (batch, token, position) order of every key and, per tile of it, the first sorted entry any of
    its rows' runs reach."""

    order: Tensor  # sorted index -> flat b * n_k + j
    group_key: Tensor  # (batch, token) of each sorted entry
    spos: Tensor  # position of each sorted entry
    row_b: Tensor  # batch of each sorted entry
    lo: list[int]  # per tile: the first sorted key its rows read
    n_k: int
    offset: int  # position of query 0

    @classmethod
    def of(cls, tokens: Tensor, n_q: int, window: int | None) -> "_SortedTokens":
        batch, n_k = tokens.shape
        device = tokens.device
        tok = tokens.long()
        tok = tok - tok.min()
        vocab = int(tok.max()) + 1
        total = batch * n_k
        key = ((torch.arange(batch, device=device)[:, None] * vocab + tok) * n_k
               + torch.arange(n_k, device=device)).reshape(-1)  # unique per (batch, position)
        order = torch.argsort(key)
        sorted_key = key[order]
        group_key = sorted_key - order % n_k
        spos = order % n_k
        # the first sorted index any row's run may reach: its token's first occurrence, or the window's edge
        reach = max(PAIR_RULES.values())
        edge = (spos - window + 1 - reach).clamp(min=0) if window is not None else torch.zeros_like(spos)
        first = torch.searchsorted(sorted_key, group_key + edge)  # [total]
        n_tiles = (total + TILE - 1) // TILE
        # each tile of rows (queries) reads the sorted keys from the earliest run start among its rows up to its end
        lo = F.pad(first, (0, n_tiles * TILE - total), value=total).view(n_tiles, TILE).amin(1)
        lo = torch.minimum(lo, torch.arange(n_tiles, device=device) * TILE).tolist()
        return cls(order, group_key, spos, order // n_k, lo, n_k, n_k - n_q)


def _token_masses(qf, kf, lse, scoring: Scoring, key_padding_mask, st: _SortedTokens, budget) -> dict[str, Tensor]:
    """Duplicate and induction: tiles of the sorted order, each a dense product against the keys it reaches."""
    batch, heads, n_q, d = qf.shape
    kv_heads, n_k = kf.shape[1], kf.shape[2]
    total = batch * n_k
    # rows in sorted order: the query (if the position is one) and its lse; keys at j' + shift for each rule
    is_query = st.spos >= st.offset
    q_index = st.row_b * n_q + (st.spos - st.offset).clamp(min=0)
    q_rows = qf.permute(0, 2, 1, 3).reshape(batch * n_q, kv_heads, -1, d)[q_index] * is_query[:, None, None, None]
    q_rows = q_rows.permute(1, 2, 0, 3)  # [kv_head, group, entry, d]
    lse_rows = lse.permute(0, 2, 1).reshape(batch * n_q, heads)[q_index].t()  # [head, entry]
    keys = _rule_keys(kf, key_padding_mask, st)
    acc = {name: torch.zeros(heads, total, device=qf.device) for name in PAIR_RULES}
    slopes = None if scoring.alibi_slopes is None else scoring.alibi_slopes.view(heads, 1, 1)
    cols = max(TILE, budget // max(1, heads * TILE))  # key entries per product: at most `budget` scores
    for t, lo in enumerate(st.lo):
        r0, r1 = t * TILE, min(total, (t + 1) * TILE)
        q_t = q_rows[:, :, r0:r1].reshape(kv_heads, -1, d)
        p_row = st.spos[r0:r1, None]  # [rows, 1]
        for c0 in range(lo, r1, cols):
            c1 = min(c0 + cols, r1)
            same = (st.group_key[r0:r1, None] == st.group_key[None, c0:c1]) & is_query[r0:r1, None]
            same &= st.spos[None, c0:c1] < p_row  # j' < p: an earlier occurrence
            if not bool(same.any()):
                continue
            for name, (k_t, j_all, real_all) in keys.items():
                s = _capped(torch.matmul(q_t, k_t[:, :, c0:c1]).view(heads, r1 - r0, c1 - c0) * scoring.scale,
                            scoring.softcap)
                j = j_all[None, c0:c1]
                if slopes is not None:
                    s = s - slopes * (p_row - j).abs().to(s.dtype)
                ok = same & real_all[None, c0:c1] & (j <= p_row)
                if scoring.window is not None:
                    ok &= (p_row - j) < scoring.window
                acc[name][:, r0:r1] += torch.exp(s - lse_rows[:, r0:r1, None]).masked_fill_(~ok, 0.0).sum(-1)
    out = {}
    for name, value in acc.items():
        mass = torch.zeros(batch * n_q, heads, device=qf.device)
        mass.index_add_(0, q_index[is_query], value.t()[is_query])
        out[name] = mass.view(batch, n_q, heads).permute(0, 2, 1)
    return out


def _rule_keys(kf, key_padding_mask, st: _SortedTokens) -> dict[str, tuple[Tensor, Tensor, Tensor]]:
    """Per rule, the key each sorted entry j' stands for (j = j' + shift): its k [kv_head, d, entry], its
    position j [entry] and whether it is a real key [entry]."""
    batch, kv_heads, n_k, d = kf.shape
    k_flat = kf.permute(0, 2, 1, 3).reshape(batch * n_k, kv_heads, d)
    kpm_flat = None if key_padding_mask is None else key_padding_mask.reshape(-1)
    keys = {}
    for name, shift in PAIR_RULES.items():
        j = st.spos + shift
        inside = (j >= 0) & (j < n_k)
        at = st.order - st.spos + j.clamp(0, n_k - 1)  # flat b * n_k + j
        real = inside if kpm_flat is None else inside & kpm_flat[at]
        keys[name] = (k_flat[at].permute(1, 2, 0), j, real)
    return keys
