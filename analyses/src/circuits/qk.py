"""QK attribution: why a head attends where it does (issue 57).

With every norm's scale frozen at the run (the convention of attribution graphs), a head's query and
key are affine in the residual stream before its layer, and that stream is the sum of the graph's
senders' outputs (`Graph.senders` below the layer: `embed`, each head's output, each MLP's) plus
whatever they leave out (attention output biases, a sandwich norm's bias share). RoPE is linear at each
position, so the pre-softmax score of query i against key j is

    score(i, j) = sum over (query-side sender a, key-side sender b) of scale * <Q_a(i), K_b(j)>  (+ ALiBi)

where Q_a(i) is the query made from sender a's output at i alone (the linear part of the map: the map of
the output less the map of zero) and the `bias` sender on each side holds the affine constants (the
norms' biases, b_Q / b_K, through QK-norm with its scale frozen and RoPE) plus the stream's remainder.
The maps are the layer's own modules: ln1 run on the identity with its scale set to 1 (a norm's output
is linear part / scale + constant, so the run's scale at each position divides the product), the head's
columns of W_Q / W_K, then q_norm / k_norm and the rotation run on the senders' projections, their scales
replaced by the run's through their `hook_scale` hook points. Under grouped-query attention the key side is the head's
KV head. ALiBi's position bias is a term of its own (`alibi`). Soft-capped scores (Gemma 2) are not
bilinear: the raw score, before the cap, is decomposed (`softcapped` says so).

The contrast of key j: score(i, j) minus the mean score over the keys query i sees, decomposed the
same way (each term minus its mean over the visible keys; exact, as the mean is linear).

With corrupted tokens as well, the first-order change of the attention weight: each pair's change of
term (corrupted run - clean run, every key) passed through the softmax's (and a soft cap's) derivative
at the clean run, a_j (c'_j d_ab(j) - sum_k a_k c'_k d_ab(k)); summed over the pairs it is the
first-order estimate of the weight's change, reported beside the true change.

With a residual-stream SAE at the stream the layer reads (`sae=`, `blocks.{layer}.hook_resid_pre` or
`blocks.{layer-1}.hook_resid_post`) the senders are that stream as the SAE writes it (`qk_features`): on each
side the features shown, `F{index}` (its activation times its row of W_dec), the rest of them summed
(`other_features`), `b_dec`, `error` (the stream less the reconstruction) and `bias` (the constants alone);
the same maps, contrast and changes, and the terms add up to the score just as exactly.

    from interp.analyses.circuits.qk import qk_attribution
    qk = qk_attribution(model, tokens, layer=1, head=0, query_pos=-1)
    qk.frame            # prompt, query_pos, key_pos, query_sender, key_sender, term, contrast_term
    qk.max_error        # max |sum of terms - the model's score| over the keys decomposed
    qk_attribution(model, tokens, 1, 0, -1, sae=interp.load_sae(path))    # senders F12, ..., b_dec, error, bias
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import pandas as pd
import torch
from torch import Tensor

from interp.models.placement.device import to_numpy

from .graph import Graph
from .head_names import check_head
from .passes import _Pass
from .qk_features import Features, Stream, active_rows, check_sae, choose, sender_names, sender_values, split_stream

BIAS, ALIBI = "bias", "alibi"


# ---- input -----------------------------------------------------------------------------------------------
def check_model(model) -> None:
    if not getattr(model, "native", True):
        raise NotImplementedError("QK attribution needs interp's own transformer: this model is wrapped (run by "
                                  "transformers) and has no per-head outputs (hook_result) nor its heads' query and key "
                                  "maps (ln1, W_Q, W_K, QK-norm, RoPE as modules); load a natively supported family")
    if model.cfg.sandwich_norms and not all(type(b.ln1_post).__name__ == "RMSNorm" for b in model.blocks):
        raise NotImplementedError("QK attribution: sandwich norms other than RMSNorm are not split into head shares")


def _positions(query_pos, key_pos, n_rows: int, n_pos: int, window: int | None):
    """query [N] and keys [N, K] (None: chosen from the pattern), checked: inside the prompt, keys visible."""
    q = torch.as_tensor(query_pos, dtype=torch.long).flatten()
    if q.numel() == 1:
        q = q.expand(n_rows).clone()
    if q.numel() != n_rows:
        raise ValueError(f"query_pos: one position, or one per prompt ({n_rows}), got {q.numel()}")
    if bool(((q < -n_pos) | (q >= n_pos)).any()):
        bad = int(q[(q < -n_pos) | (q >= n_pos)][0])
        raise ValueError(f"query position {bad} is outside the prompt ({n_pos} tokens: 0 .. {n_pos - 1})")
    q = q % n_pos
    if key_pos is None:
        return q, None
    k = torch.as_tensor(key_pos, dtype=torch.long)
    if k.dim() == 0:
        k = k[None]
    if k.dim() == 1:
        k = k[None].expand(n_rows, -1).clone()
    if k.shape[0] != n_rows:
        raise ValueError(f"key_pos: positions for every prompt, or one list for all, got {tuple(k.shape)}")
    if bool(((k < -n_pos) | (k >= n_pos)).any()):
        bad = int(k[(k < -n_pos) | (k >= n_pos)][0])
        raise ValueError(f"key position {bad} is outside the prompt ({n_pos} tokens: 0 .. {n_pos - 1})")
    k = k % n_pos
    far = (k > q[:, None]) | ((q[:, None] - k >= window) if window is not None else torch.zeros_like(k, dtype=torch.bool))
    if bool(far.any()):
        r, c = far.nonzero()[0].tolist()
        raise ValueError(f"key position {int(k[r, c])} is not visible from query position {int(q[r])}"
                         + (f" (the layer's window is {window})" if window is not None else " (causal attention)"))
    return q, k


# ---- the result -------------------------------------------------------------------------------------------
@dataclass(eq=False)
class QKAttribution:
    """The decomposition of one head's scores.

    query_senders / key_senders  the names of the rows / columns of `terms`: the senders below the layer,
                      then `bias`; `alibi` (its own term, [N, K]) when the model has ALiBi. With an SAE
                      (`sae_hook` its hook): each side's features shown, `F{index}` (index: the feature's row
                      of W_dec), then `other_features`, `b_dec`, `error`, `bias` (`qk_features`)
    prompts, query_pos [N]; key_pos [N, K]: where each (prompt, key) sits
    key_on            [N, K] bool: which of the K slots hold a key. With keys chosen by the pattern, a query
                      that sees fewer than `top_keys` keys is split at every key it sees, each once (K is the
                      most any query got); its other slots are off (key_pos -1, terms 0) and left out of every
                      mean, `frame` and `pairs`. All on when the keys were given.
    terms, contrast   [N, K, Sq, Sk] (float32): scale * <Q_a(i), K_b(j)>, and the same less its mean over
                      the keys query i sees
    score, contrast_score [N, K]: the model's pre-softmax score (from hook_attn_scores; before the soft cap
                      when there is one) and its contrast; pattern [N, K] the attention weight
    max_error, contrast_max_error: max |sum of the terms - the score| over every (query, key) decomposed,
                      and the same for the contrast; delta_max_error: the changes of term against the change
                      of score
    delta, weight_change [N, K, Sq, Sk] (with corrupted tokens): each pair's term in the corrupted run less
                      the clean run's, and its share of the first-order change of the attention weight;
                      weight_first_order / weight_true [N, K]: their sum and the weight's true change"""

    layer: int
    head: int
    kv_head: int
    query_senders: list[str]
    key_senders: list[str]
    prompts: Tensor
    query_pos: Tensor
    key_pos: Tensor
    terms: Tensor
    contrast: Tensor
    alibi: Tensor | None
    alibi_contrast: Tensor | None
    score: Tensor
    contrast_score: Tensor
    pattern: Tensor
    max_error: float
    contrast_max_error: float
    softcapped: bool
    delta: Tensor | None = None
    weight_change: Tensor | None = None
    weight_first_order: Tensor | None = None
    weight_true: Tensor | None = None
    delta_max_error: float | None = None
    key_on: Tensor | None = None  # None: every slot holds a key
    sae_hook: str | None = None  # with an SAE's features as the senders: the SAE's hook (its cfg.hook_name)

    @property
    def name(self) -> str:
        return f"L{self.layer}H{self.head}"

    @property
    def on(self) -> Tensor:
        """[N, K] bool: the slots that hold a key (`key_on`, all True when None)."""
        return self.key_on if self.key_on is not None else torch.ones(self.key_pos.shape, dtype=torch.bool)

    def keys_seen(self) -> tuple[int, int]:
        """The fewest and the most keys a query was split at."""
        n = self.on.sum(1)
        return int(n.min()), int(n.max())

    def _mean(self, t: Tensor) -> Tensor:
        """The mean of `t` [N, K, ...] over the slots that hold a key (float64): [...]."""
        w = self.on.to(torch.float64).reshape(*self.on.shape, *([1] * (t.dim() - 2)))
        return (t.double() * w).sum((0, 1)) / w.sum()

    def mean_at_keys(self, t: Tensor) -> Tensor:
        """[K]: the mean of `t` [N, K] over the queries whose slot k holds a key (every slot does in one query)."""
        w = self.on.to(torch.float64)
        return (t.double() * w).sum(0) / w.sum(0)

    @property
    def frame(self) -> pd.DataFrame:
        """One row per (prompt, key, query sender, key sender): prompt, query_pos, key_pos, query_sender,
        key_sender, term, contrast_term (and delta_term, weight_change with corrupted tokens); ALiBi's term
        as the pair (alibi, alibi)."""
        N, K, Sq, Sk = self.terms.shape
        per = Sq * Sk + (1 if self.alibi is not None else 0)
        qs = np.array(self.query_senders + ([ALIBI] if self.alibi is not None else []), dtype=object)
        ks = np.array(self.key_senders + ([ALIBI] if self.alibi is not None else []), dtype=object)
        qi = np.repeat(np.arange(Sq), Sk)
        ki = np.tile(np.arange(Sk), Sq)
        if self.alibi is not None:
            qi, ki = np.append(qi, Sq), np.append(ki, Sk)

        def flat(t: Tensor, extra: Tensor | None) -> np.ndarray:
            t = to_numpy(t.reshape(N * K, Sq * Sk), np.float32)
            if self.alibi is not None:
                e = np.zeros((N * K, 1), np.float32) if extra is None else to_numpy(extra.reshape(N * K, 1), np.float32)
                t = np.concatenate([t, e], axis=1)
            return t.reshape(-1)

        out = pd.DataFrame({
            "prompt": np.repeat(to_numpy(self.prompts, np.int64), K * per),
            "query_pos": np.repeat(to_numpy(self.query_pos, np.int64), K * per),
            "key_pos": np.repeat(to_numpy(self.key_pos, np.int64).reshape(-1), per),
            "query_sender": pd.Categorical(np.tile(qs[qi], N * K), categories=list(dict.fromkeys(qs))),
            "key_sender": pd.Categorical(np.tile(ks[ki], N * K), categories=list(dict.fromkeys(ks))),
            "term": flat(self.terms, self.alibi),
            "contrast_term": flat(self.contrast, self.alibi_contrast),
        })
        if self.delta is not None:
            out["delta_term"] = flat(self.delta, None)
            out["weight_change"] = flat(self.weight_change, None)
        if self.key_on is not None:
            out = out[np.repeat(to_numpy(self.key_on.reshape(-1), np.bool_), per)].reset_index(drop=True)
        return out

    def pairs(self) -> pd.DataFrame:
        """One row per (query sender, key sender): the mean over prompts and keys of the term, |term|, the
        contrast term (and the change of term and of the weight, with corrupted tokens); largest mean |term|
        first."""
        Sq, Sk = len(self.query_senders), len(self.key_senders)
        mean = lambda t: to_numpy(self._mean(t).flatten(), np.float64)  # noqa: E731  (over the keys, `key_on`)
        cols = {"query_sender": np.repeat(self.query_senders, Sk), "key_sender": np.tile(self.key_senders, Sq),
                "mean_term": mean(self.terms), "mean_abs_term": mean(self.terms.abs()),
                "mean_contrast": mean(self.contrast)}
        if self.delta is not None:
            cols["mean_delta"] = mean(self.delta)
            cols["mean_weight_change"] = mean(self.weight_change)
        out = pd.DataFrame(cols)
        if self.alibi is not None:
            row = {"query_sender": ALIBI, "key_sender": ALIBI, "mean_term": float(self._mean(self.alibi)),
                   "mean_abs_term": float(self._mean(self.alibi.abs())),
                   "mean_contrast": float(self._mean(self.alibi_contrast))}
            if self.delta is not None:
                row.update(mean_delta=0.0, mean_weight_change=0.0)
            out = pd.concat([out, pd.DataFrame([row])], ignore_index=True)
        return out.sort_values("mean_abs_term", ascending=False, kind="stable").reset_index(drop=True)

    def matrix(self, top: int = 6, value: str = "term") -> pd.DataFrame:
        """[top query senders x top key senders] of the mean `value` ("term" or "contrast"), the senders
        ranked by their mean |term| summed over the other side."""
        mag = self._mean(self.terms.abs())  # [Sq, Sk]
        qi = mag.sum(1).argsort(descending=True)[:top].tolist()
        ki = mag.sum(0).argsort(descending=True)[:top].tolist()
        src = self.terms if value == "term" else self.contrast
        m = self._mean(src)[qi][:, ki]
        return pd.DataFrame(to_numpy(m, np.float64), index=[self.query_senders[i] for i in qi],
                            columns=[self.key_senders[i] for i in ki])


