"""Head detection against a detection pattern: TransformerLens's `detect_head`, rewritten.

Definitions (TransformerLens `transformer_lens.head_detector`, after the "Exploratory Analysis Demo"
heads of Nanda): a detection pattern D[p, j] (lower triangular, [pos, pos]) marks the (query, key)
pairs a head of that kind attends to:

    previous_token  D[p, j] = 1  iff  j = p - 1
    duplicate_token D[p, j] = 1  iff  j < p and tok[j] = tok[p]
    induction       D[p, j] = 1  iff  1 <= j <= p and tok[j - 1] = tok[p]
                    (the duplicate pattern shifted one key to the right, first column zero)

and a head with pattern A [pos, pos] scores, over the kept entries K (all of the lower triangle,
minus column 0 with `exclude_bos`, minus the diagonal with `exclude_current_token`):

    "mul":  sum_K A * D / sum_K A          (the share of the head's attention that D predicts)
    "abs":  1 - sum_K |A - D| / pos        (1 perfect, -1 perfectly wrong)

Several prompts: the mean of the per-prompt scores. Differences from TransformerLens: the cached
pattern is only read (releases before 4.3 zeroed its columns in place), every option applies to every
prompt of a list (older releases dropped them), named patterns dispatch through a dict (TL `eval`s a
function name), `seq_len == n_ctx` is accepted (TL asserts seq_len < n_ctx), and the "abs" score is
not rounded to 3 decimals (TL rounds it). Otherwise the numbers are TL's (tests/analyses/test_detect.py
runs TL's detect_head on a TransformerBridge of the same weights).
"""

from __future__ import annotations

import warnings
from typing import Callable, Literal, Union

import pandas as pd
import torch
from torch import Tensor

from ._common import head_frame, resolve_heads, token_batch

ErrorMeasure = Literal["mul", "abs"]
HeadKind = Literal["previous_token", "duplicate_token", "induction"]

# TransformerLens's names ("previous_token_head", ...) and ours ("previous_token", ...).
KIND_ALIASES = {
    "previous_token_head": "previous_token",
    "duplicate_token_head": "duplicate_token",
    "induction_head": "induction",
    "previous_token": "previous_token",
    "duplicate_token": "duplicate_token",
    "induction": "induction",
    "previous": "previous_token",
    "duplicate": "duplicate_token",
}


def canonical_kind(kind: str) -> str:
    try:
        return KIND_ALIASES[kind]
    except KeyError:
        raise ValueError(
            f"unknown head kind {kind!r}; choose one of 'previous_token', 'duplicate_token', 'induction' "
            "(TransformerLens's '..._head' names work too), or pass a detection pattern tensor"
        ) from None


# ---- detection patterns: tokens [batch, pos] -> float [batch, pos, pos] --------------------------


def previous_token_pattern(tokens: Tensor) -> Tensor:
    n = tokens.shape[-1]
    eye = torch.ones(n - 1, device=tokens.device).diag(-1) if n > 1 else torch.zeros(1, 1, device=tokens.device)
    return eye.expand(tokens.shape[0], n, n).clone()


def duplicate_token_pattern(tokens: Tensor) -> Tensor:
    same = tokens[:, :, None] == tokens[:, None, :]  # [batch, p, j]
    return torch.tril(same.float(), diagonal=-1)


def induction_pattern(tokens: Tensor) -> Tensor:
    dup = duplicate_token_pattern(tokens)
    out = torch.zeros_like(dup)
    out[:, :, 1:] = dup[:, :, :-1]  # D[p, j] = dup[p, j - 1]; nonzero only for j <= p
    return out


DETECTION_PATTERNS: dict[str, Callable[[Tensor], Tensor]] = {
    "previous_token": previous_token_pattern,
    "duplicate_token": duplicate_token_pattern,
    "induction": induction_pattern,
}


def detection_pattern(kind: str, tokens: Tensor) -> Tensor:
    """The [batch, pos, pos] (or [pos, pos] for 1-d tokens) detection pattern of a named head kind."""
    fn = DETECTION_PATTERNS[canonical_kind(kind)]
    return fn(tokens[None])[0] if tokens.dim() == 1 else fn(tokens)


