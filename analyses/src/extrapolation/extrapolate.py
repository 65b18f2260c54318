"""Reading past the trained context: what RoPE scalings do to a model at 1x, 1.5x and 2x its context,
which heads break, whether the rotary frequencies a head leans on say which, and a repair of those
heads alone. The measurements; the study (`interp extrapolate`), its settings and its report are
`study.py`.

one pass per scaling   `autopsy_pass`: one forward over the evaluation text at the longest length gives
    every head's scores at every length (`lengths.scores_at_lengths`: entropy, sink, distance and its
    quantiles, previous-token, duplicate, induction over the queries L/2 .. L-1, from the streaming
    statistics kernel, no n x n pattern) and every token's loss (`bucket_perplexity`: perplexity by
    position bucket); for the model as loaded also the rotary energies (`PairEnergy`). Where the
    frequencies follow the call's length (dynamic NTK, LongRoPE) each length gets its own forward.
never completed        rotary pair i turns at theta_i (base^(-2i/d) for plain RoPE: the model's own
    frequencies, as loaded); it completes a period within n_ctx when 2 pi / theta_i <= n_ctx. A pair
    that never did turns, past n_ctx, to angles training never showed the head.
energy                 of pair i in query head h: the mean over the trained context's positions
    (0 .. n_ctx-1) of |q_i| (the pair's 2-D norm) times the same mean of |k_i| of its KV head. A pair
    adds |q_i| |k_i| cos(angle) to q . k, so this is how far it can move a score, without the n x n
    pairs. Dimensions past rotary_dim are one-dimensional units that never turn (in the total only).
    A head's share (`never_completed_shares`) is the never-completed pairs' energy over the total.
change past n_ctx      per head of the model as loaded, between the longest length <= n_ctx (the
    reference) and each longer one: entropy (nats), mean distance (log2 of (distance + 1) over the
    reference's) and sink mass (`head_changes`). A head breaks as much as its entropy moves; its rank
    at the first length past n_ctx says which heads break first.
passkey                `kv.tasks` prompts (allowed past n_ctx here), answered greedily through the full
    cache by `kv.policies.answer`, as `interp kv passkey` answers them.
repair                 the heads that break most at the longest length, at most a fraction of all
    (`choose_repair`): the scaling on their KV heads (`interp.models.rope.heads.scaled_heads`; every
    query head of a chosen KV head counts) or LogN temperature on the query heads (`logn_heads`).
"""

from __future__ import annotations

import contextlib
import math
from typing import Iterator

import numpy as np
import pandas as pd
import torch
from torch import Tensor

from interp.models.placement.device import to_numpy
from interp.models.rope.choice import choose

from .._common import spearman
from ..document import head_name
from ..kv.policies import answer, policy_runs
from .lengths import FROM_FRACTION, scores_at_lengths

SCALINGS = ("none", "linear", "ntk", "yarn")  # none: the model as loaded (its own positions)
FACTOR = 2.0
DEPTHS = (0.25, 0.75)
BUCKETS = 8
REPAIR_FRACTION = 0.2  # the most heads a repair may change (a fraction of all query heads)
CHANGES = ("entropy", "distance", "sink")


# ---- scalings ----------------------------------------------------------------------------------------
def scaling_name(text: str, factor: float = FACTOR) -> str:
    """A --scalings entry as the name it keeps: "none" (the model as loaded); a bare type takes `factor`
    ("yarn" -> "yarn:2"); TYPE:FACTOR[:ORIGINAL_LEN] and "default" (plain RoPE) as given."""
    text = str(text).strip()
    if text == "none" or ":" in text or text == "default":
        return text
    return f"{text}:{factor:g}"


@contextlib.contextmanager
def rope_as(model, name: str) -> Iterator[None]:
    """The model rotates with the scaling `name` ("none": as loaded) inside the block, and as loaded after
    it, even on an exception (`rescale_rope_`; `runtime.rope_chosen` as it was, so the study's record
    says what the model was loaded with)."""
    if name == "none":
        yield
        return
    own, chosen = model.cfg.rope_scaling, model.runtime.rope_chosen
    try:
        model.rescale_rope_(choose(model.cfg, name))
        yield
    finally:
        model.rescale_rope_(own)
        model.runtime.rope_chosen = chosen