# ---- the run ------------------------------------------------------------------------------------------------
def _chain_end(attn) -> tuple[str, str]:
    """The hook points holding the final query and key (after QK-norm and RoPE)."""
    if attn.rotary:
        return "hook_rot_q", "hook_rot_k"
    if attn.qk_norm:
        return "hook_q_normed", "hook_k_normed"
    return "hook_q", "hook_k"


def _capture(model, tokens: Tensor, layer: int, head: int, kv: int, given=None, senders: bool = True) -> dict:
    """One forward up to `layer`: the senders' values below it (`passes._Pass`'s, S of [b, p, d]; not with
    `senders` False: an SAE's features are the senders then), the stream entering it, the norms' scales, the
    rotation, the head's scores, pattern and final q / k. `given`: (values, stream entering `layer`) from a run
    already made (a `Runner`'s cache): then only block `layer` runs."""
    g = Graph(model.cfg)
    block, attn = model.blocks[layer], model.blocks[layer].attn
    pre = f"blocks.{layer}"
    got: dict = {}

    def keep(name, first=False, pick=None):
        def hook(x, hook):
            if not (first and name in got):
                got[name] = x.detach() if pick is None else pick(x).detach()
            return x
        return hook

    hooks = [(f"{pre}.hook_resid_pre", keep("resid")),
             (f"{pre}.attn.hook_attn_scores", keep("scores", pick=lambda x: x[:, head])),
             (f"{pre}.attn.hook_pattern", keep("pattern", pick=lambda x: x[:, head]))]
    if hasattr(block.ln1, "hook_scale"):
        hooks.append((f"{pre}.ln1.hook_scale", keep("ln1", first=True)))
    if attn.qk_norm:
        hooks += [(f"{pre}.attn.q_norm.hook_scale", keep("q_norm")), (f"{pre}.attn.k_norm.hook_scale", keep("k_norm"))]
    qn, kn = _chain_end(attn)
    hooks += [(f"{pre}.attn.{qn}", keep("q", pick=lambda x: x[:, :, head])),
              (f"{pre}.attn.{kn}", keep("k", pick=lambda x: x[:, :, kv]))]
    p = None
    if given is None and senders:
        p = _Pass(model, g)
        receivers = ("hook_q_input", "hook_k_input", "hook_v_input", "hook_mlp_in")  # graph mode's; not needed here
        hooks = [(n, f) for n, f in p.hooks() if not n.endswith(receivers)] + hooks

    def rope(module, args):
        got["rope"] = args[2] if len(args) > 2 else None

    handle = block.register_forward_pre_hook(rope)
    try:
        with torch.no_grad(), model.hooks(hooks):
            if given is None:
                model(tokens.to(model.device), stop_at_layer=layer + 1)
            else:
                model(given[1], start_at_layer=layer, stop_at_layer=layer + 1)
    finally:
        handle.remove()
    if senders:
        below = sum(1 for l in g.sender_layer if l < layer)
        got["values"] = p.values[:below] if given is None else given[0][:below]
    return got


