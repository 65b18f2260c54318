"""Which heads need the whole context: head-role scores, per query head and per KV head, and the
cache policies they choose (keep the top-k KV heads `full`, stream the rest).

Scores
    retrieval  Wu et al. 2024 ("Retrieval Head Mechanistically Explains Long-Context Factuality"):
               while the model greedily decodes the pass key of a scoring prompt, for every generated
               token that occurs in the needle's key, a head scores a hit when its top-1 attention at
               the step that produced the token falls on that very token inside the needle;
               score = hits / tokens copied, summed over the scoring prompts (seeded, disjoint from
               the evaluation prompts).
    echo, induction   RazorAttention (Tang et al. 2024) on repeated random tokens: attention to the
               current token's previous occurrence (echo) and to the token after it (induction), from
               `heads.induction_scores`; razor = max(echo, induction), the heads RazorAttention keeps.
    loss       each KV head alone switched to streaming(sinks, window), everything else full: the
               increase of the next-token loss over the positions past sinks + window (the only ones
               the window changes) of real text; one batched forward per layer from the cached
               residual stream (batch block g streams KV head g), as the KV study's loss ranking.
    gate       DuoAttention's trained gates (`analyses/src/kv/gates.py`), when given.
    static     from the weights alone, no forward pass (`static_scores.static_retrieval_scores`): the head's
               share of query-key kernel energy on RoPE's low frequencies times how concentrated its kernel is
               (effective rank); on the roles study's head table beside the measured retrieval score.

Per KV head (GQA): the max over the query heads that share it (`<score>` columns), and the mean
(`<score>_mean`); selections rank by the max.

Selections (`selection_runs`): for each ranking and each fraction f of the KV heads, the top
k = round(f x KV heads) kept `full` and the rest `streaming(sinks, window)`; "random": k heads drawn
per seed. `equal_bytes_runs`: one budget policy (SnapKV, H2O, TOVA, ..., protected or not) on every head with
the per-head token budget that holds the same bytes per token as such a selection at a given prompt length.
"""

from __future__ import annotations

import math
import random
from typing import Mapping, Sequence

import pandas as pd
import torch

from interp.errors import BadValue
from interp.models.kv.policies import Streaming

from .._common import progress
from ..heads import induction_scores
from .policies import PolicyRun
from .tasks import RetrievalPrompt

RANKINGS = ("retrieval", "razor", "loss", "gates", "static", "random")


def _kv_of(model) -> torch.Tensor:
    return torch.arange(model.cfg.n_heads) // (model.cfg.n_heads // model.cfg.kv_heads)


def _head_frame(model, **scores: torch.Tensor) -> pd.DataFrame:
    """[n_layers, n_heads] tensors -> one row per query head: layer, head, kv_head, scores."""
    cfg = model.cfg
    kv = _kv_of(model)
    rows = [dict(layer=l, head=h, kv_head=int(kv[h]), **{k: float(v[l, h]) for k, v in scores.items()})
            for l in range(cfg.n_layers) for h in range(cfg.n_heads)]
    return pd.DataFrame(rows)


def per_kv_head(frame: pd.DataFrame, columns: Sequence[str]) -> pd.DataFrame:
    """Query-head scores -> one row per (layer, kv_head): the max over its query heads (`col`) and
    the mean (`col_mean`)."""
    g = frame.groupby(["layer", "kv_head"], sort=True)[list(columns)]
    out = g.max().join(g.mean().add_suffix("_mean"))
    return out.reset_index()


@torch.no_grad()
def retrieval_scores(model, prompts: Sequence[RetrievalPrompt], *, max_new_tokens: int = 8,
                     progress_bar: bool | None = None) -> pd.DataFrame:
    """Wu et al.'s retrieval score of every query head (module docstring): layer, head, kv_head,
    retrieval, hits, copied."""
    cfg = model.cfg
    hits = torch.zeros(cfg.n_layers, cfg.n_heads)
    copied = 0
    top: dict[int, torch.Tensor] = {}

    def grab(layer):
        def fn(pattern, hook):  # [batch, head, 1, keys]: the step's attention
            top[layer] = pattern[0, :, -1].argmax(-1).cpu()
        return fn

    hooks = [(f"blocks.{l}.attn.hook_pattern", grab(l)) for l in range(cfg.n_layers)]
    for p in progress(prompts, desc="retrieval scores", enabled=progress_bar):
        toks = p.tokens
        seq = toks[0].cpu()
        a, b = p.key_span
        needle = set(seq[a:b].tolist())
        cache = model.new_kv_cache(1, toks.shape[1] + max_new_tokens)
        model(toks[:, :-1], kv_cache=cache, stop_at_layer=cfg.n_layers)  # fused: no pattern needed yet
        nxt = toks[:, -1:]
        for _ in range(max_new_tokens):
            with model.hooks(fwd_hooks=hooks):
                w = int(model(nxt, kv_cache=cache)[0, -1].argmax())
            if w in needle:
                copied += 1
                for layer, j in top.items():  # a hit: top-1 on this very token inside the needle
                    inside = (j >= a) & (j < b)
                    hits[layer] += (inside & (seq[j.clamp(max=len(seq) - 1)] == w)).float()
            seq = torch.cat([seq, torch.tensor([w])])
            nxt = torch.tensor([[w]], device=toks.device)
    if copied == 0:
        raise BadValue(f"the model copied no needle token in {len(prompts)} scoring prompts, so no head can score; "
                       "retrieval scores need prompts the model answers (shorter lengths, or more prompts)")
    frame = _head_frame(model, retrieval=hits / copied, hits=hits)
    frame["copied"] = copied
    return frame


