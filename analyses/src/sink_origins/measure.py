"""The measurements of the sinks study (`interp sinks`): where each head's attention sink sits, the
residual stream's massive activations, and the interventions that ask which components make the sink.

Shapes: batch (sequences), pos (positions), head (query heads), kv (key/value heads), d_model, d_head.

* `sink_pass`: ONE forward (the model's own, with its loss) whose hooks hand every layer's queries and keys
  (as attention scores them, after RoPE and QK-norm) to `layer_sinks`, as `interp.models.readouts.head_statistics` does:
  - `first`: Gu et al. (2024)'s alpha_0, the mean over the queries that see key 0 of each one's weight on it,
    from the streaming statistics (`attention_stats(n_sink=1).sink`: no pattern is built);
  - `delimiter`: the same for the sequence's first delimiter (the first newline, period, comma, colon, ...
    token after position 0), its column of the pattern from each row's log-sum-exp (`attention_weights_at`);
  - `learned` (gpt-oss's learned sink logit b per head): its share e^b / (Z + e^b) = exp(b - lse), exactly,
    lse = log(Z + e^b) being the row's log-sum-exp with the sink term (`attention_logsumexp`);
  - `other` (the unmodified model only): the largest alpha_k over the other keys k < pos / 2 (each seen by at
    least half the queries), by key columns in blocks from the log-sum-exp (never the whole pattern).
  With `reference=True` it also keeps what the interventions need: the massive activations (Sun et al. 2024,
  "Massive Activations in Large Language Models": the largest |resid_post| entries per layer, their ratio to the
  layer's median |activation|; their criterion, magnitude > 100 and >= 1000 x the median, marks them), the
  mean MLP output over the positions after the first, and the first token's mean key direction per KV head.
* `intervention_hooks`: the hooks of one intervention (`INTERVENTIONS`), built from that reference.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from interp.kernels import attention_stats
from interp.models.placement import device_map as device_maps
from interp.models.readouts.head_statistics import attention_logsumexp, attention_weights_at, layer_scoring

# The token kinds of a position (the massive-activation table, the other sinks).
KINDS = ("first", "first_delimiter", "delimiter", "token")
DELIMITER_CHARS = frozenset(".,;:!?\n")  # a delimiter token: these alone, once spaces and tabs are stripped
# Sun et al.'s criterion for a massive activation: |a| > MASSIVE_MIN and |a| >= MASSIVE_RATIO x the median |a|
MASSIVE_MIN, MASSIVE_RATIO = 100.0, 1000.0
KEY_BLOCK = 64  # key columns of the pattern computed at a time for `other`


# ---- tokens ---------------------------------------------------------------------------------------
def delimiter_ids(model, tokens: Tensor) -> set[int]:
    """The ids among `tokens` whose text is a delimiter (`DELIMITER_CHARS`); none without a tokenizer."""
    tok = getattr(model, "tokenizer", None)
    if tok is None:
        return set()
    out = set()
    for i in torch.unique(tokens).tolist():
        text = tok.decode([i])
        bare = text.replace(" ", "").replace("\t", "")
        if bare and set(bare) <= DELIMITER_CHARS:
            out.add(int(i))
    return out


def token_kinds(tokens: Tensor, delimiters: set[int]) -> tuple[Tensor, Tensor]:
    """(kinds long [batch, pos]: indices into `KINDS`, first long [batch]: each sequence's first delimiter
    position after position 0, -1 where it has none)."""
    is_delim = torch.zeros_like(tokens, dtype=torch.bool)
    for d in delimiters:
        is_delim |= tokens == d
    is_delim[:, 0] = False
    pos = torch.arange(tokens.shape[1], device=tokens.device)
    first = torch.where(is_delim, pos, tokens.shape[1]).min(1).values
    first = torch.where(first < tokens.shape[1], first, -1)
    kinds = torch.where(is_delim, 2, 3)
    kinds[:, 0] = 0
    kinds[pos[None] == first[:, None]] = 1
    return kinds, first


# ---- one layer's sinks ----------------------------------------------------------------------------
def _sees(p: Tensor, j: Tensor, window: int | None) -> Tensor:
    """bool [len(p), len(j)]: the query at p sees key j (causal, inside a window)."""
    rel = p[:, None] - j[None, :]
    ok = rel >= 0
    return ok if window is None else ok & (rel < window)


def _nanmean0(x: Tensor) -> Tensor:
    """The mean over the batch (dim 0) of the finite entries; NaN where there is none."""
    ok = torch.isfinite(x)
    return torch.where(ok, x, 0.0).sum(0) / ok.sum(0)


def layer_sinks(q: Tensor, k: Tensor, tokens: Tensor, scoring, first_delim: Tensor, *, other: bool = False,
                backend: str = "auto") -> dict[str, Tensor]:
    """A layer's sinks, float32 [head] each (means over the batch): `first`, `delimiter` (NaN where no
    sequence has one), `learned` (only with learned sink logits) and, with `other`, `other` with
    `other_position` and `other_is_delimiter` (see the module docstring).

    q [batch, head, pos, d_head], k [batch, kv, pos, d_head] as attention scores them; tokens [batch, pos];
    `scoring`: the layer's (`layer_scoring`); first_delim long [batch] (-1: none)."""
    b, h, n, _ = q.shape
    p = torch.arange(n, device=q.device)
    window = scoring.window
    st = attention_stats(q, k, tokens, scoring, n_sink=1, stats=("sink",), backend=backend)
    sees0 = _sees(p, p[:1], window)[:, 0].float()  # [pos]
    out = {"first": ((st.sink.float() * sees0).sum(-1) / sees0.sum()).mean(0)}
    lse = attention_logsumexp(q, k, scoring)  # [b, h, pos]; with learned sinks, log(Z + e^b)
    has = first_delim >= 0
    delim = torch.full((b, h), float("nan"), device=q.device)
    if bool(has.any()):
        keys = torch.unique(first_delim[has])
        w = attention_weights_at(q, k, lse, keys, scoring)  # [b, h, pos, m]
        col = torch.searchsorted(keys, first_delim.clamp(min=0))
        col = col.clamp(max=len(keys) - 1)
        wd = w.gather(-1, col[:, None, None, None].expand(b, h, n, 1))[..., 0]  # [b, h, pos]
        seen = (p[None] - first_delim[:, None] >= 0)
        if window is not None:
            seen &= p[None] - first_delim[:, None] < window
        seen = seen.float()[:, None]  # [b, 1, pos]
        delim = torch.where(has[:, None], (wd * seen).sum(-1) / seen.sum(-1).clamp(min=1), delim)
    out["delimiter"] = _nanmean0(delim)
    if scoring.sink_logits is not None:  # gpt-oss: the learned sink's share of every row, e^b / (Z + e^b)
        out["learned"] = torch.exp(scoring.sink_logits.float().to(lse.device)[None, :, None] - lse).mean((0, 2))
    if other:
        out.update(_other_sinks(q, k, lse, scoring, first_delim))
    return out