@torch.no_grad()
def _projection(model, layer: int, head: int, kv: int, which: str) -> tuple[Tensor, Tensor]:
    """ln1 (its scale set to 1) then the head's columns of W_Q (or its KV head's of W_K), as the layer's own
    modules compute them on the identity: (matrix [d_model, d_head], constant [d_head]). A norm's output is
    linear part / scale + constant (LayerNorm: centred, times w, plus b; RMSNorm: times w), so with the run's
    scale s at a position, the projection of x there is x @ matrix / s + constant."""
    block, attn = model.blocks[layer], model.blocks[layer].attn
    W, b = (attn.W_Q[head], attn.b_Q[head]) if which == "q" else (attn.W_K[kv], attn.b_K[kv])
    d = model.cfg.d_model
    x = torch.cat([torch.eye(d, dtype=W.dtype, device=W.device), W.new_zeros(1, d)])[None]
    hooks = []
    if hasattr(block.ln1, "hook_scale"):
        hooks.append((f"blocks.{layer}.ln1.hook_scale", lambda t, hook: torch.ones_like(t)))
    with torch.no_grad(), model.hooks(hooks):
        out = block.ln1(x)[0]
    return (out[:-1] - out[-1]) @ W, out[-1] @ W + b


def _side(model, layer: int, head: int, kv: int, y: Tensor, const: Tensor, got: dict, at: tuple[Tensor, Tensor],
          which: str) -> Tensor:
    """The head's query (which="q") or its KV head's key ("k") from y [R, *B, d_head], the rows' projections
    (x @ `_projection`'s matrix), where `at` (prompt, position index tensors of shape B) says where each of
    them sits: [R, *B, d_head], every norm's scale frozen at the run's (ln1's divides; QK-norm and the rotation
    are the layer's own modules, their scales replaced through hook_scale)."""
    attn = model.blocks[layer].attn
    pre = f"blocks.{layer}"
    out = (y / got["ln1"][at].to(y.dtype) if "ln1" in got else y) + const
    with torch.no_grad():
        if attn.qk_norm:  # the head's columns inside the whole projection, the others zero
            norm = attn.q_norm if which == "q" else attn.k_norm
            scale = got[f"{which}_norm"][at]
            n, i = (attn.n_heads, head) if which == "q" else (attn.n_kv_heads, kv)
            full = out.new_zeros(*out.shape[:-1], n, attn.d_head)
            full[..., i, :] = out
            with model.hooks([(f"{pre}.attn.{which}_norm.hook_scale", lambda t, hook: scale.to(t.dtype).expand_as(t))]):
                out = norm(full)[..., i, :]
        if attn.rotary:
            cos, sin = got["rope"]
            rows = at[0] if cos.shape[0] > 1 else torch.zeros_like(at[0])
            out = attn.rotate(out[..., None, :], cos[rows, at[1]], sin[rows, at[1]])[..., 0, :]
    return out