def scaled_layers(cfg) -> list[int]:
    """The layers a RoPE scaling rescales: every layer but those rotating with a local base (Gemma 3)."""
    return [l for l in range(cfg.n_layers) if not cfg.local_rope(l)]


# ---- never-completed pairs ---------------------------------------------------------------------------
def never_completed(inv_freq: Tensor, n_ctx: int) -> Tensor:
    """[pairs] bool: pair i (frequency inv_freq[i]) does not complete a period within n_ctx tokens."""
    return (2 * math.pi / inv_freq.double()) > n_ctx


def rotary_tables(model, n_ctx: int) -> list[dict]:
    """settings.json's word on the model's rotary tables (one for most models; Gemma 3: local and global):
    the layers of each, its pairs, how many never complete a period within n_ctx, the first that does not,
    and the longest period (tokens)."""
    rotary, out = model.rotary, []
    for t in sorted(set(rotary.table_of_layer)):
        freqs = rotary.inv_freq[t].detach().double()
        never = to_numpy(never_completed(freqs, n_ctx))
        out.append({"layers": [l for l, x in enumerate(rotary.table_of_layer) if x == t], "pairs": int(len(never)),
                    "never_completed_pairs": int(never.sum()),
                    "first_never_completed": int(np.argmax(never)) if never.any() else None,
                    "longest_period": round(float(2 * math.pi / freqs.min()), 1)})
    return out


def layer_frequencies(model) -> list[Tensor]:
    """Each layer's rotary frequencies [rotary_dim / 2], as the model was loaded (its table's)."""
    rotary = model.rotary
    return [rotary.inv_freq[rotary.table_of_layer[l]].detach().float() for l in range(model.cfg.n_layers)]


class PairEnergy:
    """`each_layer` callback of `lengths.scores_at_lengths`: per layer, the mean over positions 0 .. n-1 of
    each rotary pair's norm (rotate-half: dims i and i + r/2; adjacent pairs: 2i and 2i + 1) and of each
    pass-through dimension's |x|, in q [head, unit] and k [kv_head, unit]."""

    def __init__(self, model, n: int) -> None:
        cfg = model.cfg
        self.n, self.rot, self.adjacent = n, cfg.rot_dim, cfg.rotary_adjacent_pairs
        self.group = cfg.n_heads // cfg.kv_heads
        self.q: dict[int, Tensor] = {}
        self.k: dict[int, Tensor] = {}

    def units(self, x: Tensor) -> Tensor:
        """[batch, heads, pos, d_head] -> [heads, rot/2 + d_head - rot] mean norms over batch and positions < n."""
        x = x[:, :, : self.n].float()
        rot = x[..., : self.rot]
        a, b = (rot[..., 0::2], rot[..., 1::2]) if self.adjacent else rot.chunk(2, dim=-1)
        return torch.cat([(a * a + b * b).sqrt(), x[..., self.rot:].abs()], dim=-1).mean((0, 2))

    def __call__(self, layer: int, q: Tensor, k: Tensor) -> None:
        self.q[layer], self.k[layer] = self.units(q), self.units(k)

    def energy(self, layer: int) -> Tensor:
        """[head, unit]: |q_i| mean times |k_i| mean of the head's KV head."""
        return self.q[layer] * self.k[layer].repeat_interleave(self.group, dim=0)


def never_completed_shares(model, energy: PairEnergy, n_ctx: int | None = None) -> pd.DataFrame:
    """Per head: layer, head, share (of its q . k energy on the pairs that never complete a period within
    n_ctx, default the model's), never_pairs (how many of its layer's pairs)."""
    n_ctx = model.cfg.n_ctx if n_ctx is None else n_ctx
    rows = []
    for layer, freqs in enumerate(layer_frequencies(model)):
        never = never_completed(freqs, n_ctx).to(energy.q[layer].device)
        e = energy.energy(layer)
        pairs = e[:, : len(never)]
        share = pairs[:, never].sum(-1) / e.sum(-1).clamp(min=torch.finfo(e.dtype).tiny)
        for head, value in enumerate(to_numpy(share)):
            rows.append({"layer": layer, "head": head, "share": float(value), "never_pairs": int(never.sum())})
    return pd.DataFrame(rows)


