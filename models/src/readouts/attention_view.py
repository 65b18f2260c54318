"""What a view is given, checked, and the model's tensors turned into what `interp.drawing` draws: the
attention pattern view (`pattern_view`) and the streaming statistics view (`stats_view`), as
`ActivationCache.view` (models/src/readouts/activation_cache.py) and `interp.view` (CircuitsVis's arguments) call them.

Every bad input is one `BadValue` / `UserError` before any HTML is built: a token count that is not
the pattern's, NaN or inf, weights outside [0, 1], more than MAX_TOKENS positions, a colour that is
not CSS. Rows that do not sum to 1 are drawn as given under a warning line (never renormalised).
Tensors leave their device here, through `to_numpy`, one byte per weight (`codes_u8`). The HTML, CSS
and JavaScript are `interp.drawing`'s (below the models, numpy and strings only); this module holds
none.
"""

from __future__ import annotations

import re

import numpy as np
import torch

from interp.drawing import View, b64, pattern_page, stats_page
from interp.drawing import codes_u8 as _codes_array

from ..placement.device import to_numpy
from interp.errors import BadValue, UserError

MAX_TOKENS = 4096  # past this a pattern view is tens of MB: the streaming statistics view is the tool
ROW_SUM_TOL = {torch.float16: 2e-2, torch.bfloat16: 2e-2}  # 16-bit softmax rows; everything else 1e-3
_COLOUR = re.compile(r"#[0-9a-fA-F]{3,8}|[a-zA-Z]{1,32}|rgba?\([0-9.,%\s]{1,60}\)|hsla?\([0-9.,%\sdeg]{1,60}\)")


def codes_u8(weights):
    """Attention weights in [0, 1] as uint8 codes, round(A * 255) (`interp.drawing.codes_u8`). A tensor gives
    a uint8 tensor on its own device (one byte per weight then leaves it, through `to_numpy`); an array
    gives an array."""
    if isinstance(weights, torch.Tensor):
        return (weights.float().clamp(0, 1) * 255).round().to(torch.uint8)
    return _codes_array(weights)


# ---- checks: every bad input is one error before any HTML is built ----------------------------------
def check_tokens(tokens, n: int | None = None) -> list[str]:
    if isinstance(tokens, str) or not isinstance(tokens, (list, tuple)):
        raise BadValue(f"tokens must be a list of strings (model.to_str_tokens(text)), got {type(tokens).__name__}")
    bad = [i for i, t in enumerate(tokens) if not isinstance(t, str)]
    if bad:
        raise BadValue(f"tokens must be strings; token {bad[0]} is {type(tokens[bad[0]]).__name__} "
                       f"{tokens[bad[0]]!r} (use model.to_str_tokens)")
    if n is not None and len(tokens) != n:
        raise BadValue(f"{len(tokens)} tokens for a pattern over {n} positions: give one string per position "
                       "(model.to_str_tokens of the same input, with the same BOS choice)")
    return list(tokens)


def _too_long(n: int) -> UserError:
    return UserError(f"{n} tokens is more than a pattern view draws ({MAX_TOKENS}): for long contexts use the "
                     "streaming statistics view, interp.view.stats(model.attention_stats(tokens), str_tokens)")