def _projected(values, resid: Tensor, W: Tensor, pick) -> Tensor:
    """The senders' `values` (stacked [S, b, P, d], a Runner's cache, or a list of [b, P, d]) and the stream's
    remainder (`resid` [b, P, d] less their sum: what they leave out, biases) at the places `pick` chooses (a
    function of a [b, P, ...] tensor giving [*B, ...]), projected by W: [S + 2, *B, d_head], the last row zeros."""
    rem = pick(resid).clone()
    if isinstance(values, Tensor):  # stacked: one product
        y = pick(values.movedim(0, 2)).movedim(-2, 0)  # [S, *B, d]
        rem -= y.sum(0)
        y = y @ W
    else:
        picked = [pick(v) for v in values]
        for v in picked:
            rem -= v
        y = torch.stack([v @ W for v in picked])
    r = rem @ W
    return torch.cat([y, r[None], torch.zeros_like(r)[None]])


@torch.no_grad()
def _maps(model, layer: int, head: int, kv: int, got: dict, rows: Tensor, pos: Tensor):
    """Each sender's query at the queries (`rows`, `pos` [n], chunk-relative rows) [Sq, n, d_head] and key at
    every position up to the last query [Sk, b, last + 1, d_head]: the senders' linear parts (the map of the
    output less the map of zero), then `bias` = the map of the stream's remainder (its affine constant in it).
    The key side reads got["key_values"] where there is one (an SAE's features: each side shows its own)."""
    last = int(pos.max()) + 1
    dev = got["resid"].device
    rows, pos = rows.to(dev), pos.to(dev)
    Wk, ck = _projection(model, layer, head, kv, "k")
    Wq, cq = _projection(model, layer, head, kv, "q")
    key_values = got.get("key_values", got["values"])
    yk = _projected(key_values, got["resid"], Wk, lambda t: t[:, :last])  # [Sk + 2, b, last, d_head]
    yq = _projected(got["values"], got["resid"], Wq, lambda t: t[rows, pos])  # [Sq + 2, n, d_head]
    b = got["resid"].shape[0]
    grid = (torch.arange(b, device=dev)[:, None], torch.arange(last, device=dev)[None])
    k = _side(model, layer, head, kv, yk, ck, got, grid, "k")
    q = _side(model, layer, head, kv, yq, cq, got, (rows, pos), "q")  # [S + 2, n, d_head]
    return torch.cat([q[:-2] - q[-1:], q[-2:-1]]), torch.cat([k[:-2] - k[-1:], k[-2:-1]])


