"""Greedy choices compared across two computations that round differently (issue 36).

Two computations of the same logits (a cached decode and a full forward, padded and alone, ours and
transformers', a window cache and a masked full cache) agree to float round-off, and which way that
round-off goes depends on the CPU's kernels (vector width, AMX, thread count). An argmax of them is the
same wherever the reference's best logit leads the second by more than round-off; at a near-tie either
tied token is right, and from there on the two continue from different contexts, so nothing after it
is comparable. `assert_greedy_agrees` asserts exactly that: what holds on any CPU. It never passes
vacuously: the first choice of every row must be clear (a test whose reference starts at a tie is
asking a question round-off decides; pick another prompt)."""

from __future__ import annotations

import torch

TIE = 1e-4  # logits within this of the best are a tie: far above float32 round-off at these scales


def assert_greedy_agrees(got: torch.Tensor, want: torch.Tensor, scores: torch.Tensor, start: int,
                         tie: float = TIE) -> None:
    """got, want: [batch, T] token ids with the same prompt [:, :start]; scores: [batch, steps, vocab] the
    logits `want[:, start + i]` was chosen from at step i (its argmax). Per row: `got` equals `want` at every
    step whose choice is clear, and at the first near-tie holds one of the tied tokens (then stops)."""
    assert got.shape[0] == want.shape[0] == scores.shape[0]
    assert torch.equal(got[:, :start], want[:, :start])
    steps = min(got.shape[1], want.shape[1]) - start
    assert steps >= 1 and scores.shape[1] >= steps
    for row in range(want.shape[0]):
        for i in range(steps):
            s = scores[row, i].double()
            best = s.max()
            tied = (s >= best - tie).nonzero().flatten().tolist()
            assert int(want[row, start + i]) in tied, "want is not the argmax of its scores"
            if len(tied) > 1:
                assert i > 0, f"row {row}: the first choice is already a near-tie {tied}; use another prompt"
                assert int(got[row, start + i]) in tied, (row, i, int(got[row, start + i]), tied)
                break
            assert int(got[row, start + i]) == int(want[row, start + i]), (row, i)


@torch.no_grad()
def argmax_loop(model, prompt: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy decoding by full forwards, no cache: (tokens [batch, T + n], the logits of each step
    [batch, n, vocab])."""
    seq, scores = prompt, []
    for _ in range(n):
        logits = model(seq)[:, -1]
        scores.append(logits)
        seq = torch.cat([seq, logits.argmax(-1, keepdim=True)], dim=1)
    return seq, torch.stack(scores, dim=1)


def assert_argmax_agrees(got: torch.Tensor, want: torch.Tensor, tie: float = TIE) -> None:
    """Logits [..., vocab] of two computations: the argmax agrees at every position whose best logit (in
    `want`) is clear of the second by more than `tie`; at a near-tie `got`'s argmax is one of the tied."""
    got, want = got.reshape(-1, got.shape[-1]).double(), want.reshape(-1, want.shape[-1]).double()
    best = want.max(-1, keepdim=True).values
    tied = want >= best - tie
    picked = got.argmax(-1)
    assert bool(tied.gather(-1, picked[:, None]).all()), "an argmax left the reference's (near-)best tokens"
    clear = tied.sum(-1) == 1
    assert bool(clear.float().mean() > 0.9)  # mostly clear choices: not a vacuous check
    assert torch.equal(picked[clear], want.argmax(-1)[clear])