# ---- scoring a materialised pattern -------------------------------------------------------------


def keep_mask(n: int, exclude_bos: bool, exclude_current_token: bool, device=None) -> Tensor:
    """bool [pos, pos]: the lower-triangular entries that are scored."""
    keep = torch.ones(n, n, dtype=torch.bool, device=device).tril()
    if exclude_bos:
        keep[:, 0] = False
    if exclude_current_token:
        keep.fill_diagonal_(False)
    return keep


def pattern_scores(
    pattern: Tensor, detection: Tensor, *, exclude_bos: bool = False, exclude_current_token: bool = False,
    error_measure: ErrorMeasure = "mul", query_valid: Tensor | None = None,
) -> Tensor:
    """Per-sequence scores [batch, head] of patterns [batch, head, pos, pos] against detection
    patterns [batch or 1, pos, pos]. `query_valid` [batch, pos] drops padding queries (right padding).
    Reads `pattern` only (never edits it)."""
    if error_measure not in ("mul", "abs"):
        raise ValueError(f"error_measure must be 'mul' or 'abs', got {error_measure!r}")
    n = pattern.shape[-1]
    keep = keep_mask(n, exclude_bos, exclude_current_token, pattern.device).float()[None]  # [1, p, j]
    if query_valid is not None:
        keep = keep * query_valid.to(pattern.device)[:, :, None].float()
    keep = keep[:, None]  # [batch, 1, p, j]
    # the detection pattern is made once from the tokens; a layer of a model split over devices scores on its own
    a, d = pattern.float(), detection.to(pattern.device).float()[:, None]
    if error_measure == "mul":
        return (a * d * keep).sum((-1, -2)) / (a * keep).sum((-1, -2))
    size = n if query_valid is None else query_valid.sum(-1, keepdim=True).float()
    return 1 - ((a - d).abs() * keep).sum((-1, -2)) / size


# ---- the TransformerLens-compatible entry point -------------------------------------------------


def _prompts(model, seq, prepend_bos: bool | None) -> list[Tensor]:
    """Each prompt as [1, pos] token ids: a string, a list of strings, or token ids [pos] / [batch, pos]."""
    if isinstance(seq, str):
        return [model.to_tokens(seq, prepend_bos=prepend_bos)]
    if isinstance(seq, (list, tuple)) and seq and isinstance(seq[0], str):
        return [model.to_tokens(s, prepend_bos=prepend_bos) for s in seq]
    tokens = token_batch(model, seq)
    return [row[None] for row in tokens]