# ---- one pass: scores and losses ---------------------------------------------------------------------
def length_dependent(model) -> bool:
    """Whether the model's rotary frequencies depend on how long a call is (dynamic NTK; LongRoPE's long
    factors past its original length): then a forward over the longest length does not attend at a shorter
    one as a forward over that length does, and each length gets its own."""
    rotary = model.rotary
    return rotary is not None and bool(rotary.dynamic or rotary.long_row is not None)


def autopsy_pass(model, tokens: Tensor, lengths, *, energy: PairEnergy | None = None,
                 from_fraction: float = FROM_FRACTION, backend: str = "auto") -> tuple[pd.DataFrame, Tensor]:
    """(every head's scores at every length, long rows as `lengths.scores_at_lengths`; each token's
    next-token loss [batch, pos - 1]) from one forward over `tokens` [batch, max(lengths)] (one per length
    where the frequencies depend on the length: `length_dependent`)."""
    lengths = sorted(lengths)
    passes = [lengths] if not length_dependent(model) else [[n] for n in lengths]
    frames = []
    for part in passes:
        last = part[-1] == lengths[-1]
        scores, resid = scores_at_lengths(model, tokens[:, : part[-1]], part, from_fraction=from_fraction,
                                          backend=backend, each_layer=energy if last else None)
        frames.append(scores)
    with torch.no_grad():
        nll = model(resid, start_at_layer=model.cfg.n_layers, tokens=tokens, return_type="loss", loss_per_token=True)
    return pd.concat(frames, ignore_index=True), nll


def sequence_nll(model, tokens: Tensor) -> Tensor:
    """[batch, pos - 1] next-token losses of `tokens` (a plain forward: the repairs' perplexity)."""
    with torch.no_grad():
        return model(tokens, return_type="loss", loss_per_token=True)


def bucket_perplexity(nll: Tensor, buckets: int, n_ctx: int) -> pd.DataFrame:
    """Perplexity by position of the predicted token: `buckets` equal spans of [0, pos) (nll [batch, pos - 1]:
    nll[:, t] predicts position t + 1). Rows bucket, start, end, tokens, nll, perplexity, past_context
    (start >= n_ctx). Non-finite losses are an error, never a perplexity."""
    values = to_numpy(nll.float())
    if not np.isfinite(values).all():
        raise FloatingPointError("a loss is not finite: NaN or inf is an error, not a perplexity")
    n = values.shape[1] + 1
    edges = np.linspace(0, n, buckets + 1).round().astype(int)
    rows = []
    for b, (start, end) in enumerate(zip(edges[:-1], edges[1:])):
        part = values[:, max(start - 1, 0): end - 1]
        mean = float(part.mean()) if part.size else float("nan")
        rows.append({"bucket": b, "start": int(start), "end": int(end), "tokens": int(part.size), "nll": mean,
                     "perplexity": math.exp(mean) if part.size else float("nan"), "past_context": bool(start >= n_ctx)})
    return pd.DataFrame(rows)


def split_perplexity(nll: Tensor, n_ctx: int) -> tuple[float, float]:
    """Perplexity of the positions inside the trained context (1 .. n_ctx-1) and past it (n_ctx ..)."""
    values = to_numpy(nll.float())
    inside, past = values[:, : n_ctx - 1], values[:, n_ctx - 1:]
    return (math.exp(float(inside.mean())) if inside.size else float("nan"),
            math.exp(float(past.mean())) if past.size else float("nan"))


# ---- passkey -------------------------------------------------------------------------------------------
def passkey_answers(model, prompts, max_new_tokens: int = 8) -> pd.DataFrame:
    """One row per prompt: length, depth, seed, key, n_tokens, answer, correct (greedy, the full cache:
    `kv.policies.answer`)."""
    full = policy_runs("full")
    rows = []
    for p in prompts:
        a = answer(model, p, full, max_new_tokens)[0]
        rows.append({"length": p.length, "depth": p.depth, "seed": p.seed, "key": p.key, "n_tokens": p.n_tokens,
                     "answer": a["text"], "correct": bool(a["correct"])})
    return pd.DataFrame(rows, columns=["length", "depth", "seed", "key", "n_tokens", "answer", "correct"])


