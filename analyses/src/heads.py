"""Head-type scores over a batch: previous-token, duplicate-token and induction heads; induction on
repeated random tokens (Olsson et al. 2022); the in-context-learning score.

`detect_heads` gives TransformerLens's `detect_head` scores (definitions in `analyses/src/detect.py`) for
a whole batch, two ways that agree to float32 round-off:

* method="streaming": one fused forward; each layer's q/k go through the streaming kernel
  (`interp.kernels.attention_stats`) as the layer is computed, and only per-query numbers are kept.
  No pattern exists at any point, so it runs at long context. The score's sums follow from per-query
  statistics: with a = attention on key 0, c = attention on the query's own position,
      sum_K A   = sum_p 1 - a [exclude_bos] - c [exclude_current] (+ a at p = 0 when both)
      sum_K A*D = sum_p stat_kind - (the excluded entries of D that the stat counted)
      sum_K D   = token counts (p >= 1, or earlier occurrences of tok[p]) minus excluded entries.
* method="pattern": the instrumented path; each layer's pattern is scored inside its hook and dropped.
* method="auto" (the default): "pattern" for short sequences whose per-layer pattern fits in
  `PATTERN_BUDGET_BYTES`, else "streaming". Materialising is a few large matmuls, cheaper than the
  streaming kernel's tiles at short context; past a few hundred tokens streaming wins, and it never
  needs O(pos^2) memory (`interp bench --sections head_scan` times both).
"""

from __future__ import annotations

from typing import Sequence

import pandas as pd

from interp.models.zoo import probes
import torch
from torch import Tensor

from interp.kernels import attention_stats

from ._common import head_frame, pair_mask, token_input, valid_mask
from .detect import DETECTION_PATTERNS, ErrorMeasure, canonical_kind, pattern_scores
from interp.models.readouts.head_statistics import attention_logsumexp, attention_weights_at, for_each_layer_qk, layer_scoring

METHODS = ("auto", "streaming", "pattern")
# "auto" runs "pattern" up to this many tokens per sequence (measured crossovers, `python -m
# interp.benchmarks.head_scan`: ~128 tokens on SmolLM2-135M and rope-gqa-4l, whose grouped K/V the
# pattern path must expand; past 256 on the multi-head attn-only-2l) ...
PATTERN_MAX_LEN = {"gqa": 96, "mha": 256}
PATTERN_BUDGET_BYTES = 256 * 2**20  # ... and for a per-layer scores + pattern of at most this size


def resolve_method(model, tokens: Tensor, method: str) -> str:
    """The scan `method="auto"` runs on these tokens: "pattern" or "streaming"."""
    if method != "auto":
        return method
    b, n = tokens.shape
    pattern_bytes = 2 * b * model.cfg.n_heads * n * n * 4  # float32 scores and pattern of one layer
    limit = PATTERN_MAX_LEN["gqa" if model.cfg.kv_heads < model.cfg.n_heads else "mha"]
    return "pattern" if n <= limit and pattern_bytes <= PATTERN_BUDGET_BYTES else "streaming"


def earlier_occurrences(tokens: Tensor) -> Tensor:
    """long [batch, pos]: how many j < p hold tokens[b, p]. O(n log n) by a stable sort, no [pos, pos] table."""
    batch, n = tokens.shape
    pos = torch.arange(n, device=tokens.device)
    order = torch.argsort(tokens.long() * n + pos, dim=1)  # by token, then position
    sorted_tok = tokens.gather(1, order)
    starts = torch.ones_like(sorted_tok, dtype=torch.bool)
    starts[:, 1:] = sorted_tok[:, 1:] != sorted_tok[:, :-1]
    group_start = torch.where(starts, pos, torch.zeros_like(pos)).cummax(dim=1).values
    return torch.empty_like(order).scatter_(1, order, pos - group_start)