@torch.no_grad()
def _query(model, layer: int, head: int, got: dict, maps, n: int, r: int, i: int) -> dict:
    """Query n (chunk row r, position i): its map q [Sq, d_head] and keys K [Sk, i + 1, d_head] (float64), the
    model's score [i + 1] (before a soft cap), visible keys, pattern, ALiBi's term (None without)."""
    attn = model.blocks[layer].attn
    q, K = maps[0][:, n].double(), maps[1][:, r, :i + 1].double()
    score = got["scores"][r, i, :i + 1].double()
    visible = torch.isfinite(score)
    alibi = None
    if attn.alibi_slopes is not None:
        keys = torch.arange(i + 1, device=score.device)
        alibi = (-attn.alibi_slopes[head].float() * (i - keys).abs().float()).double()
    if attn.softcap is not None:  # the raw score, before the cap: from the model's own final q and k
        raw = (got["q"][r, i] @ got["k"][r, :i + 1].T).float().double() * float(attn.scale)
        score = torch.where(visible, raw + (alibi if alibi is not None else 0), score)
    return {"q": q, "K": K, "score": score, "visible": visible, "alibi": alibi,
            "pattern": got["pattern"][r, i, :i + 1].double()}


@torch.no_grad()
def _checked(model, tokens, layer: int, head: int, query_pos, key_pos, top_keys: int, corrupted, rows):
    """`qk_attribution`'s inputs checked, each bad one in one line before any run: (tokens [batch, pos], the row
    of each query, query positions, key positions or None)."""
    check_model(model)
    check_head(model.cfg, layer, head)
    tokens = torch.as_tensor(tokens)
    if tokens.dim() == 1:
        tokens = tokens[None]
    if tokens.dim() != 2 or tokens.is_floating_point():
        raise ValueError(f"tokens: token ids [batch, pos], got shape {tuple(tokens.shape)} ({tokens.dtype})")
    if corrupted is not None and tuple(corrupted.shape) != tuple(tokens.shape):
        raise ValueError(f"corrupted tokens {tuple(corrupted.shape)} differ in shape from the clean {tuple(tokens.shape)}")
    if top_keys < 1:
        raise ValueError(f"top_keys must be at least 1, got {top_keys}")
    B, P = tokens.shape
    rows = torch.as_tensor(torch.arange(B) if rows is None else rows, dtype=torch.long).flatten()
    if rows.numel() == 0 or bool(((rows < 0) | (rows >= B)).any()):
        raise ValueError(f"rows: the row of each query, in 0 .. {B - 1}, got {rows.tolist()[:8]}")
    q_pos, k_pos = _positions(query_pos, key_pos, rows.numel(), P, model.blocks[layer].attn.window)
    return tokens, rows, q_pos, k_pos


def _top_keys(visible: Tensor, pattern: Tensor, top_keys: int) -> Tensor:
    """The `top_keys` keys the query attends to most, by weight (ties in key order): at most the keys it sees,
    each once (never padded with copies: `key_on`)."""
    w = torch.where(visible, pattern, torch.full_like(pattern, -1.0))
    return w.argsort(descending=True, stable=True)[:min(top_keys, int(visible.sum()))]