def razor_scores(model, *, seq_len: int = 200, batch_size: int = 4, seed: int = 0) -> pd.DataFrame:
    """RazorAttention's echo and induction scores on repeated random tokens: layer, head, kv_head,
    echo, induction, razor (= max of the two)."""
    seq_len = min(seq_len, (model.cfg.n_ctx - 1) // 2)  # two copies and a BOS within the model's context
    frame = induction_scores(model, seq_len=seq_len, n_repeats=2, batch_size=batch_size, seed=seed)
    piv = frame.pivot_table(index=["layer", "head"], columns="kind", values="score")
    kv = _kv_of(model)
    out = pd.DataFrame(dict(layer=piv.index.get_level_values(0), head=piv.index.get_level_values(1)))
    out["kv_head"] = [int(kv[h]) for h in out["head"]]
    out["echo"] = piv["duplicate_token"].to_numpy()
    out["induction"] = piv["induction"].to_numpy()
    out["razor"] = out[["echo", "induction"]].max(axis=1)
    return out


def _streaming_hidden(n: int, sinks: int, window: int, device) -> torch.Tensor:
    """bool [n, n]: True where StreamingLLM's rule hides key j from query i (j <= i is kept when j <
    sinks or i - j < window)."""
    i = torch.arange(n, device=device)[:, None]
    j = torch.arange(n, device=device)[None, :]
    return ~((j <= i) & ((j < sinks) | (i - j < window)))


@torch.no_grad()
def loss_scores(model, tokens: torch.Tensor, *, sinks: int = 4, window: int = 128,
                progress_bar: bool | None = None) -> pd.DataFrame:
    """Per KV head: the loss increase with that head alone streaming(sinks, window) (module
    docstring): layer, kv_head, loss."""
    cfg = model.cfg
    b, n = tokens.shape
    start = sinks + window  # queries from here on lose keys; the loss of the tokens they predict
    if n <= start + 1:
        raise BadValue(f"loss scores need text longer than sinks + window + 1 = {start + 1} tokens, got {n}")
    names = [f"blocks.{l}.hook_resid_pre" for l in range(cfg.n_layers)]
    logits, acts = model.run_with_cache(tokens, names_filter=lambda x: x in names)

    def long_range_loss(lg: torch.Tensor, rows: int) -> torch.Tensor:  # [rows] mean loss over positions >= start
        lp = torch.log_softmax(lg[:, start:-1].float(), -1)
        tgt = tokens.repeat(rows // b, 1)[:, start + 1 :]
        return -lp.gather(-1, tgt[..., None])[..., 0].view(rows // b, b, -1).mean((1, 2))

    clean = float(long_range_loss(logits, b)[0])
    hidden = _streaming_hidden(n, sinks, window, tokens.device)
    rep = cfg.n_heads // cfg.kv_heads
    rows = []
    for layer in progress(range(cfg.n_layers), desc="KV heads: streaming loss", enabled=progress_bar):
        kv = cfg.kv_heads

        def mask(scores, hook):  # [kv * b, heads, n, n]: block g streams KV head g's query heads
            s = scores.clone()
            for g in range(kv):
                s[g * b : (g + 1) * b, g * rep : (g + 1) * rep] = s[g * b : (g + 1) * b, g * rep : (g + 1) * rep] \
                    .masked_fill(hidden, float("-inf"))
            return s

        out = model.run_with_hooks(acts[names[layer]].repeat(kv, 1, 1), start_at_layer=layer,
                                   fwd_hooks=[(f"blocks.{layer}.attn.hook_attn_scores", mask)])
        losses = long_range_loss(out, kv * b)
        rows += [dict(layer=layer, kv_head=g, loss=float(losses[g]) - clean) for g in range(kv)]
    frame = pd.DataFrame(rows)
    if not torch.isfinite(torch.tensor(frame["loss"].to_numpy())).all():
        raise FloatingPointError("a streaming loss is not finite: NaN or inf is an error, not a ranking")
    return frame


def kv_roles(query_scores: pd.DataFrame, loss: pd.DataFrame | None = None,
             gates: pd.DataFrame | None = None) -> pd.DataFrame:
    """One row per (layer, kv_head): max and mean over its query heads of every query-head score, plus
    the KV-head scores (loss, gate) when given: the table rankings are read from."""
    cols = [c for c in ("retrieval", "echo", "induction", "razor", "static") if c in query_scores.columns]
    out = per_kv_head(query_scores, cols)
    for extra in (loss, gates):
        if extra is not None:
            out = out.merge(extra, on=["layer", "kv_head"], how="left")
    return out


def ranking(roles: pd.DataFrame, name: str) -> pd.Series:
    """Scores indexed by (layer, kv_head), higher = keep full. name: retrieval, razor, loss, gates, static."""
    column = {"gates": "gate"}.get(name, name)
    if column not in roles.columns:
        raise BadValue(f"no {name} scores in the head table (columns: {', '.join(roles.columns)})")
    return roles.set_index(["layer", "kv_head"])[column]


def check_selection(names: Sequence[str], fractions: Sequence[float], n_kv: int) -> None:
    unknown = [n for n in names if n not in RANKINGS]
    if unknown:
        raise BadValue(f"unknown selection {', '.join(unknown)}; choose from {', '.join(RANKINGS)}")
    for f in fractions:
        if not (isinstance(f, (int, float)) and 0 < f <= 1):
            raise BadValue(f"a share of KV heads kept full is a fraction of the KV heads in (0, 1], got {f}")
    too_few = [f for f in fractions if round(f * n_kv) < 1]
    if too_few:
        raise BadValue(f"a fraction of {too_few[0]} of {n_kv} KV heads keeps none: use at least {1 / n_kv:.3f}")


def selection_runs(rankings: Mapping[str, pd.Series], n_layers: int, kv_heads: int, *, fractions: Sequence[float],
                   seeds: Sequence[int] = (0, 1, 2), sinks: int = 4, window: int = 128) -> list[PolicyRun]:
    """For each ranking (and "random" when in `rankings` as None) and fraction f: the top
    k = round(f x KV heads) KV heads full, the rest streaming(sinks, window)."""
    n_kv = n_layers * kv_heads
    stream = Streaming(sinks, window).name
    every = [(l, g) for l in range(n_layers) for g in range(kv_heads)]
    runs = []
    for f in fractions:
        k = max(1, round(f * n_kv))
        for name, scores in rankings.items():
            if name == "random":
                for seed in seeds:
                    keep = random.Random(f"random:{seed}:{k}").sample(every, k)
                    runs.append(PolicyRun(f"random#{seed} {k}/{n_kv}", {h: "full" for h in keep}, default=stream,
                                          selection="random", full_fraction=f, seed=seed, full_heads=k))
                continue
            order = scores.sort_values(ascending=False, kind="stable").index[:k]
            runs.append(PolicyRun(f"{name} {k}/{n_kv}", {(int(l), int(g)): "full" for l, g in order}, default=stream,
                                  selection=name, full_fraction=f, full_heads=k))
    return runs


def equal_bytes_budget(fraction: float, length: int, sinks: int, window: int) -> int:
    """Tokens per head that hold, on every head, about the bytes per token of keeping `fraction` of
    the KV heads full and streaming the rest (sinks + window entries each) at `length` tokens."""
    return max(1, round(fraction * length + (1 - fraction) * min(length, sinks + window)))


def equal_bytes_name(method: str, budget: int) -> str:
    """The policy `method` (a budget policy's name: snapkv, h2o, knorm, tova, random, with any '+' setting:
    "h2o+protect(10%)") at `budget` tokens per head: "h2o(221)+protect(10%)"."""
    base, plus, setting = method.partition("+")
    return f"{base.strip()}({budget})" + (f"+{setting.strip()}" if plus else "")


def equal_bytes_runs(fractions: Sequence[float], lengths: Sequence[int], *, sinks: int = 4, window: int = 128,
                     method: str = "snapkv") -> list[PolicyRun]:
    """`method` (snapkv, h2o, ..., or one with boundary protection, "h2o+protect(10%)": `equal_bytes_name`) on
    every head with the per-head budget of `equal_bytes_budget`, one run per (fraction, prompt length):
    evaluated on the prompts of that length only."""
    runs = []
    for f in fractions:
        for length in lengths:
            b = equal_bytes_budget(f, length, sinks, window)
            name = equal_bytes_name(method, b)
            runs.append(PolicyRun(f"{name} ~{f:g}@{length}", name, selection=method, tokens_per_head=b, full_fraction=f,
                                  lengths=(length,)))
    return runs


def overlap(top: Sequence[tuple[int, int]], others: Mapping[str, Sequence[tuple[int, int]]]) -> dict[str, int]:
    """How many of `top` heads each other list shares."""
    s = set(top)
    return {k: len(s & set(v)) for k, v in others.items()}


def share_above(frame: pd.DataFrame, column: str, threshold: float = 0.1) -> float:
    """The share of query heads whose `column` score exceeds `threshold` (Wu et al.: under 5% for retrieval)."""
    values = frame[column].to_numpy()
    return float((values > threshold).mean()) if len(values) else math.nan
