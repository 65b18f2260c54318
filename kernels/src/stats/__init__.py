"""Exact per-head attention statistics in O(n) memory, never the pattern: the package, and its entry point.

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

Every route takes the layer's :class:`Scoring` (scale, window, ALiBi slopes, soft cap, learned sink logits,
causality: :mod:`interp.kernels.stats.scoring`; ``attn.scoring`` of a model's layer), and shares the
names, constants, validation and result type of :mod:`interp.kernels.stats.common`:

* ``backend="fused"`` (:mod:`interp.kernels.stats.fused`): the separable statistics (sink, distance,
  entropy) from ONE call of torch's fused attention kernel per block of queries on the values
  ``[K | position | sink]`` and its logsumexp, the pairwise ones (previous, duplicate, induction) as
  ``exp(s_ij - lse_i)`` at the few pairs found by sorting the tokens, the max from a row-max pass.
  About the cost of an attention forward without ``max`` (BENCHMARKS.md); ``"auto"`` runs it off CUDA
  when ``max`` is not asked for (:func:`resolve_backend`). Not for soft-capped scores or non-causal
  ALiBi (:func:`interp.kernels.stats.fused.unsupported`).
* ``backend="torch"`` (:mod:`interp.kernels.stats.tiles`): a tiled flash-style loop that carries every
  statistic as an indicator feature of the (query, key) pair through the online softmax (Dao et al. 2022; triton-lang/triton
  ``python/tutorials/06-fused-attention.py``): keep the running row max ``m_i`` and normaliser ``l_i``;
  for every key block, rescale all accumulators by ``alpha = exp(m_old - m_new)``, add
  ``sum_j exp(s_ij - m_new) * feature_ij``; ``accumulator / l_i`` at the end. Any device, every
  geometry (soft-capping included); the fused route's exact cross-check, and its fallback.
* ``backend="triton"`` (:mod:`interp.kernels.stats.triton_kernel`): the tiled loop as one GPU kernel;
  imported lazily, so machines without Triton still import :mod:`interp.kernels`.

All compute in float32 whatever the input dtype, and match statistics computed from a
materialised float64 pattern (`kernels/src/stats/reference.py`) to float32 round-off
(`tests/kernels/test_attention_stats.py`). A new separable statistic is one file
(`kernels/src/stats/separable.py`: a name and its key column, registered; `tests/kernels/test_stat_plugin.py`).

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
"""

from __future__ import annotations

import importlib.util
import os
from typing import Literal

import torch
from torch import Tensor

from .common import STAT_NAMES, AttentionStats, validate
from .fused import attention_stats_fused, unsupported
from .scoring import Scoring
from .separable import Separable, added, check_stats, register
from .tiles import attention_stats_tiles, torch_blocks

__all__ = ["AttentionStats", "STAT_NAMES", "Scoring", "Separable", "attention_stats", "register", "resolve_backend"]

Backend = Literal["fused", "torch", "triton", "auto"]
BACKENDS = ("fused", "torch", "triton", "auto")