def check_pattern(tokens, attention, head_names=None) -> tuple[list[str], np.ndarray, list[str], list[str]]:
    """(tokens, float32 [heads, n, n] weights, head names, warning lines) from CircuitsVis's arguments:
    `attention` [heads, dest, src] (or one head's [dest, src]) as a tensor, an array or nested lists.
    Refused: a shape that is not square per head, a token count that is not n, more than MAX_TOKENS
    positions, NaN or inf, weights outside [0, 1]. Rows that do not sum to 1 are kept as given, with a
    warning line naming how many and in which heads (never renormalised)."""
    dtype = attention.dtype if isinstance(attention, torch.Tensor) else None
    if getattr(attention, "dtype", None) == np.float16:  # a numpy half-precision pattern: 16-bit rounding too
        dtype = torch.float16
    if isinstance(attention, torch.Tensor):
        shape = tuple(attention.shape)
    else:
        try:
            attention = np.asarray(attention, dtype=np.float32)
        except (TypeError, ValueError) as e:
            raise BadValue(f"attention must be a [heads, dest, src] tensor or array of numbers ({e})") from None
        shape = attention.shape
    if len(shape) == 2:
        shape = (1, *shape)
        attention = attention[None]
    if len(shape) != 3:
        hint = "; for a cache's [batch, head, q, k] pattern pick one sequence: pattern[0]" if len(shape) == 4 else ""
        raise BadValue(f"attention must be [heads, dest, src] (or one head's [dest, src]), got shape {shape}{hint}")
    heads, dest, src = shape
    if dest != src:
        raise BadValue(f"attention must be square per head (dest == src, one token list for both), got {dest} x {src}")
    if heads < 1 or dest < 1:
        raise BadValue(f"attention is empty (shape {shape})")
    if dest > MAX_TOKENS:
        raise _too_long(dest)
    tokens = check_tokens(tokens, dest)
    names = [f"head {h}" for h in range(heads)] if head_names is None else check_tokens(head_names)
    if len(names) != heads:
        raise BadValue(f"{len(names)} head names for {heads} heads")
    # float32 (4,096 tokens x 9 heads is 600 MB of it; float64 would double that), row sums in float64
    a = to_numpy(attention, np.float32) if isinstance(attention, torch.Tensor) else attention
    finite = np.isfinite(a)
    if not finite.all():
        bad = sorted(set(np.nonzero(~finite)[0].tolist()))
        raise BadValue(f"attention holds NaN or inf in {len(bad)} head(s) ({', '.join(names[h] for h in bad[:6])}): "
                       "a pattern is finite; check the model's weights and inputs")
    lo, hi = float(a.min()), float(a.max())
    if lo < -1e-3 or hi > 1 + 1e-3:
        raise BadValue(f"attention weights must lie in [0, 1] (a softmax pattern), got values from {lo:.4g} to {hi:.4g}")
    sums = a.sum(-1, dtype=np.float64)  # [heads, dest]
    off = np.abs(sums - 1.0) > ROW_SUM_TOL.get(dtype, 1e-3)
    warnings = []
    if off.any():
        per = off.sum(-1)
        worst = float(np.abs(sums - 1.0).max())
        which = ", ".join(f"{names[h]} ({int(per[h])})" for h in np.nonzero(per)[0][:6]) + (" ..." if (per > 0).sum() > 6 else "")
        warnings.append(f"warning: {int(off.sum())} of {heads * dest} rows do not sum to 1 (off by up to {worst:.3g}; "
                        f"per head: {which}): shown as given, not renormalised")
    return tokens, a, names, warnings


def check_colour(name: str, value) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or not _COLOUR.fullmatch(value.strip()):
        raise BadValue(f"{name} must be a CSS colour ('#1f77b4', 'steelblue', 'rgb(31,119,180)'), got {value!r}")
    return value.strip()


