"""The tiled torch kernel, ``attention_stats(backend="torch")``, and the tiles of masked scores it shares
with the fused route's row-max pass.

A flash-style loop carries every statistic as a feature of the (query, key) pair through the online
softmax (Dao et al. 2022; triton-lang/triton ``python/tutorials/06-fused-attention.py``): keep the running
row max ``m_i`` and normaliser ``l_i``; for every key block, rescale all accumulators by
``alpha = exp(m_old - m_new)``, add ``sum_j exp(s_ij - m_new) * feature_ij``; ``accumulator / l_i`` at the
end. Any device, every geometry (soft-capping included); the fused route's exact cross-check, and its
fallback.

Scores are kept in base 2 (``log2(e)`` folded into the scale, ``exp2`` instead of ``exp``, as the Triton
tutorial does): exp2 is ~1.6x faster than exp on CPU and exp dominates a tile.
"""

from __future__ import annotations

from typing import Iterator, NamedTuple

import torch
from torch import Tensor

from ..visibility import visible
from .common import LN2, LOG2E, STAT_NAMES
from .scoring import Scoring
from .separable import columns

__all__ = ["ScoreTiles", "attention_stats_tiles", "torch_blocks"]

# Torch: a tile is [batch, heads, block_q, block_k] float32 and ~4 are alive at once. 256 x 512
# keeps per-op overhead (Python, OpenMP fork/join) small next to the work: on 2 CPU cores it is
# ~1.2x faster than 128 x 256 when idle and several times faster when the cores are shared.
# For wide batch * heads, block_q halves until a tile holds at most TORCH_TILE_ELEMENTS.
TORCH_BLOCKS = (256, 512)
TORCH_TILE_ELEMENTS = 1 << 22  # 16 MiB of float32 per tile-sized temporary

# Rows of the running accumulator: the numerators of every statistic but `max` (which is 1/l), then the
# added separable statistics.
_SINK, _PREV, _DUP, _IND, _ENT, _DIST = range(6)
NEG_INF = float("-inf")


def torch_blocks(batch_heads: int) -> tuple[int, int]:
    """The tiles' default (block_q, block_k) for `batch_heads` (batch x heads) rows."""
    block_q, block_k = TORCH_BLOCKS
    while block_q > 16 and batch_heads * block_q * block_k > TORCH_TILE_ELEMENTS:
        block_q //= 2
    return block_q, block_k


class Tile(NamedTuple):
    """One tile of base-2 scores: keys [ks, ke) of the query block, ``-inf`` where a key is not seen."""

    ks: int
    ke: int
    s: Tensor  # [batch, heads, bq, bk]
    delta: Tensor  # [bq, bk] float32: p - j
    ok: Tensor | None  # bool, broadcastable to s; None where the tile cuts no mask edge


