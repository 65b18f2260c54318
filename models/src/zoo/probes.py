"""Probes: the inputs and scores that head analyses and training share, defined once.

    repeated_random_tokens   a uniform random sequence repeated (Olsson et al. 2022's induction
                             probe), with an optional BOS in front
    icl_from_losses          Olsson et al.'s in-context-learning score from per-token losses

Training (its cheap per-checkpoint probes), the analyzers (`analyses.heads`) and the sweep's data
(`analyses.data`) all build theirs here.
"""

from __future__ import annotations

import torch
from torch import Tensor


def repeated_random_tokens(
    n_seq: int, length: int, high: int, *, low: int = 0, n_repeats: int = 2, seed: int = 0,
    bos: int | None = None, total: int | None = None,
) -> Tensor:
    """long [n_seq, (1 +) length * n_repeats]: r uniform in [low, high), repeated n_repeats times,
    after `bos` when given. An `r` equal to `bos` (possible when bos < high) is replaced by `low - 1`
    if low > 0 (callers pass low=1 to keep id 0 free for it) so the body never holds BOS.
    `total` trims the repeats to that many tokens (the sweep's fixed sequence length)."""
    if length < 1 or n_repeats < 2 or n_seq < 1:
        raise ValueError(f"need length >= 1, n_repeats >= 2, n_seq >= 1; got {length}, {n_repeats}, {n_seq}")
    if not 0 <= low < high:
        raise ValueError(f"need 0 <= low < high for the random tokens, got low={low}, high={high}")
    g = torch.Generator().manual_seed(seed)
    seq = torch.randint(low, high, (n_seq, length), generator=g)
    if bos is not None and low > 0:
        seq = torch.where(seq == bos, torch.full_like(seq, low - 1), seq)
    tokens = seq.repeat(1, n_repeats)
    if total is not None:
        tokens = tokens[:, :total].contiguous()
    if bos is not None:
        tokens = torch.cat([torch.full((n_seq, 1), bos), tokens], dim=1)
    return tokens


def icl_from_losses(nll: Tensor, early: int, late: int, rows: Tensor | None = None) -> dict:
    """Olsson et al. (2022)'s in-context-learning score from per-token losses.

    nll   [batch, pos - 1]: nll[:, t - 1] is the loss of predicting token t from tokens[:t]
          (`model(..., return_type="loss", loss_per_token=True)`).
    early, late: 0-based token positions, 1 <= early < late <= pos - 1. A `late` past the context
          is an error, never clipped: the score at another position is another number.
    rows  bool [batch]: the sequences to average over (default all).

    Returns loss_early, loss_late, icl (= loss_late - loss_early; NEGATIVE means in-context
    learning: later tokens are predicted better), early, late and n_sequences."""
    n = nll.shape[1] + 1
    if not 1 <= early < late <= n - 1:
        raise ValueError(
            f"the ICL score needs 1 <= early < late <= {n - 1} (the last position of a {n}-token context); "
            f"got early={early}, late={late}: use longer sequences or a smaller late (e.g. late={n - 1})"
        )
    if rows is None:
        rows = torch.ones(nll.shape[0], dtype=torch.bool, device=nll.device)
    if not bool(rows.any()):
        raise ValueError("no sequence has real tokens at both `early` and `late`")
    lo, hi = float(nll[rows, early - 1].mean()), float(nll[rows, late - 1].mean())
    return {"loss_early": lo, "loss_late": hi, "icl": hi - lo, "early": early, "late": late,
            "n_sequences": int(rows.sum())}