# ---- the views ---------------------------------------------------------------------------------------
def pattern_view(tokens, attention, *, head_names=None, title: str | None = None, max_value: float | None = None,
                 min_value: float | None = None, positive_color: str | None = None, negative_color: str | None = None,
                 mask_upper_tri: bool | None = None, show_tokens: bool | None = None, selected: int = 0) -> View:
    """The attention pattern view: a thumbnail per head (click one, or choose it), the chosen head's whole
    pattern (hover it for the query, key and weight), and the tokens (hover one: what it attends to in
    blue, which later tokens attend to it in orange). Arguments as CircuitsVis's `attention_heads`;
    `max_value` is the weight drawn at full colour (default 1), `min_value` must be >= 0 (a pattern has no
    negative weight, so `negative_color` is checked and never drawn)."""
    tokens, a, names, warnings = check_pattern(tokens, attention, head_names)
    top = 1.0 if max_value is None else float(max_value)
    low = 0.0 if min_value is None else float(min_value)
    if not (np.isfinite(top) and np.isfinite(low) and 0 <= low < top):
        raise BadValue(f"min_value and max_value must be finite with 0 <= min_value < max_value, got {low} and {top}")
    colour = check_colour("positive_color", positive_color) or "#1f77b4"
    check_colour("negative_color", negative_color)
    if not isinstance(selected, int) or not 0 <= selected < len(names):
        raise BadValue(f"selected must be a head index in 0..{len(names) - 1}, got {selected!r}")
    codes = codes_u8(a)
    h, n, _ = codes.shape
    causal = not np.triu(codes, 1).any()  # nothing above the diagonal: ship the lower triangle only
    if causal:
        rows, cols = np.tril_indices(n)
        packed = codes[:, rows, cols]  # [heads, n (n + 1) / 2], row-major: row q starts at q (q + 1) / 2
    else:
        packed = codes
    title = title or f"attention: {h} head{'s' * (h > 1)}, {n} tokens"
    payload = dict(tokens=tokens, heads=names, n=n, tri=bool(causal), codes=b64(packed), lo=low, hi=top,
                   colour=colour, mask=bool(mask_upper_tri), show_tokens=show_tokens is not False, selected=selected)
    return pattern_page(payload, title, warnings)


STAT_FIELDS = ("sink", "previous", "induction", "duplicate")  # the grid's choices; the chart draws the first three
PLOTTED = 3


def stats_view(stats: dict, tokens=None, *, batch: int = 0, title: str | None = None) -> View:
    """Per-query attention mass along the sequence, from the streaming statistics (no pattern, so any
    length): `stats` is `model.attention_stats(tokens)`, {layer: AttentionStats}. A grid of layers x
    heads coloured by the chosen statistic's mean (click a head), and that head's sink, previous-token
    and induction mass at every query position (hover for the position and its token)."""
    if not isinstance(stats, dict) or not stats:
        raise BadValue("stats must be model.attention_stats(tokens): a {layer: AttentionStats} dict, non-empty")
    layers = sorted(stats)
    first = stats[layers[0]]
    if not all(hasattr(first, f) for f in STAT_FIELDS):
        raise BadValue(f"stats[{layers[0]}] is a {type(first).__name__}, not AttentionStats (model.attention_stats)")
    b, heads, n = first.sink.shape
    if not isinstance(batch, int) or not 0 <= batch < b:
        raise BadValue(f"batch must be a sequence index in 0..{b - 1}, got {batch!r}")
    if tokens is not None:
        tokens = check_tokens(tokens, n)
    values = np.stack([np.stack([to_numpy(getattr(stats[l], f)[batch], np.float32) for f in STAT_FIELDS])
                       for l in layers])  # [layer, field, head, pos]
    if values.shape[2:] != (heads, n):
        raise BadValue("every layer's statistics must share one shape [batch, heads, positions]")
    bad = ~np.isfinite(values)
    if bad.any():
        l, f, hd, p = (int(x[0]) for x in np.nonzero(bad))
        raise BadValue(f"the statistics hold NaN or inf ({int(bad.sum())} values; first L{layers[l]}H{hd} "
                       f"{STAT_FIELDS[f]} at position {p}): a padded position sees no key, so view one sequence's "
                       "real positions (no padding), with the tokens given")
    means = values.mean(-1)  # [layer, field, head]
    payload = dict(layers=layers, heads=heads, n=n, fields=list(STAT_FIELDS), tokens=tokens,
                   plotted=list(STAT_FIELDS[:PLOTTED]), codes=b64(codes_u8(values[:, :PLOTTED])),  # per position
                   means=[[[round(float(x), 4) for x in hrow] for hrow in frow] for frow in means])
    title = title or f"attention statistics: {len(layers)} layers x {heads} heads, {n} tokens"
    return stats_page(payload, title)