def _change(c: dict, d: dict, keys: Tensor, T: Tensor, scale: float, cap) -> tuple[dict, float]:
    """One query's clean (`c`) to corrupted (`d`) change, both `_query`'s, at `keys`, T the clean terms
    [K, Sq, Sk]: each pair's change of term, its first-order share of the attention weight's change, their sum
    and the true change (`results`' entries), and max |sum of the changes - the score's change|."""
    score, vis, pat, alibi, q, K = c["score"], c["visible"], c["pattern"], c["alibi"], c["q"], c["K"]
    T2 = scale * torch.einsum("ad,kbd->kab", d["q"], d["K"][:, keys].transpose(0, 1))
    D = T2 - T  # [K, Sq, Sk]
    error = float((D.sum((1, 2)) - (d["score"] - score)[keys]).abs().max())
    # d weight_j = a_j (c'_j dscore_j - sum_k a_k c'_k dscore_k), c' the soft cap's slope (1 without)
    raw = score - (alibi if alibi is not None else 0)
    slope = (1 - torch.tanh(raw / cap) ** 2) if cap is not None else torch.ones_like(score)
    a = torch.where(vis, pat, torch.zeros_like(pat))
    wk = torch.where(vis, a * slope, torch.zeros_like(a))  # [i + 1]
    mixed = scale * (d["q"] @ (wk[None, :, None] * d["K"]).sum(1).T - q @ (wk[None, :, None] * K).sum(1).T)
    Wc = a[keys][:, None, None] * (slope[keys][:, None, None] * D - mixed[None])
    return dict(delta=D.float().cpu(), weight=Wc.float().cpu(), first=Wc.sum((1, 2)).float().cpu(),
                true=(d["pattern"] - pat)[keys].float().cpu()), error


def _stacked(results: dict[int, dict], N: int) -> tuple[dict[str, Tensor | None], Tensor]:
    """The N queries' `results` as [N, K, ...] tensors by entry (None for an entry no query has), a query with
    fewer keys than K padded (key positions with -1, the rest with 0), and key_on [N, K]: which slots are real."""
    K = max(int(results[n]["keys"].numel()) for n in range(N))

    def stack(name, fill=0):
        got = [results[n][name] for n in range(N) if name in results[n]]
        if not got:
            return None
        return torch.stack([torch.cat([t, t.new_full((K - t.shape[0], *t.shape[1:]), fill)]) for t in got])

    names = ("terms", "contrast", "alibi", "alibi_c", "score", "cscore", "pattern", "delta", "weight", "first", "true")
    stacked = {"keys": stack("keys", -1), **{name: stack(name) for name in names}}
    counts = torch.tensor([int(results[n]["keys"].numel()) for n in range(N)])
    return stacked, torch.arange(K)[None] < counts[:, None]


@dataclass(eq=False)
class _Run:
    """One `qk_attribution` call: the head, its inputs (checked), and the SAE whose features are the senders
    (None: the graph's senders)."""

    model: object
    layer: int
    head: int
    kv: int
    tokens: Tensor
    corrupted: Tensor | None
    rows: Tensor
    q_pos: Tensor
    k_pos: Tensor | None
    top_keys: int
    batch_size: int
    given: object
    features: Features | None

    def chunks(self):
        """(the chunk's slice of the prompts, its queries, their chunk-relative rows [n] and positions [n])."""
        B, N = self.tokens.shape[0], self.rows.numel()
        for start in range(0, B, self.batch_size):
            part = slice(start, min(B, start + self.batch_size))
            queries = [n for n in range(N) if part.start <= int(self.rows[n]) < part.stop]
            if queries:
                yield part, queries, self.rows[queries] - start, self.q_pos[queries]

    def capture(self, which: str, part: slice) -> dict:
        """`_capture` of the chunk's clean or corrupted prompts; with an SAE, without the graph's senders."""
        toks = self.tokens if which == "clean" else self.corrupted
        return _capture(self.model, toks[part], self.layer, self.head, self.kv,
                        given=self.given(which, part) if self.given is not None else None,
                        senders=self.features is None)

    def keys(self, n: int, visible: Tensor, pattern: Tensor) -> Tensor:
        """Query n's keys: those asked for, or the `top_keys` it attends to most."""
        return _top_keys(visible, pattern, self.top_keys) if self.k_pos is None else self.k_pos[n].to(visible.device)


# ---- an SAE's features as the senders --------------------------------------------------------------------
@torch.no_grad()
def _feature_rows(run: _Run, got: dict, stream: Stream, at: list[tuple[int, int]], which: str) -> list:
    """At each (chunk row, position) of `at`: (its active features [A], their maps on the head's `which` side
    [A + 3, d_head]: the features', b_dec's and the error's linear parts, then `bias`, the map of zero)."""
    W, c = _projection(run.model, run.layer, run.head, run.kv, which)
    D = stream.W_dec @ W  # [d_sae, d_head]: every feature's decoder row projected, once
    r, p = torch.tensor(at, dtype=torch.long, device=D.device).reshape(-1, 2).unbind(1)
    owner, index, rows, fixed = active_rows(stream, D, W, r, p)
    side = lambda y, where: _side(run.model, run.layer, run.head, run.kv, y, c, got, where, which)  # noqa: E731
    fixed = side(fixed, (r, p))  # [3, M, d_head]: b_dec, error, zero
    lin = side(rows[None], (r[owner], p[owner]))[0] - fixed[2][owner]
    rest = torch.cat([fixed[:2] - fixed[2:], fixed[2:]]).transpose(0, 1)  # [M, 3, d_head]
    counts = torch.bincount(owner, minlength=len(at)).tolist()
    return [(i, torch.cat([f, e])) for i, f, e in zip(index.split(counts), lin.split(counts), rest)]


