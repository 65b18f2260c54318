"""A circuit task made of random tokens, shared by the circuit, QK-attribution and offload tests."""

from __future__ import annotations

import torch

from interp.analyses.circuits import Task
from interp.analyses.circuits.tasks import token_metric


def random_task(model, n: int = 3, p: int = 7, seed: int = 0) -> Task:
    """Random clean / corrupted tokens; the answer at the last two positions is a random token, the wrong
    one another."""
    g = torch.Generator().manual_seed(seed)
    V = model.cfg.d_vocab
    clean, corrupted = torch.randint(V, (n, p), generator=g), torch.randint(V, (n, p), generator=g)
    rows = torch.arange(n).repeat_interleave(2)
    positions = torch.tensor([p - 2, p - 1]).repeat(n)
    answers = torch.randint(V, (2 * n, 1), generator=g).tolist()
    wrongs = torch.randint(V, (2 * n, 1), generator=g).tolist()
    return Task("random", clean, corrupted, rows, positions, token_metric("logit-diff", answers, wrongs), "logit-diff")