class ScoreTiles:
    """The masked scores ``log2(e) * score(p, j)`` (`Scoring`'s, soft cap and ALiBi included) a tile at a
    time: for each block of queries, the key blocks it can see (``[lo, hi)`` from the causal and window
    masks; blocks that are all padding in every sequence are skipped). Masks are only built for tiles that
    cut through them."""

    def __init__(self, q: Tensor, k: Tensor, scoring: Scoring, key_padding_mask: Tensor | None,
                 block_q: int, block_k: int) -> None:
        self.batch, self.heads, self.n_q, d = q.shape
        self.kv_heads, self.n_k = k.shape[1], k.shape[2]
        self.group = self.heads // self.kv_heads
        self.offset = self.n_k - self.n_q  # absolute position of query 0
        self.scoring, self.kpm = scoring, key_padding_mask
        self.block_q, self.block_k = block_q, block_k
        device = q.device
        # Scale (and log2 e) folded into q once; [batch, kv_heads, group, n_q, d] so that one matmul per
        # tile serves a whole GQA group without repeating k.
        self.qf = (q.float() * (scoring.scale * LOG2E)).reshape(self.batch, self.kv_heads, self.group, self.n_q, d)
        self.k_t = k.float().transpose(-1, -2)  # [batch, kv_heads, d, n_k]
        slopes = scoring.alibi_slopes
        self.slopes = None if slopes is None else (slopes * LOG2E).view(1, self.heads, 1, 1)
        # real_before[j]: number of real (batch, key) entries before key j -> O(1) block checks.
        self.real_before = None if key_padding_mask is None else [0] + key_padding_mask.sum(0).cumsum(0).tolist()
        # p - j for a tile is rel + (p0 - ks): small integers, exact in float32 below 2^24.
        self.rel = (torch.arange(block_q, device=device)[:, None] - torch.arange(block_k, device=device)).float()

    def query_blocks(self) -> Iterator[tuple[int, int]]:
        for qs in range(0, self.n_q, self.block_q):
            yield qs, min(qs + self.block_q, self.n_q)

    def tiles(self, qs: int, qe: int) -> Iterator[Tile]:
        """The tiles of queries [qs, qe) against every key block they can see."""
        window, causal = self.scoring.window, self.scoring.causal
        batch, heads, bq = self.batch, self.heads, qe - qs
        p0, p1 = self.offset + qs, self.offset + qe - 1  # absolute positions of the block's first/last query
        q_blk = self.qf[:, :, :, qs:qe].reshape(batch, self.kv_heads, self.group * bq, -1)
        lo = 0 if window is None else max(0, p0 - window + 1)
        hi = p1 + 1 if causal else self.n_k
        for ks in range(lo, hi, self.block_k):
            ke = min(ks + self.block_k, hi)
            bk = ke - ks
            pad_cut = False
            if self.real_before is not None:
                n_real = self.real_before[ke] - self.real_before[ks]
                if n_real == 0:
                    continue  # all padding in every sequence: contributes nothing
                pad_cut = n_real < batch * bk
            causal_cut = causal and ke - 1 > p0  # some query in the block sees only part of it
            window_cut = window is not None and p1 - ks >= window

            s = torch.matmul(q_blk, self.k_t[..., ks:ke]).view(batch, heads, bq, bk)
            if self.scoring.softcap is not None:  # cap * tanh(score / cap), the score in nats, kept in base 2
                cap = self.scoring.softcap * LOG2E
                s = torch.tanh(s.mul_(1.0 / cap)).mul_(cap)
            delta = self.rel[:bq, :bk] + float(p0 - ks)  # [bq, bk] p - j
            if self.slopes is not None:
                s.addcmul_(self.slopes, delta.abs(), value=-1.0)  # ALiBi: -slope * |p - j|, as the model

            ok = None  # only tiles that straddle a mask edge pay for one
            if causal_cut or window_cut:
                ok = visible(delta, causal=causal_cut, window=window if window_cut else None)  # the one rule
            if pad_cut:
                real = self.kpm[:, None, None, ks:ke]  # [batch, 1, 1, bk]
                ok = real if ok is None else ok & real
            if ok is not None:
                s.masked_fill_(~ok, NEG_INF)
            yield Tile(ks, ke, s, delta, ok)

    def row_max(self) -> Tensor:
        """max_j of the scores (natural base) over the keys each query sees, float32 [batch, heads, n_q]
        (-inf: none)."""
        out = torch.full((self.batch, self.heads, self.n_q), NEG_INF, device=self.qf.device)
        for qs, qe in self.query_blocks():
            m = out[..., qs:qe]
            for tile in self.tiles(qs, qe):
                torch.maximum(m, tile.s.amax(-1), out=m)
        return out * LN2


@torch.no_grad()
def attention_stats_tiles(q: Tensor, k: Tensor, scoring: Scoring, *, tokens: Tensor | None, n_sink: int,
                          key_padding_mask: Tensor | None, block_q: int, block_k: int,
                          added: tuple[str, ...] = ()) -> Tensor:
    """Tiled streaming statistics; returns ``[len(STAT_NAMES) + len(added), batch, heads, n_q]`` float32.

    Arguments as :func:`interp.kernels.attention_stats`, validated by it (`scoring` checked). Per query row
    the loop keeps ``m`` (running max score), ``l`` (``sum exp(s - m)``) and ``acc[f]``
    (``sum exp(s - m) * feature_f``).

    Learned sink logits (gpt-oss) add one term, exp2(sink - m), to each row's normaliser at the end, and
    no feature: the statistics are those of the pattern over the real keys, whose rows then sum to less
    than 1 (as the model's hook_pattern shows it)."""
    grid = ScoreTiles(q, k, scoring, key_padding_mask, block_q, block_k)
    batch, heads, n_q = grid.batch, grid.heads, grid.n_q
    out = torch.full((len(STAT_NAMES) + len(added), batch, heads, n_q), float("nan"), dtype=torch.float32,
                     device=q.device)
    for qs, qe in grid.query_blocks():
        m, l, acc = _accumulate(grid, qs, qe, tokens, n_sink, added)
        _finish(out[..., qs:qe], m, l, acc, scoring.sink_logits, tokens is not None)
    return out