@torch.no_grad()
def _feature_mass(run: _Run, got: dict, stream: Stream, at: list, mass: dict) -> None:
    """Add to mass["q"] / mass["k"] ([d_sae], float64) each feature's |term| (less the attention scale, the same
    for all) summed over the other side's senders (every active feature, b_dec, error, bias) at each query of
    `at` ((chunk row, position, keys)) and its keys: the ranking only, in float32."""
    qs = _feature_rows(run, got, stream, [(r, i) for r, i, _ in at], "q")
    ks = _feature_rows(run, got, stream, [(r, j) for r, _, keys in at for j in keys], "k")

    def add(side: str, idx: Tensor, m: Tensor) -> None:
        mass.setdefault(side, m.new_zeros(stream.coef.shape[-1], dtype=torch.float64)).index_add_(0, idx, m.double())

    start = 0
    for (iq, Mq), (_, _, keys) in zip(qs, at):
        block, start = ks[start:start + len(keys)], start + len(keys)
        A = (Mq.float() @ torch.cat([Mk for _, Mk in block]).float().T).abs()  # [Aq + 3, sum of (Ak + 3)]
        add("q", iq, A[:len(iq)].sum(1))
        for (ik, Mk), col in zip(block, A.sum(0).split([len(Mk) for _, Mk in block])):
            add("k", ik, col[:len(ik)])


@torch.no_grad()
def _choose_features(run: _Run) -> tuple[list[int], list[int]]:
    """The features shown on the query side and on the key side: each side's `top` by summed |term| over every
    query and key decomposed, in the clean run (`qk_features.choose`)."""
    mass: dict[str, Tensor] = {}
    for part, queries, qr, qi in run.chunks():
        got = run.capture("clean", part)
        stream = split_stream(run.features.sae, got["resid"][:, :int(qi.max()) + 1])
        at = []
        for m, n in enumerate(queries):
            r, i = int(qr[m]), int(qi[m])
            score = got["scores"][r, i, :i + 1]
            at.append((r, i, run.keys(n, torch.isfinite(score), got["pattern"][r, i, :i + 1]).tolist()))
        with run.model.holding(run.layer):
            _feature_mass(run, got, stream, at, mass)
    top = run.features.top
    return choose(mass["q"], top) if mass else [], choose(mass["k"], top) if mass else []


# ---- the decomposition -------------------------------------------------------------------------------------
@torch.no_grad()
def _decomposed(run: _Run, got: dict, maps: dict, m: int, n: int, r: int, i: int, errors: dict) -> dict:
    """Query n (chunk row r, position i; the m-th of its chunk): its keys, terms, contrast terms, score, pattern,
    ALiBi's term, and with corrupted tokens the changes (`_stacked`'s entries); the largest errors in `errors`."""
    attn = run.model.blocks[run.layer].attn
    cap, scale = attn.softcap, float(attn.scale)
    c = _query(run.model, run.layer, run.head, got["clean"], maps["clean"], m, r, i)
    score, vis, pat, alibi, q, K = c["score"], c["visible"], c["pattern"], c["alibi"], c["q"], c["K"]
    keys = run.keys(n, vis, pat)
    T = scale * torch.einsum("ad,kbd->kab", q, K[:, keys].transpose(0, 1))  # [K, Sq, Sk]
    Tc = T - scale * (q @ K[:, vis].mean(1).T)  # less the mean over the visible keys
    a_c = (alibi - alibi[vis].mean()) if alibi is not None else None
    c_score = score - score[vis].mean()
    extra = alibi[keys] if alibi is not None else 0
    errors["terms"] = max(errors["terms"], float((T.sum((1, 2)) + extra - score[keys]).abs().max()))
    c_extra = a_c[keys] if a_c is not None else 0
    errors["contrast"] = max(errors["contrast"], float((Tc.sum((1, 2)) + c_extra - c_score[keys]).abs().max()))
    out = dict(keys=keys.cpu(), terms=T.float().cpu(), contrast=Tc.float().cpu(), score=score[keys].float().cpu(),
               cscore=c_score[keys].float().cpu(), pattern=pat[keys].float().cpu())
    if alibi is not None:
        out.update(alibi=alibi[keys].float().cpu(), alibi_c=a_c[keys].float().cpu())
    if run.corrupted is not None:
        d = _query(run.model, run.layer, run.head, got["corrupted"], maps["corrupted"], m, r, i)
        change, error = _change(c, d, keys, T, scale, cap)
        errors["delta"] = max(errors["delta"], error)
        out.update(change)
    return out