def _stream_terms(kind: str, st, a0: Tensor, diag: Tensor, tokens: Tensor, count: Tensor, xb: float, xc: float):
    """(sum_K A * D, sum_K D) per query [batch, head, pos] for one kind; see the module docstring."""
    n = tokens.shape[1]
    p = torch.arange(n, device=tokens.device)
    if kind == "previous_token":
        at_one = (p == 1).float()
        return st.previous - xb * at_one * a0, ((p >= 1).float() - xb * at_one)[None, None]
    if kind == "duplicate_token":
        first = ((p > 0) & (tokens == tokens[:, :1])).float()[:, None]  # D[p, 0] = 1
        return st.duplicate - xb * first * a0, count[:, None] - xb * first
    own = torch.zeros_like(tokens, dtype=torch.bool)
    own[:, 1:] = tokens[:, 1:] == tokens[:, :-1]  # induction's D[p, p] = 1
    own = own.float()[:, None]
    return st.induction - xc * own * diag, count[:, None] - xc * own


def detect_heads(
    model,
    tokens,
    kinds: Sequence[str] = ("previous_token", "duplicate_token", "induction"),
    method: str = "auto",
    *,
    exclude_bos: bool = False,
    exclude_current_token: bool = False,
    error_measure: ErrorMeasure = "mul",
    attention_mask: Tensor | None = None,
    backend: str = "auto",
) -> pd.DataFrame:
    """TransformerLens `detect_head` scores of every head for several kinds, over a batch.

    tokens [batch, pos] (each row a prompt; scores are the mean of the per-row scores, as
    `detect_head` averages a list of prompts). Right padding may be given by `attention_mask`.
    method: "streaming" (no pattern; long context), "pattern" (materialised, one layer at a time), or
    "auto": the faster of the two where memory allows (see the module docstring); the frame's
    `method` column says which ran.
    backend: the kernel backend for "streaming": "auto" (Triton on CUDA when installed, else torch), "torch", "triton".

    Returns a DataFrame: layer, head, kind, score, method, exclude_bos, exclude_current_token,
    error_measure, n_sequences, seq_len."""
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    if error_measure not in ("mul", "abs"):
        raise ValueError(f"error_measure must be 'mul' or 'abs', got {error_measure!r}")
    kinds = [canonical_kind(k) for k in ([kinds] if isinstance(kinds, str) else kinds)]
    tokens, attention_mask = token_input(model, tokens, attention_mask)
    valid = valid_mask(tokens, attention_mask, right_padded_only=True)
    method = resolve_method(model, tokens, method)
    runner = _streaming_scores if method == "streaming" else _pattern_scores
    scores = runner(model, tokens, valid, kinds, exclude_bos, exclude_current_token, error_measure, attention_mask, backend)
    settings = dict(
        method=method, exclude_bos=exclude_bos, exclude_current_token=exclude_current_token,
        error_measure=error_measure, n_sequences=tokens.shape[0], seq_len=tokens.shape[1],
    )
    frames = [head_frame(scores[k], "score", kind=k, **settings) for k in kinds]
    return pd.concat(frames, ignore_index=True)[["layer", "head", "kind", "score", *settings]]


# The statistics the detection scores read: mass on key 0 (sink, n_sink=1), previous, duplicate, induction.
DETECT_STATS = ("sink", "previous", "duplicate", "induction")