def detect_head(
    model,
    seq: Union[str, list, Tensor],
    detection_pattern: Union[Tensor, str],
    heads=None,
    cache=None,
    *,
    exclude_bos: bool = False,
    exclude_current_token: bool = False,
    error_measure: ErrorMeasure = "mul",
    prepend_bos: bool | None = None,
) -> Tensor:
    """Score every head (or `heads`) against a detection pattern, as TransformerLens's `detect_head`.

    model               an `interp.HookedTransformer`.
    seq                 a string, a list of strings (each scored alone, scores averaged), or token ids
                        [pos] / [batch, pos] (each row a prompt). Strings get BOS first per
                        `prepend_bos` (None: the model's `cfg.default_prepend_bos`, as
                        TransformerLens's `to_tokens` does).
    detection_pattern   "previous_token_head" | "duplicate_token_head" | "induction_head" (or the short
                        names), or a lower-triangular tensor [pos, pos] (one prompt only).
    heads               [(layer, head), ...] or {layer: [head, ...]}; the other heads score -1.
    cache               an `ActivationCache` of this one prompt (patterns [head, pos, pos] or
                        [1, head, pos, pos]); it is read, never modified.
    exclude_bos / exclude_current_token / error_measure: see the module docstring.

    Returns float32 [n_layers, n_heads]. `detect_head_frame` gives the same as a DataFrame."""
    cfg = model.cfg
    prompts = _prompts(model, seq, prepend_bos)
    if not prompts:
        raise ValueError("seq is empty: give a string, a list of strings or token ids")
    if cache is not None and len(prompts) > 1:
        raise ValueError("a cache holds one prompt's activations; with several prompts, omit `cache`")
    named = isinstance(detection_pattern, str)
    if named:
        kind = canonical_kind(detection_pattern)
    elif len(prompts) > 1 and len({p.shape[-1] for p in prompts}) > 1:
        raise ValueError("a detection pattern tensor fits one sequence length; the prompts have several")
    if error_measure not in ("mul", "abs"):
        raise ValueError(f"error_measure must be 'mul' or 'abs', got {error_measure!r}")
    pairs = resolve_heads(cfg.n_layers, cfg.n_heads, heads)
    layers = sorted({l for l, _ in pairs})

    per_prompt = []
    for tokens in prompts:
        n = tokens.shape[-1]
        if not 2 <= n <= cfg.n_ctx:
            raise ValueError(f"each prompt needs 2 to n_ctx={cfg.n_ctx} tokens, got {n}")
        if named:
            det = DETECTION_PATTERNS[kind](tokens)
        else:
            det = _check_pattern(detection_pattern, n, error_measure)[None].to(tokens.device)
        patterns = _patterns(model, tokens, layers, cache)
        scores = -torch.ones(cfg.n_layers, cfg.n_heads)
        for l in layers:
            s = pattern_scores(
                patterns[l], det, exclude_bos=exclude_bos, exclude_current_token=exclude_current_token,
                error_measure=error_measure,
            )[0]
            for _, h in (p for p in pairs if p[0] == l):
                scores[l, h] = s[h]
        per_prompt.append(scores)
    return torch.stack(per_prompt).mean(0)


def detect_head_frame(model, seq, detection_pattern, heads=None, **kwargs) -> pd.DataFrame:
    """`detect_head` as a tidy DataFrame: layer, head, kind, score, and the settings."""
    scores = detect_head(model, seq, detection_pattern, heads, **kwargs)
    kind = canonical_kind(detection_pattern) if isinstance(detection_pattern, str) else "custom"
    frame = head_frame(scores, "score", kind=kind, method="pattern", **{k: v for k, v in kwargs.items() if k != "cache"})
    if heads is not None:
        frame = frame[frame["score"] != -1].reset_index(drop=True)
    return frame


def _check_pattern(pattern: Tensor, n: int, error_measure: str) -> Tensor:
    if not isinstance(pattern, Tensor) or tuple(pattern.shape) != (n, n):
        shape = tuple(pattern.shape) if isinstance(pattern, Tensor) else type(pattern).__name__
        raise ValueError(f"the detection pattern must be a [pos, pos] = [{n}, {n}] tensor for this prompt, got {shape}")
    if bool((pattern.triu(1) != 0).any()):
        raise ValueError("the detection pattern must be lower triangular (a query attends to itself and earlier keys only)")
    if error_measure == "mul" and not set(pattern.unique().tolist()) <= {0, 1}:
        warnings.warn("error_measure='mul' with a detection pattern holding values other than 0 and 1", stacklevel=3)
    return pattern.float()


def _patterns(model, tokens: Tensor, layers: list[int], cache) -> dict[int, Tensor]:
    """Patterns [1, head, pos, pos] of `layers`, from the cache or one instrumented forward."""
    if cache is None:
        names = [f"blocks.{l}.attn.hook_pattern" for l in layers]
        _, cache = model.run_with_cache(tokens, names_filter=names, stop_at_layer=layers[-1] + 1)
    out = {}
    for l in layers:
        p = cache["pattern", l]
        p = p[None] if p.dim() == 3 else p
        if p.shape[0] != 1 or p.shape[-1] != tokens.shape[-1]:
            raise ValueError(
                f"the cached pattern of layer {l} has shape {tuple(p.shape)}, which does not fit one prompt of "
                f"{tokens.shape[-1]} tokens; pass the cache of this prompt, or omit it"
            )
        out[l] = p
    return out