def _other_sinks(q, k, lse, scoring, first_delim) -> dict[str, Tensor]:
    """The largest alpha_k over the keys 0 < k < pos / 2 other than the first delimiter, per (sequence, head),
    by blocks of `KEY_BLOCK` key columns of the pattern: -> `other` (its mean over the batch), `other_position`
    (the median over sequences of that key's position) and `_other_where` ([batch, head] positions, for the
    caller to name the keys' kinds)."""
    b, h, n, _ = q.shape
    p = torch.arange(n, device=q.device)
    best = torch.full((b, h), -1.0, device=q.device)
    where = torch.zeros((b, h), dtype=torch.long, device=q.device)
    for lo in range(1, max(2, n // 2), KEY_BLOCK):
        j = torch.arange(lo, min(lo + KEY_BLOCK, max(2, n // 2)), device=q.device)
        w = attention_weights_at(q, k, lse, j, scoring)  # [b, h, pos, m]: 0 where unseen
        count = _sees(p, j, scoring.window).sum(0).clamp(min=1)  # [m]
        alpha = w.sum(2) / count  # [b, h, m]
        alpha = alpha.masked_fill((j[None] == first_delim[:, None])[:, None], -1.0)
        top, at = alpha.max(-1)
        better = top > best
        best, where = torch.where(better, top, best), torch.where(better, j[at], where)
    return {"other": best.mean(0), "other_position": where.float().median(0).values,
            "_other_where": where}


# ---- the residual stream's massive activations ---------------------------------------------------------
def massive_rows(layer: int, resid: Tensor, kinds: Tensor, top_k: int) -> tuple[list[dict], Tensor, float]:
    """Per layer: the `top_k` largest |activation| of the residual stream `resid` [batch, pos, d_model], at most
    one per (dimension, token kind: `KINDS`), each with where it is and its ratio to the layer's median
    |activation| over every position and dimension. Also returns the first token's |activation| (max over
    sequences) per dimension [d_model] and the median."""
    mag = resid.detach().float().abs()
    b, n, d = mag.shape
    median = float(mag.median())
    best = torch.full((len(KINDS), d), -1.0, device=mag.device)
    at = torch.zeros((len(KINDS), d), dtype=torch.long, device=mag.device)
    flat = mag.reshape(b * n, d)
    for c in range(len(KINDS)):
        m = flat.masked_fill(~(kinds.reshape(-1) == c)[:, None], -1.0)
        best[c], at[c] = m.max(0)
    values, order = best.reshape(-1).topk(min(top_k, best.numel()))
    rows = []
    for rank, (v, o) in enumerate(zip(values.tolist(), order.tolist())):
        if v < 0:
            break
        c, dim = divmod(o, d)
        seq, pos = divmod(int(at[c, dim]), n)
        value = float(resid[seq, pos, dim])
        ratio = v / median if median > 0 else float("inf")
        rows.append(dict(layer=layer, rank=rank, dim=dim, kind=KINDS[c], sequence=seq, position=pos, value=value,
                         magnitude=v, median=median, ratio=ratio))
    return rows, mag[:, 0].max(0).values, median


def is_massive(magnitude, ratio, minimum: float = MASSIVE_MIN, at_least: float = MASSIVE_RATIO):
    """Sun et al.'s criterion: magnitude > `minimum` and >= `at_least` x the layer's median |activation|."""
    return (magnitude > minimum) & (ratio >= at_least)


# ---- the pass ---------------------------------------------------------------------------------------------
@dataclass
class PassResult:
    """What `sink_pass` measured: per layer the `layer_sinks` values ({name: [layer, head]}), the mean loss;
    with the reference: the massive-activation rows, the first token's |activation| per layer [layer, d_model]
    and the medians [layer], the MLP outputs' means {layer: [d_model]} and the first token's unit mean key per
    KV head {layer: [kv, d_head]}."""

    heads: dict[str, Tensor]
    loss: float
    massive: list[dict] = field(default_factory=list)
    first_magnitude: Tensor | None = None
    medians: list[float] = field(default_factory=list)
    mlp_means: dict[int, Tensor] = field(default_factory=dict)
    key_dirs: dict[int, Tensor] = field(default_factory=dict)


def key_hook_name(model, layer: int) -> str:
    """The hook of the keys as attention scores them (after QK-norm and RoPE): hook_rot_k with rotary
    positions, else hook_k. At position 0 RoPE turns by angle 0, so there the two differ only by QK-norm."""
    return f"blocks.{layer}.attn." + ("hook_rot_k" if model.rotary is not None else "hook_k")


def _query_hook_name(model, layer: int) -> str:
    return f"blocks.{layer}.attn." + ("hook_rot_q" if model.rotary is not None else "hook_q")


@torch.no_grad()
def sink_pass(model, tokens: Tensor, kinds: Tensor, first_delim: Tensor, *, hooks=(), reference: bool = False,
              mlp_layers=(), top_k: int = 4, backend: str = "auto") -> PassResult:
    """One forward of `model` on `tokens` [batch, pos] with the intervention `hooks` (added first, so every
    measurement sees what they changed): `layer_sinks` of every layer and the loss; with `reference`, also what
    `PassResult` lists (for the `mlp_layers` asked)."""
    cfg = model.cfg
    split = device_maps.is_split(getattr(model, "device_map", None))
    held: dict[str, Tensor] = {}
    per_layer: list[dict[str, Tensor]] = [None] * cfg.n_layers
    result = PassResult(heads={}, loss=float("nan"))
    first_mag = [None] * cfg.n_layers
    result.medians = [float("nan")] * cfg.n_layers

    def keep(key):
        def hook(x, hook):
            held[key] = x.transpose(1, 2)  # [batch, pos, head, d] -> [batch, head, pos, d]
        return hook

    def done(layer):
        def hook(x, hook):
            q, kk = held.pop("q"), held.pop("k")
            if split:
                q, kk = device_maps.move((q, kk), model.device)
            if reference:
                result.key_dirs[layer] = torch.nn.functional.normalize(kk[:, :, 0].float().mean(0), dim=-1)
            per_layer[layer] = layer_sinks(q, kk, tokens, layer_scoring(model, layer), first_delim, other=reference,
                                           backend=backend)
        return hook

    def resid(layer):
        def hook(x, hook):
            x = device_maps.move(x, model.device) if split else x
            rows, first_mag[layer], result.medians[layer] = massive_rows(layer, x, kinds, top_k)
            result.massive += rows
        return hook

    def mlp_mean(layer):
        def hook(x, hook):
            result.mlp_means[layer] = x[:, 1:].float().mean((0, 1))
        return hook

    fwd = list(hooks)
    for l in range(cfg.n_layers):
        fwd += [(_query_hook_name(model, l), keep("q")), (key_hook_name(model, l), keep("k")),
                (f"blocks.{l}.hook_attn_out", done(l))]
        if reference:
            fwd.append((f"blocks.{l}.hook_resid_post", resid(l)))
            if l in mlp_layers:
                fwd.append((f"blocks.{l}.hook_mlp_out", mlp_mean(l)))
    result.loss = float(model.run_with_hooks(tokens, fwd_hooks=fwd, return_type="loss"))
    names = [k for k in per_layer[0] if not k.startswith("_")]
    result.heads = {k: torch.stack([per_layer[l][k] for l in range(cfg.n_layers)]) for k in names}
    if reference:
        result.heads["_other_where"] = torch.stack([per_layer[l]["_other_where"] for l in range(cfg.n_layers)])
        result.first_magnitude = torch.stack(first_mag)
    return result