def attention_stats(
    q: Tensor,
    k: Tensor,
    tokens: Tensor | None = None,
    scoring: Scoring | None = None,
    *,
    n_sink: int = 1,
    key_padding_mask: Tensor | None = None,
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
        scoring: the layer's :class:`Scoring` (``model.blocks[l].attn.scoring``): the scale (default
            ``1 / sqrt(d)``), sliding window, ALiBi slopes ``[heads]`` (``-slope[h] * |p - j|``), soft cap
            (``softcap * tanh(scores / softcap)`` before ALiBi and the mask), learned sink logits ``[heads]``
            (gpt-oss: each joins its head's denominator and is no key, so the rows sum to less than 1; not
            in ``"triton"``) and causality. None: causal, nothing else.
        n_sink: the first ``n_sink`` keys count as the attention sink (``>= 0``).
        key_padding_mask: bool ``[batch, n_k]``, True for a real token; None for all real.
        backend: ``"auto"`` (the default: the fused route off CUDA for statistics without ``max``, the
            device's tiled kernel otherwise, as measured; :func:`resolve_backend` says which and why),
            ``"fused"`` (torch's fused attention kernel plus gathers, :mod:`interp.kernels.stats.fused`;
            any device, not for a soft cap or non-causal ALiBi), ``"torch"`` (tiled, any device, every
            geometry), or ``"triton"`` (CUDA tensors, or CPU tensors with ``TRITON_INTERPRET=1`` set before
            the first Triton call).
        stats: the statistics wanted (names from :data:`STAT_NAMES`, or added separable ones); None for
            all. The fused route skips the work of the others and leaves them NaN: ``max`` alone costs a
            pass of ``q k^T`` tiles, the pairwise ones a sort and a gather. The tiled kernels compute all.
        block_q, block_k: block sizes; None picks the backend's default (fused: 2,048 queries per
            call, fewer with ALiBi, a window or a large mask; torch 256 x 512, with block_q shrunk for
            large ``batch * heads``; Triton 64 x 32, or 64 x 16 for float32 with ``d > 64``: no
            register spills on sm_80 / sm_90). Triton needs powers of two >= 16.

    Returns:
        :class:`AttentionStats`, float32 ``[batch, heads, n_q]`` per statistic, on q's device.

    Positions and masks: queries are the *last* ``n_q`` keys, the causal diagonal at the bottom right (the
    module docstring draws it). A query with no visible key (e.g. a left-padding position, which under a
    causal mask sees only padding) gets NaN in every statistic; so does ``duplicate``/``induction`` when
    ``tokens`` is None.

    Raises:
        ValueError / TypeError: on malformed inputs (messages name the offending shapes).
        ImportError: ``backend="triton"`` without Triton installed.
    """
    scoring = Scoring.of(scoring)
    if scoring.sink_logits is not None and backend == "triton":
        raise ValueError("learned sink logits (gpt-oss) are in the fused route and the torch statistics kernel only: "
                         "pass backend='auto', 'fused' or 'torch'")
    wanted = check_stats(stats)
    backend = resolve_backend(backend, q.device if isinstance(q, Tensor) else "cpu", causal=scoring.causal,
                              alibi=scoring.alibi_slopes is not None, softcap=scoring.softcap is not None,
                              sink_logits=scoring.sink_logits is not None, stats=wanted)
    args = validate(q, k, tokens, scoring, n_sink=n_sink, key_padding_mask=key_padding_mask)
    stacked = _run_backend(backend, q, k, args, wanted, block_q, block_k)
    return AttentionStats.from_stacked(stacked, added(wanted))


def _run_backend(backend: str, q: Tensor, k: Tensor, args: dict, wanted, block_q: int | None,
                 block_k: int | None) -> Tensor:
    """The resolved `backend`'s stacked statistics (`AttentionStats.from_stacked`'s input) on validated `args`,
    after checking its block sizes (None: the backend's default)."""
    if backend == "fused":
        if block_q is not None and block_q < 1:
            raise ValueError(f"block_q must be positive, got {block_q}")
        return attention_stats_fused(q, k, stats=wanted, block_q=block_q, **args)
    if backend == "triton":
        # Imported here because it imports triton, an optional third-party package (GPU path).
        from .triton_kernel import attention_stats_triton

        return attention_stats_triton(q, k, block_q=block_q, block_k=block_k, **args)
    default_q, default_k = torch_blocks(q.shape[0] * q.shape[1])
    block_q, block_k = block_q or default_q, block_k or default_k
    if block_q < 1 or block_k < 1:
        raise ValueError(f"block sizes must be positive, got block_q={block_q}, block_k={block_k}")
    return attention_stats_tiles(q, k, block_q=block_q, block_k=block_k, added=added(wanted), **args)


def resolve_backend(backend: str = "auto", device: torch.device | str = "cpu", *, causal: bool = True,
                    alibi: bool = False, softcap: bool = False, sink_logits: bool = False, stats=None) -> str:
    """The statistics kernel that `backend` runs on tensors on `device`: ``"fused"``, ``"triton"`` or ``"torch"``.

    ``"auto"`` follows the measurements (BENCHMARKS.md, "Head statistics at the fused kernel's speed"):

    * the fused route (:mod:`interp.kernels.stats.fused`) off CUDA when `stats` leaves out ``max`` (the
      atlas's detectors and sinks): 0.9-1.3x the layer's SDPA forward on a CPU, where the tiles take
      0.7-1.6x; and it keeps that under load, where the tiles' many small parallel ops fall far behind;
    * the tiled kernel of the device otherwise: with ``max`` (all seven, the default) the tiles get the row
      maximum free while the fused route pays a pass of ``q k^T`` for it (1.3-2.0x against the tiles'
      0.7-1.6x on an idle CPU); on CUDA Triton when installed (its fused route runs torch's float32
      memory-efficient kernel, without tensor cores: `interp bench --sections gpu` compares them), and
      for the layers the fused route cannot compute exactly (soft-capped scores, ALiBi without causality:
      :func:`interp.kernels.stats.fused.unsupported`). Learned sink logits and added separable statistics
      are not in the Triton kernel: the torch tiles there.

    An explicit backend the machine or the layer cannot run is refused here, before any work, in one
    line naming what can: ``"triton"`` without Triton, or on a non-CUDA device (unless
    ``TRITON_INTERPRET=1``, Triton's CPU interpreter, for tests), or for added statistics; ``"fused"`` on
    such a layer."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; valid backends: {', '.join(map(repr, BACKENDS))}")
    device = torch.device(device)
    layer = Scoring(alibi_slopes=torch.empty(0) if alibi else None, softcap=1.0 if softcap else None, causal=causal)
    why = unsupported(layer)
    extra = added(STAT_NAMES if stats is None else stats)
    if backend == "auto":
        triton = device.type == "cuda" and _triton_available() and not sink_logits and not extra
        wants_max = stats is None or "max" in stats
        if why is None and device.type != "cuda" and not wants_max:
            return "fused"
        return "triton" if triton else "torch"
    if backend == "fused" and why is not None:
        raise ValueError(f"backend='fused': {why}; backend='auto' picks one that can")
    if backend == "triton":
        if extra:
            raise ValueError(f"backend='triton' computes the seven built-in statistics only, not {', '.join(extra)}: "
                             "pass backend='auto', 'fused' or 'torch'")
        if not _triton_available():
            raise ImportError("backend='triton' needs the `triton` package (pip install 'interp[triton]'); "
                              "backend='torch' runs anywhere")
        if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError(f"backend='triton' needs CUDA tensors (these are on {device}); use backend='auto' or "
                             "'torch' here, or set TRITON_INTERPRET=1 before the first Triton call to test it on the CPU")
    return backend


def _triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None