@torch.no_grad()
def _chunk(run: _Run, part: slice, queries: list[int], qr: Tensor, qi: Tensor, chosen, results: dict,
           errors: dict) -> None:
    """One chunk of prompts: its runs (clean, and corrupted), each sender's maps, then each query decomposed
    into `results`. `chosen`: (query-side, key-side) features shown, with an SAE; None without."""
    runs = ["clean"] + (["corrupted"] if run.corrupted is not None else [])
    got, maps = {}, {}
    for which in runs:
        got[which] = run.capture(which, part)
        if chosen is not None:  # the stream as the SAE writes it, each side with its own features shown
            stream = split_stream(run.features.sae, got[which]["resid"][:, :int(qi.max()) + 1])
            got[which]["values"], got[which]["key_values"] = (sender_values(stream, c) for c in chosen)
        with run.model.holding(run.layer):  # an offloaded model's block, held while its weights are read
            maps[which] = _maps(run.model, run.layer, run.head, run.kv, got[which], qr, qi)
    for m, n in enumerate(queries):
        results[n] = _decomposed(run, got, maps, m, n, int(qr[m]), int(qi[m]), errors)


def qk_attribution(model, tokens: Tensor, layer: int, head: int, query_pos, key_pos=None, top_keys: int = 3,
                   corrupted: Tensor | None = None, batch_size: int = 16, rows: Sequence[int] | Tensor | None = None,
                   given=None, sae=None) -> QKAttribution:
    """Decompose head (`layer`, `head`)'s pre-softmax scores at `query_pos` into (query-side sender, key-side
    sender) terms, at `key_pos` (one list for all queries or [queries, K]; None: the `top_keys` keys the head
    attends to most from each query, or every key it sees when it sees fewer: `QKAttribution.key_on`).

    tokens     [batch, pos] token ids (one forward each, up to the head's layer)
    query_pos  one position for every row, or one per query
    rows       the row of `tokens` of each query (default: one query per row); a row may hold several
    corrupted  tokens of the same shape: also each pair's change of term and its first-order share of the
               attention weight's change
    given      (which, chunk slice) -> (senders' values [S, b, p, d], stream entering `layer` [b, p, d]) or
               None: runs already made, for `which` "clean" or "corrupted" (a `Runner`'s cache)
    sae        None (the senders are the graph's: embed, heads, MLPs, bias), or a residual-stream SAE at the
               stream the layer reads (`blocks.{layer}.hook_resid_pre`, or `blocks.{layer-1}.hook_resid_post`;
               an `interp.models.saes.SAE`, a SAELens SAE, or `qk_features.Features(sae, top=...)`): then the
               senders on each side are the features shown there, `F{index}` (the feature's activation times its
               W_dec row; the `top` of largest summed |term|, default 8), `other_features` (the rest of them,
               summed), `b_dec`, `error` (the stream less the SAE's reconstruction) and `bias`; the terms still
               add up to the score, the contrast and the changes work as without (`qk_features`)
    See the module's docstring."""
    tokens, rows, q_pos, k_pos = _checked(model, tokens, layer, head, query_pos, key_pos, top_keys, corrupted, rows)
    features = check_sae(model, layer, sae) if sae is not None else None
    attn = model.blocks[layer].attn
    kv = head // (attn.n_heads // attn.n_kv_heads)
    run = _Run(model, layer, head, kv, tokens, corrupted, rows, q_pos, k_pos, top_keys, batch_size, given, features)
    chosen = _choose_features(run) if features is not None else None
    if chosen is None:
        g = Graph(model.cfg)
        q_senders = k_senders = [s for s, l in zip(g.senders, g.sender_layer) if l < layer] + [BIAS]
    else:
        q_senders, k_senders = (sender_names(c) + [BIAS] for c in chosen)
    results: dict[int, dict] = {}
    errors = {"terms": 0.0, "contrast": 0.0, "delta": 0.0}
    for part, queries, qr, qi in run.chunks():
        _chunk(run, part, queries, qr, qi, chosen, results, errors)
    stack, key_on = _stacked(results, rows.numel())
    return QKAttribution(
        layer=layer, head=head, kv_head=kv, query_senders=list(q_senders), key_senders=list(k_senders),
        prompts=rows.clone(), query_pos=q_pos.cpu(), key_pos=stack["keys"], terms=stack["terms"],
        contrast=stack["contrast"], alibi=stack["alibi"], alibi_contrast=stack["alibi_c"], score=stack["score"],
        contrast_score=stack["cscore"], pattern=stack["pattern"], max_error=errors["terms"],
        contrast_max_error=errors["contrast"], softcapped=attn.softcap is not None, delta=stack["delta"],
        weight_change=stack["weight"], weight_first_order=stack["first"], weight_true=stack["true"],
        delta_max_error=errors["delta"] if corrupted is not None else None,
        key_on=None if bool(key_on.all()) else key_on,
        sae_hook=features.sae.cfg.hook_name if features is not None else None)