class DetectStream:
    """The streaming detection scores, one layer at a time: `layer(layer, q, k, st, padding)` with `st` the
    layer's `attention_stats(..., n_sink=1)` (at least DETECT_STATS), `scores()` at the end. What
    `detect_heads(method="streaming")` runs, alone or in one pass with other analyses
    (`interp.analyses.atlas.atlas_pass`)."""

    stats = DETECT_STATS

    def __init__(self, model, tokens, valid, kinds, xb, xc, measure):
        cfg = model.cfg
        self.model, self.tokens, self.kinds = model, tokens, kinds
        self.xb, self.xc, self.measure = xb, xc, measure
        self.out = {k: torch.empty(cfg.n_layers, cfg.n_heads) for k in kinds}
        self.count = earlier_occurrences(tokens).float()
        self.qmask = valid[:, None].float()  # [batch, 1, pos]
        self.size = valid.sum(-1, keepdim=True).float()  # [batch, 1]

    def layer(self, layer, q, k, st, padding) -> None:
        xb, xc, qmask = self.xb, self.xc, self.qmask
        a0 = st.sink
        diag = torch.zeros_like(a0)
        if xc:
            scoring = layer_scoring(self.model, layer)
            lse = attention_logsumexp(q, k, scoring, key_padding_mask=padding)
            diag = attention_weights_at(q, k, lse, None, scoring, key_padding_mask=padding)
        p0 = torch.zeros_like(a0)
        p0[..., 0] = 1.0
        row_a = 1 - xb * a0 - xc * diag + xb * xc * p0 * a0
        sum_a = (torch.nan_to_num(row_a) * qmask).sum(-1)
        for kind in self.kinds:
            ad, d = _stream_terms(kind, st, a0, diag, self.tokens, self.count, float(xb), float(xc))
            sum_ad = (torch.nan_to_num(ad) * qmask).sum(-1)
            if self.measure == "mul":
                per_seq = sum_ad / sum_a
            else:
                sum_d = (d * qmask).sum(-1)
                per_seq = 1 - (sum_a + sum_d - 2 * sum_ad) / self.size
            self.out[kind][layer] = per_seq.mean(0).cpu()

    def scores(self) -> dict[str, Tensor]:
        return self.out


def layer_pass(model, tokens, consumers, *, valid, attention_mask=None, backend: str = "auto"):
    """ONE fused forward: each layer's `attention_stats` (n_sink=1; the union of what `consumers` read,
    their `.stats`) computed once and handed to every consumer's `layer(layer, q, k, st, padding)`, or
    `layer(layer, q, k, v, st, padding)` for consumers with `wants_v`. Returns the forward's output (the
    residual stream after the last layer, for a native model)."""
    padding = None if bool(valid.all()) else valid
    wanted = tuple(dict.fromkeys(name for c in consumers for name in c.stats))

    def fn(layer, q, k, v):
        st = attention_stats(q, k, tokens, layer_scoring(model, layer), n_sink=1, key_padding_mask=padding,
                             backend=backend, stats=wanted) if wanted else None
        for c in consumers:
            if getattr(c, "wants_v", False):
                c.layer(layer, q, k, v, st, padding)
            else:
                c.layer(layer, q, k, st, padding)

    return for_each_layer_qk(model, tokens, fn, attention_mask=attention_mask)


def _streaming_scores(model, tokens, valid, kinds, xb, xc, measure, attention_mask, backend) -> dict[str, Tensor]:
    stream = DetectStream(model, tokens, valid, kinds, xb, xc, measure)
    layer_pass(model, tokens, [stream], valid=valid, attention_mask=attention_mask, backend=backend)
    return stream.scores()


def _pattern_scores(model, tokens, valid, kinds, xb, xc, measure, attention_mask, backend) -> dict[str, Tensor]:
    cfg = model.cfg
    out = {k: torch.empty(cfg.n_layers, cfg.n_heads) for k in kinds}
    detections = {k: DETECTION_PATTERNS[k](tokens) for k in kinds}
    qvalid = None if bool(valid.all()) else valid

    def score(x: Tensor, hook) -> None:
        layer = int(hook.name.split(".")[1])
        for k in kinds:
            s = pattern_scores(
                x, detections[k], exclude_bos=xb, exclude_current_token=xc, error_measure=measure, query_valid=qvalid
            )
            out[k][layer] = s.mean(0).cpu()

    hooks = [(f"blocks.{l}.attn.hook_pattern", score) for l in range(cfg.n_layers)]
    with torch.no_grad():
        model.run_with_hooks(tokens, fwd_hooks=hooks, attention_mask=attention_mask, stop_at_layer=cfg.n_layers)
    return out


# ---- induction on repeated random tokens (Olsson et al. 2022) -----------------------------------


