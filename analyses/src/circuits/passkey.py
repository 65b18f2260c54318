"""Passkey retrieval as a circuit task, at the lengths the KV studies read (1k-8k tokens): which heads and
edges carry a 5-digit key from the needle to the question at the end.

The prompts are the KV study's (`interp.analyses.kv.tasks.passkey_prompt`): instruction, filler, the needle
"The pass key is 48213. Remember it. 48213 is the pass key.", filler, "What is the pass key? The pass key
is". The clean prompt holds key A; the corrupted one is the same prompt with another key B, of the same
token length, whose first digit differs. Both run on to the token before the key's first digit (SmolLM2
writes the space before a number as its own token; a tokenizer that merges it, GPT-2's, stops at "is"), and
the answer there is the first token of A against the first token of B: logit difference by default.
"""

from __future__ import annotations

import random

from interp.analyses.kv.tasks import KEY_RANGE, passkey_prompt

from .graph import Task
from .tasks import _token_task, context


def passkey_task(model, length: int, n_prompts: int = 2, *, seed: int = 0, metric: str = "logit-diff") -> Task:
    """`n_prompts` clean/corrupted pairs of at most `length` tokens (the needle at depths drawn from `seed`); at most
    the model's context, or what the RoPE scaling it runs with gives (`tasks.context`)."""
    rng = random.Random(f"circuit-passkey:{seed}:{length}")
    clean_rows, corrupt_rows, answers, wrongs, texts = [], [], [], [], []
    for _ in range(n_prompts):
        depth = round(rng.uniform(0.1, 0.9), 2)
        for _attempt in range(20):
            a, b = (str(rng.randint(*KEY_RANGE)) for _ in range(2))
            if a[0] == b[0]:
                continue
            (ca, ans), (cb, wrong) = _running_on(model, length, depth, a), _running_on(model, length, depth, b)
            if len(ca) == len(cb) and ans != wrong:
                break
        else:
            raise ValueError(f"passkey: no two keys with prompts of equal token length at length {length}, depth "
                             f"{depth} (this tokenizer splits numbers unevenly); try another --seed")
        clean_rows.append(ca)
        corrupt_rows.append(cb)
        answers.append([ans])
        wrongs.append([wrong])
        texts.append(f"key {a} vs {b}, depth {depth}")
    use_wrong = metric in ("logit-diff", "prob-diff")
    spots = [[(-1, a, w if use_wrong else None)] for a, w in zip(answers, wrongs)]
    longest = max(len(r) for r in clean_rows)
    task = _token_task(model, "passkey", clean_rows, corrupt_rows, spots, metric,
                       f"passkey retrieval, {n_prompts} prompt(s) of up to {longest} tokens (asked: {length}), the "
                       "clean key against another of the same token length", [f"prompt {i + 1}" for i in range(n_prompts)])
    task.prompts = texts
    return task


def _running_on(model, length: int, depth: float, key: str) -> tuple[list[int], int]:
    """The prompt's tokens run on to just before the key's first digit, and that token."""
    longest = context(model.cfg)  # past n_ctx under a RoPE scaling that stretches it (--rope-scaling)
    p = passkey_prompt(model, length - 2, depth, key,  # room for the answer's lead-in
                       max_length=longest if longest > model.cfg.n_ctx else None)
    full = model.to_tokens(p.text + " " + key, truncate=False)[0].tolist()
    n = p.n_tokens
    if full[:n] != p.tokens[0].tolist():
        raise ValueError("passkey: the prompt's tokens change when the answer follows it (this tokenizer merges "
                         "across the boundary); a circuit needs a fixed prompt")
    j = next((k for k in range(n, len(full)) if any(ch.isdigit() for ch in model.to_string(full[k:k + 1]))), None)
    if j is None:
        raise ValueError(f"passkey: no digit token after the prompt for key {key}")
    return full[:j], full[j]