def _accumulate(grid: ScoreTiles, qs: int, qe: int, tokens: Tensor | None, n_sink: int, added):
    """The online softmax of one query block over its tiles: (m, l, acc [6 + len(added), batch, heads, bq])."""
    batch, heads, bq, device = grid.batch, grid.heads, qe - qs, grid.qf.device
    p0, p1 = grid.offset + qs, grid.offset + qe - 1
    m = torch.full((batch, heads, bq), NEG_INF, device=device)  # running max
    l = torch.zeros((batch, heads, bq), device=device)  # sum exp2(s - m)
    acc = torch.zeros((6 + len(added), batch, heads, bq), device=device)  # feature numerators
    for ks, ke, s, delta, ok in grid.tiles(qs, qe):
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
            in_blk = (col >= 0) & (col < ke - ks)
            idx = col.clamp(0, ke - ks - 1).view(1, 1, bq, 1).expand(batch, heads, bq, 1)
            acc[_PREV] += p.gather(-1, idx).squeeze(-1) * in_blk
        if tokens is not None:
            _token_pairs(acc, p, tokens, p0, p1, ks, ke, delta)
        if added:
            feature = columns(added, torch.arange(ks, ke, device=device), tokens, batch)  # [added, batch, bk]
            acc[6:] += torch.linalg.vecdot(p[None], feature[:, :, None, None, :])
        l = l * alpha + p.sum(-1)
        m = m_new
    return m, l, acc


def _token_pairs(acc: Tensor, p: Tensor, tokens: Tensor, p0: int, p1: int, ks: int, ke: int, delta: Tensor) -> None:
    """Add one tile's duplicate and induction masses (``tok[j] == tok[p]``, ``tok[j - 1] == tok[p]``)."""
    tok_q = tokens[:, p0 : p1 + 1, None]  # [batch, bq, 1]
    same = tok_q == tokens[:, None, ks:ke]  # [batch, bq, bk] tok[j] == tok[p]
    after = tok_q == tokens[:, None, max(ks - 1, 0) : ke - 1]  # tok[j - 1] == tok[p]
    if ks == 0:  # key 0 has no predecessor
        after = torch.cat([torch.zeros_like(same[..., :1]), after], dim=-1)
    if ke - 1 >= p0:  # not every key strictly before every query
        same &= delta > 0  # strictly earlier keys
        after &= delta >= 0  # j - 1 < p
    # float masks: p * float is ~2x faster than p * bool on CPU
    acc[_DUP] += torch.linalg.vecdot(p, same.float()[:, None])
    acc[_IND] += torch.linalg.vecdot(p, after.float()[:, None])


def _finish(blk: Tensor, m: Tensor, l: Tensor, acc: Tensor, sink_logits: Tensor | None, with_tokens: bool) -> None:
    """One query block's statistics from its accumulators, written into `blk` [stats, batch, heads, bq]."""
    seen = l > 0  # False: the query saw no key -> NaN everywhere
    if sink_logits is None:
        inv_l = torch.where(seen, 1.0 / l, float("nan"))
        entropy = torch.log(l) - acc[_ENT] * inv_l * LN2  # ln l - E[s - m], s back in nats
    else:  # normaliser l + exp2(sink - m), rescaled to the larger of m and the sink
        sink2 = (sink_logits * LOG2E).view(1, -1, 1)  # base 2, like the scores
        top = torch.maximum(m, sink2)
        shrink = torch.exp2(m - top)
        inv_l = torch.where(seen, shrink / (l * shrink + torch.exp2(sink2 - top)), float("nan"))
        # -sum_j P_j ln P_j with ln P_j = ln 2 (s_j - m) + ln inv_l and sum_j P_j = l * inv_l
        entropy = -torch.log(inv_l) * l * inv_l - acc[_ENT] * inv_l * LN2
    blk[0] = acc[_SINK] * inv_l
    blk[1] = acc[_PREV] * inv_l
    if with_tokens:
        blk[2] = acc[_DUP] * inv_l
        blk[3] = acc[_IND] * inv_l
    blk[4] = entropy
    blk[5] = inv_l  # the top weight is exp2(m - m) / l (/ the sink's normaliser)
    blk[6] = acc[_DIST] * inv_l
    blk[7:] = acc[6:] * inv_l