# ---- which heads break ---------------------------------------------------------------------------------
def reference_length(lengths, n_ctx: int) -> int:
    """The longest length within the trained context: what a head's change past n_ctx is measured from."""
    inside = [n for n in lengths if n <= n_ctx]
    if not inside:
        raise ValueError(f"no length within the model's context (n_ctx={n_ctx}) to measure the change from")
    return max(inside)


def head_changes(scores: pd.DataFrame, n_ctx: int) -> pd.DataFrame:
    """Per head and length past n_ctx (from `autopsy_pass` rows of one scaling): layer, head, length, and the
    change from the reference length (`reference_length`) of entropy (nats), distance (log2((d + 1) /
    (d_ref + 1))) and sink mass."""
    lengths = sorted(scores["length"].unique())
    ref = reference_length(lengths, n_ctx)
    wide = scores[scores["metric"].isin(CHANGES)].pivot_table(index=["layer", "head"], columns=["metric", "length"],
                                                               values="value")
    rows = []
    for n in [n for n in lengths if n > n_ctx]:
        frame = pd.DataFrame({
            "entropy": wide["entropy", n] - wide["entropy", ref],
            "distance": np.log2((wide["distance", n] + 1) / (wide["distance", ref] + 1)),
            "sink": wide["sink", n] - wide["sink", ref]})
        rows.append(frame.reset_index().assign(length=n))
    out = pd.concat(rows, ignore_index=True)
    return out[["layer", "head", "length", *CHANGES]]


def breaking_order(changes: pd.DataFrame, length: int) -> pd.DataFrame:
    """The heads by |entropy change| at `length`, largest first: layer, head, name, change."""
    at = changes[changes["length"] == length]
    order = at.assign(size=at["entropy"].abs()).sort_values(["size", "layer", "head"], ascending=[False, True, True])
    return pd.DataFrame({"layer": order["layer"].to_numpy(), "head": order["head"].to_numpy(),
                         "name": [head_name(l, h) for l, h in zip(order["layer"], order["head"])],
                         "change": order["entropy"].to_numpy()})


def choose_repair(order: pd.DataFrame, cfg, fraction: float) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """The heads a repair changes, from `breaking_order` (largest break first), at most `fraction` of all
    query heads: (query heads for a temperature: the first that many; KV heads (layer, kv_head) for a
    scaling: each the KV head of the next head in the order, when its layer is one a scaling rescales and
    its query heads still fit the budget)."""
    budget = int(math.floor(fraction * cfg.n_layers * cfg.n_heads + 1e-9))
    heads = [(int(l), int(h)) for l, h in zip(order["layer"], order["head"])][:budget]
    group, scaled = cfg.n_heads // cfg.kv_heads, set(scaled_layers(cfg))
    groups: list[tuple[int, int]] = []
    for l, h in zip(order["layer"], order["head"]):
        g = (int(l), int(h) // group)
        if g not in groups and g[0] in scaled and (len(groups) + 1) * group <= budget:
            groups.append(g)
    return heads, groups


def share_correlations(table: pd.DataFrame) -> dict:
    """Spearman's rho over heads between the never-completed share and each |change| (`table`: the heads
    table, columns share and the `CHANGES`); None where one side is constant."""
    out = {}
    for c in CHANGES:
        rho = spearman(torch.tensor(table["share"].to_numpy()), torch.tensor(table[c].abs().to_numpy()))
        out[c] = None if not math.isfinite(rho) else round(rho, 4)
    return out


__all__ = ["BUCKETS", "CHANGES", "DEPTHS", "FACTOR", "PairEnergy", "REPAIR_FRACTION", "SCALINGS", "autopsy_pass",
           "breaking_order", "bucket_perplexity", "choose_repair", "head_changes", "layer_frequencies", "length_dependent",
           "never_completed", "never_completed_shares", "passkey_answers", "reference_length", "rope_as", "rotary_tables",
           "scaled_layers", "scaling_name", "sequence_nll", "share_correlations", "split_perplexity"]