def repeated_random_tokens(
    d_vocab: int, seq_len: int, n_repeats: int, batch_size: int, *, seed: int = 0, bos_token_id: int | None = None
) -> Tensor:
    """long [batch, (1 +) seq_len * n_repeats]: a uniform random sequence (never the BOS id) repeated,
    after BOS when `bos_token_id` is given."""
    low = 0 if bos_token_id is None else 1  # with a BOS, ids start at 1 and 0 stands in for a drawn BOS id
    return probes.repeated_random_tokens(batch_size, seq_len, d_vocab, low=low, n_repeats=n_repeats, seed=seed,
                                         bos=bos_token_id)


def induction_scores(
    model, seq_len: int = 50, n_repeats: int = 2, batch_size: int = 10, seed: int = 0, prepend_bos: bool = True,
    bos_token_id: int | None = None,
) -> pd.DataFrame:
    """Olsson et al. (2022) head scores on repeated random tokens, averaged over the destinations in
    the repeats only (copies 2..n_repeats; never the first copy, where nothing can be matched).

    With L = seq_len and destination p in copy r >= 1 (of copies 0..n_repeats-1):
        induction       A[p, p - L + 1]: the token after the current token's previous occurrence
                        (the induction stripe, as in TransformerLens's tutorials).
        prefix_matching sum over every earlier copy m = 1..r of A[p, p - mL + 1] (Olsson's "prefix
                        matching": attention to tokens that followed earlier copies of the current
                        token); equals `induction` when n_repeats = 2.
        duplicate_token A[p, p - L]: the current token's previous occurrence.
        previous_token  A[p, p - 1].
    BOS (`bos_token_id`, default the tokenizer's or 0) is prepended when `prepend_bos`.

    Returns layer, head, kind, score and the settings; `.attrs` holds the mean next-token loss on the
    first copy ("loss_first_copy") and on the repeats ("loss_repeats"), which should be far lower
    for a model with induction heads."""
    cfg = model.cfg
    if bos_token_id is None and prepend_bos:
        bos_token_id = getattr(model.tokenizer, "bos_token_id", None) or 0
    tokens = repeated_random_tokens(
        cfg.d_vocab, seq_len, n_repeats, batch_size, seed=seed, bos_token_id=bos_token_id if prepend_bos else None
    ).to(model.device)
    off, L, n = int(prepend_bos), seq_len, tokens.shape[1]
    dest = torch.arange(off + L, n, device=model.device)
    copy = (dest - off) // L
    names = ("induction", "prefix_matching", "duplicate_token", "previous_token")
    out = {k: torch.empty(cfg.n_layers, cfg.n_heads) for k in names}

    def stripe(a: Tensor, dest: Tensor, src: Tensor, ok: Tensor) -> Tensor:
        idx = src.clamp(min=0).view(1, 1, -1, 1).expand(a.shape[0], a.shape[1], -1, 1)
        return a[:, :, dest].gather(-1, idx)[..., 0] * ok  # [batch, head, dest]

    def score(a: Tensor, hook) -> None:
        layer = int(hook.name.split(".")[1])
        here, copies = dest.to(a.device), copy.to(a.device)  # the layer's device (a model split by device_map)
        every = torch.ones_like(here, dtype=torch.bool)
        prefix = sum(stripe(a, here, here - m * L + 1, copies >= m) for m in range(1, n_repeats))
        for k, v in zip(names, (stripe(a, here, here - L + 1, every), prefix, stripe(a, here, here - L, every),
                                stripe(a, here, here - 1, every))):
            out[k][layer] = v.mean((0, 2)).cpu()

    hooks = [(f"blocks.{l}.attn.hook_pattern", score) for l in range(cfg.n_layers)]
    with torch.no_grad():
        nll = model.run_with_hooks(tokens, fwd_hooks=hooks, return_type="loss", loss_per_token=True)
    target = torch.arange(1, n, device=nll.device)  # nll[:, t - 1] is the loss of token t
    settings = dict(seq_len=seq_len, n_repeats=n_repeats, batch_size=batch_size, seed=seed, prepend_bos=prepend_bos)
    frame = pd.concat([head_frame(out[k], "score", kind=k, **settings) for k in names], ignore_index=True)
    frame.attrs["loss_first_copy"] = float(nll[:, target < off + L].mean()) if L > 1 or off else float("nan")
    frame.attrs["loss_repeats"] = float(nll[:, target >= off + L].mean())
    return frame


# ---- in-context learning score (Olsson et al. 2022) ---------------------------------------------


def _nll_at(model, tokens: Tensor, positions, attention_mask: Tensor | None, resid: Tensor | None = None) -> Tensor:
    """[batch, pos - 1] per-token losses, filled at the given token positions only (0 elsewhere): the
    forward stops before the unembedding, and only those rows are unembedded, since a full [pos, vocab]
    logit table costs more than the whole forward at long context (32k tokens x Gemma's 262k vocabulary:
    11 TFLOP). Each row's log-softmax is the one `lm_loss` computes. `resid`: that forward's output (the
    residual stream after the last layer, [batch, pos, d_model]) when another pass already made it
    (`interp.analyses.atlas.atlas_pass`); native models only."""
    batch, n = tokens.shape
    at = torch.tensor(positions, device=tokens.device)
    with torch.no_grad():
        if getattr(model, "native", True):
            if resid is None:
                resid = model(tokens, attention_mask=attention_mask, stop_at_layer=model.cfg.n_layers)
            logits = model.unembed(model.ln_final(resid[:, (at - 1).to(resid.device)]))  # [batch, len(at), vocab]
        else:  # a wrapped model's logits are transformers' (with its own final scalings): all rows, then picked
            logits = model(tokens, attention_mask=attention_mask)[:, at - 1]
        picked = torch.log_softmax(logits.float(), -1).gather(-1, tokens[:, at, None].to(logits.device))[..., 0]
    nll = torch.zeros(batch, n - 1, device=tokens.device)  # where the tokens are (a split model's logits: the last device)
    nll[:, at - 1] = -picked.to(tokens.device)
    return nll


def icl_score(model, tokens, early: int = 50, late: int | None = None, *,
              attention_mask: Tensor | None = None, resid: Tensor | None = None) -> pd.DataFrame:
    """Olsson et al. (2022)'s in-context learning score: the loss on the token at index `late` minus
    the loss on the token at index `early` (0-based positions in the context; the loss of token t is
    the cross-entropy of predicting it from tokens[:t]), averaged over sequences.

    Sign: NEGATIVE means in-context learning (later tokens are predicted better). `late=None` is the
    last position of the sequences (Olsson et al. use 500 on 512-token contexts); a `late` beyond the
    sequences is an error, never clipped. early must be in [1, late).
    With `attention_mask`, sequences where either token is padding are skipped. `resid`: the residual
    stream after the last layer of a forward over these tokens, when one was already run (the atlas's
    shared pass); the losses are then read from it instead of a forward.

    Returns one row: early, late, loss_early, loss_late, icl_score, n_sequences."""
    tokens, attention_mask = token_input(model, tokens, attention_mask)
    n = tokens.shape[1]
    if late is None:
        late = n - 1
    if late > n - 1:
        raise ValueError(f"late={late} is beyond the {n}-token sequences (last position {n - 1}); use longer "
                         f"sequences, or late=None for the last position")
    if not 1 <= early < late:
        raise ValueError(f"need 1 <= early < late within the {n}-token sequences; got early={early}, late={late}. "
                         "Use longer sequences or a smaller `early`.")
    valid = valid_mask(tokens, attention_mask)
    nll = _nll_at(model, tokens, (early, late), attention_mask, resid)
    ok = pair_mask(valid)
    got = probes.icl_from_losses(nll, early, late, rows=ok[:, early - 1] & ok[:, late - 1])
    return pd.DataFrame(
        [dict(early=early, late=late, loss_early=got["loss_early"], loss_late=got["loss_late"],
              icl_score=got["icl"], n_sequences=got["n_sequences"])]
    )
