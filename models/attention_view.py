"""Attention as a self-contained HTML view: a notebook cell (`_repr_html_`: Jupyter, JupyterLab, VS Code),
a page (`View.save`), or a block of a report. Nothing is fetched: the CSS and JavaScript are inline, and
a pattern travels as 8-bit codes (`codes_u8`: A * 255, rounded; the report viewer's packing), base64,
only the lower triangle when the pattern is causal; at 1,024 tokens x 9 heads that is 6.3 MB of page.

Why this lives in `models/` and not in the user surface: `ActivationCache.view` (models/cache.py) must
draw, and a lower layer never imports a higher one. The alternative, a slot in models that
`interp.view` fills when imported, would leave `cache.view` empty until someone imported that module
(`import interp` is lazy, PEP 562) and make a method's behaviour depend on import order. The drawing
needs numpy and strings only, so it moved down, as ARCHITECTURE.md asks: the report viewer
(`analyses/registry/viewer.py`) takes its packing and JavaScript helpers (`COMMON_JS`) from here, and
`interp.view` re-exports the views with CircuitsVis's argument names and adds the atlas's head grid.

Token strings and head names come from strangers: they reach the page only inside JSON that cannot
close its script element (`inline_json`) and are put on the page with `textContent` (never as markup),
control characters and bidirectional marks drawn as visible symbols (`tokenText` below), each token
isolated (`unicode-bidi: isolate`) so one cannot reorder its neighbours. Titles and warning lines are
HTML-escaped here. Each view has its own random id, so two views in one notebook never share state.
"""

from __future__ import annotations

import base64
import html
import json
import os
import re
import secrets
from pathlib import Path

import numpy as np
import torch

from .device import to_numpy
from .errors import BadValue, UserError

MAX_TOKENS = 4096  # past this a pattern view is tens of MB: the streaming statistics view is the tool
GENERATOR = "interp.view"  # the page's <meta name="generator">: how `save` knows a file is one it wrote
ROW_SUM_TOL = {torch.float16: 2e-2, torch.bfloat16: 2e-2}  # 16-bit softmax rows; everything else 1e-3
_COLOUR = re.compile(r"#[0-9a-fA-F]{3,8}|[a-zA-Z]{1,32}|rgba?\([0-9.,%\s]{1,60}\)|hsla?\([0-9.,%\sdeg]{1,60}\)")


def inline_json(value) -> str:
    """`value` as JSON safe inside an HTML <script> element: `<`, `>` and `&` (which JSON only has inside
    strings) become `\\u003c`, `\\u003e`, `\\u0026`, so no data can close the script (`</script>`), open a
    comment (`<!--`) or a nested script; JSON.parse reads the same value back."""
    return json.dumps(value).replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def codes_u8(weights):
    """Attention weights in [0, 1] as uint8 codes, round(A * 255): the packing of the report viewer and of
    every view here, decoded as code / 255 (within 0.002). A tensor gives a uint8 tensor on its own device
    (one byte per weight then leaves it, through `to_numpy`); an array gives an array."""
    if isinstance(weights, torch.Tensor):
        return (weights.float().clamp(0, 1) * 255).round().to(torch.uint8)
    c = np.clip(np.asarray(weights, np.float32), 0.0, 1.0)  # one float32 copy, scaled and rounded in place
    c *= 255.0
    return np.rint(c, out=c).astype(np.uint8)  # half to even, as torch.round


def b64(codes: np.ndarray) -> str:
    return base64.b64encode(np.ascontiguousarray(codes).tobytes()).decode()


class View:
    """A rendered view: shown inline by Jupyter (`_repr_html_`), or written as a page (`save`).

    `warnings` holds the lines the view shows above itself (rows that do not sum to 1, ...)."""

    def __init__(self, fragment: str, title: str, warnings: list[str] | tuple = ()) -> None:
        self.fragment = fragment
        self.title = title
        self.warnings = list(warnings)

    def _repr_html_(self) -> str:
        return self.fragment

    def html(self) -> str:
        """The whole page `save` writes: the fragment in a minimal document (UTF-8, no external asset)."""
        return (f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><meta name="generator" content="{GENERATOR}">'
                f"<title>{html.escape(self.title)}</title></head>"
                f'<body style="font-family:system-ui,sans-serif;margin:1em">{self.fragment}</body></html>\n')

    def save(self, path, overwrite: bool = False) -> Path:
        """Write the page to `path` (atomically) and return it. A file already there is replaced only if
        it is a page interp.view wrote (its generator tag) or with `overwrite=True`: a file we did not
        write is never overwritten by accident."""
        path = Path(path)
        if path.is_dir():
            raise UserError(f"{path} is a folder: give a file name such as {path / 'attention.html'}")
        if path.exists() and not overwrite and not _ours(path):
            raise UserError(f"{path} exists and interp.view did not write it: pick another name, or pass "
                            "overwrite=True to replace it")
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(self.html(), encoding="utf-8")
        os.replace(tmp, path)
        return path

    @property
    def nbytes(self) -> int:
        return len(self.fragment.encode())

    def __repr__(self) -> str:
        return f"<interp view: {self.title} ({self.nbytes / 1e6:.2f} MB of HTML; shown inline in a notebook, or .save(path))>"


def _ours(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            head = f.read(400)
    except OSError:
        return False
    return f'<meta name="generator" content="{GENERATOR}">'.encode() in head


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
def _uid(kind: str) -> str:
    return f"interp-{kind}-{secrets.token_hex(6)}"


def fill(template: str, **parts: str) -> str:
    """`template` with each `__NAME__` replaced by `parts[NAME]` (`__COMMON__`: COMMON_JS) in one pass, so
    text put in (a title, a token) is never searched for placeholders again."""
    parts.setdefault("COMMON", COMMON_JS)
    return re.sub(r"__([A-Z]+)__", lambda m: parts[m.group(1)], template)


def _warn_html(warnings) -> str:
    return "".join(f'<div class="warn">{html.escape(w)}</div>' for w in warnings)


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
    frag = fill(PATTERN_HTML, UID=_uid("attn"), TITLE=html.escape(title), WARN=_warn_html(warnings),
                DATA=inline_json(payload))
    return View(frag, title, warnings)


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
    frag = fill(STATS_HTML, UID=_uid("stats"), TITLE=html.escape(title), DATA=inline_json(payload))
    return View(frag, title)


# ---- the JavaScript, shared with the report viewer -----------------------------------------------------
# Inserted inside each view's own function scope, so two views on one page never share a name.
COMMON_JS = r"""
  const decodeCodes = b64 => { const raw = atob(b64), A = new Uint8Array(raw.length);
    for (let i = 0; i < raw.length; i++) A[i] = raw.charCodeAt(i); return A; };
  const viridis = t => {  // 5-stop approximation of matplotlib's viridis
    const s = [[68,1,84],[59,82,139],[33,145,140],[94,201,98],[253,231,37]];
    t = Math.max(0, Math.min(1, t)) * 4; const i = Math.min(3, Math.floor(t)), f = t - i;
    return "rgb(" + s[i].map((c, j) => Math.round(c + f * (s[i + 1][j] - c))).join(",") + ")";
  };
  const hex = (c, w) => c.charCodeAt(0).toString(16).toUpperCase().padStart(w, "0");
  // a token as visible text: newline, tab and space as symbols, other control characters as \xNN,
  // bidirectional and zero-width marks as <U+XXXX>, so nothing is invisible or reorders the line
  const tokenText = t => String(t).replace(/\n/g, "\u21b5").replace(/\t/g, "\u21e5").replace(/ /g, "\u00b7")
    .replace(/[\u0000-\u001f\u007f-\u009f]/g, c => "\\x" + hex(c, 2))
    .replace(/[\u061c\u200b-\u200f\u202a-\u202e\u2060-\u2069\ufeff]/g, c => "<U+" + hex(c, 4) + ">");
  const rgbOf = css => {  // any CSS colour as [r, g, b], through a canvas's own parser
    const c = document.createElement("canvas").getContext("2d"); c.fillStyle = "#000"; c.fillStyle = css;
    const m = /^#([0-9a-f]{2})([0-9a-f]{2})([0-9a-f]{2})/i.exec(c.fillStyle);
    return m ? [1, 2, 3].map(i => parseInt(m[i], 16)) : (c.fillStyle.match(/[\d.]+/g) || [0, 0, 0]).slice(0, 3).map(Number);
  };
  function tokenSpans(container, tokens, onHover) {  // one span per token; onHover(i) and onHover(null)
    return tokens.map((t, i) => {
      const s = document.createElement("span");
      s.className = "tok"; s.dataset.i = i; s.textContent = tokenText(t);
      s.addEventListener("mouseenter", () => onHover(i));
      s.addEventListener("mouseleave", () => onHover(null));
      container.appendChild(s); return s;
    });
  }
  // colour the tokens for a hovered one: what it attends to (w(hover, j), j <= hover) in `to`, which later
  // tokens attend to it (w(j, hover), j > hover) in `from`, scaled to the strongest weight shown;
  // data-weight keeps the raw value
  function paintTokens(spans, hover, w, to = [31, 119, 180], from = [255, 127, 14]) {
    let top = 1e-9;
    if (hover !== null) spans.forEach((s, j) => { top = Math.max(top, j <= hover ? w(hover, j) : w(j, hover)); });
    spans.forEach((s, j) => {
      s.classList.toggle("hover", j === hover);
      if (hover === null) { s.style.background = ""; s.dataset.weight = ""; s.title = ""; return; }
      const x = j <= hover ? w(hover, j) : w(j, hover), c = j <= hover ? to : from;
      s.dataset.weight = x.toFixed(3);
      s.style.background = "rgba(" + c.join(",") + "," + (x / top).toFixed(3) + ")";
      s.title = (j <= hover ? "attention from the hovered token: " : "attention to the hovered token: ") + x.toFixed(3);
    });
  }
  // draw an n x n pattern w(q, k) into `canvas` (queries down, keys across), `size` pixels a side: each
  // pixel the largest weight of its block (a thin diagonal stays visible at any size), white to `rgb`
  function drawPattern(canvas, n, w, size, rgb = [0, 0, 255], mask = false) {
    const px = Math.min(n, size), img = canvas.getContext("2d").createImageData(px, px), bin = n / px;
    for (let y = 0; y < px; y++) for (let x = 0; x < px; x++) {
      let v = 0;
      for (let q = Math.floor(y * bin); q < Math.floor((y + 1) * bin); q++)
        for (let k = Math.floor(x * bin); k < Math.floor((x + 1) * bin); k++) if (!(mask && k > q)) v = Math.max(v, w(q, k));
      v = Math.max(0, Math.min(1, v)); const o = (y * px + x) * 4;
      img.data[o] = 255 - v * (255 - rgb[0]); img.data[o + 1] = 255 - v * (255 - rgb[1]);
      img.data[o + 2] = 255 - v * (255 - rgb[2]); img.data[o + 3] = 255;
    }
    canvas.width = px; canvas.height = px; canvas.getContext("2d").putImageData(img, 0, 0);
  }
  // a layers x heads grid of clickable cells coloured by score[l][h] (null: grey); returns repaint(score, sel)
  function headGrid(grid, L, H, onClick) {
    const cell = (H <= 16 && L <= 16 ? 22 : 14) + "px", cells = [];
    grid.style.gridTemplateColumns = "repeat(" + H + ", " + cell + ")"; grid.style.gridAutoRows = cell;
    for (let l = 0; l < L; l++) for (let h = 0; h < H; h++) {
      const c = document.createElement("div"); c.dataset.layer = l; c.dataset.head = h;
      c.addEventListener("click", () => onClick(l, h)); grid.appendChild(c); cells.push(c);
    }
    return (score, label, sl, sh, name) => {
      let lo = Infinity, hi = -Infinity;
      if (score) score.forEach(r => r.forEach(x => { if (x !== null) { lo = Math.min(lo, x); hi = Math.max(hi, x); } }));
      cells.forEach(c => {
        const l = +c.dataset.layer, h = +c.dataset.head, x = score ? score[l][h] : null;
        c.style.background = x === null ? "#eee" : viridis(hi > lo ? (x - lo) / (hi - lo) : 0.5);
        c.title = (name ? name(l, h) : "L" + l + "H" + h) + (x === null ? "" : " " + label + " " + x.toFixed(3));
        c.classList.toggle("sel", l === sl && h === sh);
      });
    };
  }
"""

_CSS_COMMON = """
#__UID__{font-family:system-ui,sans-serif;font-size:13px;color:#222;line-height:1.4}
#__UID__ .title{font-weight:600;margin:.3em 0}
#__UID__ .warn{color:#a04000;background:#fff4e5;padding:2px 6px;margin:2px 0;white-space:pre-wrap}
#__UID__ .tok{padding:1px 2px;margin:0 1px;border-radius:3px;cursor:default;white-space:pre-wrap;word-break:break-all;unicode-bidi:isolate;direction:ltr}
#__UID__ .tok.hover{outline:2px solid #222}
#__UID__ .legend,#__UID__ .info{font-size:.85em;color:#555;min-height:1.3em}
#__UID__ canvas{image-rendering:pixelated}
#__UID__ .grid{display:inline-grid;gap:1px;background:#ddd;padding:1px}
#__UID__ .grid div{cursor:pointer}
#__UID__ .grid div.sel{outline:2px solid #e4572e;outline-offset:-2px}
#__UID__ .fallback{color:#555;font-style:italic}
"""

PATTERN_HTML = r"""<div class="interp-view attn-view" id="__UID__">
<style>""" + _CSS_COMMON + r"""
#__UID__ .thumbs{display:flex;flex-wrap:wrap;gap:6px;margin:.4em 0}
#__UID__ .thumb{margin:0;cursor:pointer;text-align:center;font-size:.8em;border:2px solid transparent;padding:2px}
#__UID__ .thumb.sel{border-color:#e4572e}
#__UID__ .thumb canvas{width:80px;height:80px;border:1px solid #ccc;display:block}
#__UID__ .thumb figcaption{max-width:84px;overflow:hidden;text-overflow:ellipsis;white-space:nowrap;unicode-bidi:isolate}
#__UID__ .panes{display:flex;gap:1.5em;align-items:flex-start;flex-wrap:wrap}
#__UID__ .tokens{flex:1 1 320px;max-width:560px;max-height:420px;overflow:auto;line-height:1.9;font-family:ui-monospace,monospace;font-size:.9em}
#__UID__ canvas.pattern{width:400px;height:400px;border:1px solid #ccc;cursor:crosshair}
</style>
<div class="title">__TITLE__</div>
__WARN__
<div class="fallback">(An interactive view: it needs JavaScript. In Jupyter, trust the notebook to run it.)</div>
<div class="controls" hidden><label>head <select class="head"></select></label>
  <span class="legend">hover a token: what it attends to (blue), which later tokens attend to it (orange)</span></div>
<div class="thumbs"></div>
<div class="panes">
  <div class="tokens"></div>
  <div><canvas class="pattern" width="1" height="1"></canvas>
    <div class="legend">the head's pattern: queries down, keys across</div><div class="info"></div></div>
</div>
<script type="application/json" class="data">__DATA__</script>
<script>
(function () {
  const t0 = performance.now();
  const me = document.currentScript;
  const root = (me && me.closest(".interp-view")) || document.getElementById("__UID__");
  __COMMON__
  const d = JSON.parse(root.querySelector("script.data").textContent);
  const A = decodeCodes(d.codes), n = d.n, H = d.heads.length, span = d.hi - d.lo;
  const T = d.tri ? n * (n + 1) / 2 : n * n;
  const raw = d.tri ? (h, q, k) => (k > q ? 0 : A[h * T + q * (q + 1) / 2 + k] / 255)
                    : (h, q, k) => A[h * T + q * n + k] / 255;
  const at = (h, q, k) => (d.mask && k > q) ? 0 : raw(h, q, k);
  const scaled = (h) => (q, k) => (at(h, q, k) - d.lo) / span;  // colour scale: lo..hi -> 0..1
  const rgb = rgbOf(d.colour);
  root.querySelector(".fallback").remove();
  root.querySelector(".controls").hidden = false;
  const headSel = root.querySelector("select.head"), thumbs = root.querySelector(".thumbs");
  const tokensDiv = root.querySelector(".tokens"), big = root.querySelector("canvas.pattern");
  const info = root.querySelector(".info");
  let head = d.selected, hover = null;
  const figs = d.heads.map((name, h) => {
    headSel.add(new Option(name, h));
    const f = document.createElement("figure"); f.className = "thumb"; f.dataset.head = h;
    const c = document.createElement("canvas"); drawPattern(c, n, scaled(h), 80, rgb, d.mask);
    const cap = document.createElement("figcaption"); cap.textContent = name; f.title = name;
    f.append(c, cap); f.addEventListener("click", () => { head = h; draw(); });
    thumbs.appendChild(f); return f;
  });
  const w = (q, k) => at(head, q, k);
  const tops = i => {  // the hovered token's strongest keys, said in words (at 1,024 tokens they may be scrolled away)
    const ks = Array.from({length: i + 1}, (_, k) => k).sort((a, b) => w(i, b) - w(i, a)).slice(0, 3);
    return "token " + i + " " + tokenText(d.tokens[i]) + " attends most to " +
      ks.map(k => k + " " + tokenText(d.tokens[k]) + " (" + w(i, k).toFixed(3) + ")").join(", ");
  };
  const spans = d.show_tokens ? tokenSpans(tokensDiv, d.tokens, i => {
    hover = i; paintTokens(spans, hover, w, rgb); info.textContent = i === null ? "" : tops(i); }) : [];
  if (!d.show_tokens) tokensDiv.remove();
  big.addEventListener("mousemove", e => {
    const r = big.getBoundingClientRect();
    const q = Math.min(n - 1, Math.floor((e.clientY - r.top) / r.height * n));
    const k = Math.min(n - 1, Math.floor((e.clientX - r.left) / r.width * n));
    info.textContent = "query " + q + " " + tokenText(d.tokens[q]) + "  \u2192  key " + k + " " + tokenText(d.tokens[k])
      + ": " + at(head, q, k).toFixed(3);
  });
  big.addEventListener("mouseleave", () => { info.textContent = ""; });
  function draw() {
    headSel.value = head; root.dataset.selected = d.heads[head]; root.dataset.head = head;
    figs.forEach((f, h) => f.classList.toggle("sel", h === head));
    drawPattern(big, n, scaled(head), Math.round(400 * (window.devicePixelRatio || 1)), rgb, d.mask);  // block max: no line lost
    paintTokens(spans, hover, w, rgb);
  }
  headSel.addEventListener("change", () => { head = +headSel.value; draw(); });
  draw();
  root.dataset.ready = (performance.now() - t0).toFixed(1);  // ms to decode and draw everything
})();
</script>
</div>
"""

STATS_HTML = r"""<div class="interp-view stats-view" id="__UID__">
<style>""" + _CSS_COMMON + r"""
#__UID__ .panes{display:flex;gap:1.5em;align-items:flex-start;flex-wrap:wrap;margin-top:.4em}
#__UID__ canvas.chart{width:640px;height:220px;border:1px solid #ccc;cursor:crosshair}
#__UID__ .key span{display:inline-block;width:1em;height:.6em;margin:0 .3em 0 1em}
</style>
<div class="title">__TITLE__</div>
<div class="fallback">(An interactive view: it needs JavaScript. In Jupyter, trust the notebook to run it.)</div>
<div class="controls" hidden><label>grid colour: mean <select class="field"></select></label>
  <span class="label" style="font-weight:600;margin-left:1em"></span></div>
<div class="panes">
  <div><div class="grid" title="rows: layers, columns: heads; click a head"></div>
    <div class="legend">rows: layers, columns: heads</div></div>
  <div><canvas class="chart" width="640" height="220"></canvas><div class="key legend"></div><div class="info"></div></div>
</div>
<script type="application/json" class="data">__DATA__</script>
<script>
(function () {
  const t0 = performance.now();
  const me = document.currentScript;
  const root = (me && me.closest(".interp-view")) || document.getElementById("__UID__");
  __COMMON__
  const d = JSON.parse(root.querySelector("script.data").textContent);
  const A = decodeCodes(d.codes), L = d.layers.length, H = d.heads, n = d.n, F = d.plotted.length;
  const val = (l, f, h, p) => A[((l * F + f) * H + h) * n + p] / 255;  // [layer, plotted field, head, pos]
  const colours = {sink: "#7f7f7f", previous: "#1f77b4", induction: "#d62728", duplicate: "#2ca02c"};
  const shown = d.plotted;
  root.querySelector(".fallback").remove(); root.querySelector(".controls").hidden = false;
  const fieldSel = root.querySelector("select.field"), label = root.querySelector(".label");
  const chart = root.querySelector("canvas.chart"), info = root.querySelector(".info");
  d.fields.forEach(f => fieldSel.add(new Option(f, f))); fieldSel.value = "induction";
  root.querySelector(".key").append(...shown.flatMap(f => {
    const s = document.createElement("span"); s.style.background = colours[f]; return [s, f + " mass"]; }));
  let layer = 0, head = 0, best = -1;  // open on the strongest induction head
  d.means.forEach((fr, l) => fr[d.fields.indexOf("induction")].forEach((x, h) => { if (x > best) { best = x; layer = l; head = h; } }));
  const paintGrid = headGrid(root.querySelector(".grid"), L, H, (l, h) => { layer = l; head = h; draw(); });
  const name = (l, h) => "L" + d.layers[l] + "H" + h;
  function plot() {
    const c = chart.getContext("2d"), W = chart.width, Ht = chart.height, pad = 4;
    c.clearRect(0, 0, W, Ht); c.strokeStyle = "#ddd"; c.beginPath(); c.moveTo(0, Ht - pad); c.lineTo(W, Ht - pad); c.stroke();
    shown.forEach(f => {
      const fi = d.plotted.indexOf(f); c.strokeStyle = colours[f]; c.beginPath();
      for (let x = 0; x < W; x++) {  // each pixel column: the mean over its positions
        const p0 = Math.floor(x * n / W), p1 = Math.max(p0 + 1, Math.floor((x + 1) * n / W));
        let s = 0; for (let p = p0; p < p1; p++) s += val(layer, fi, head, p);
        const y = Ht - pad - (s / (p1 - p0)) * (Ht - 2 * pad);
        x ? c.lineTo(x, y) : c.moveTo(x, y);
      }
      c.stroke();
    });
  }
  chart.addEventListener("mousemove", e => {
    const r = chart.getBoundingClientRect(), p = Math.min(n - 1, Math.floor((e.clientX - r.left) / r.width * n));
    info.textContent = "position " + p + (d.tokens ? " " + tokenText(d.tokens[p]) : "") + ": "
      + shown.map(f => f + " " + val(layer, d.plotted.indexOf(f), head, p).toFixed(3)).join(", ");
  });
  function draw() {
    const fi = d.fields.indexOf(fieldSel.value);
    paintGrid(d.means.map(fr => fr[fi]), "mean " + fieldSel.value, layer, head, name);
    label.textContent = name(layer, head) + ": per-query mass along " + n + " positions";
    root.dataset.selected = name(layer, head); plot();
  }
  fieldSel.addEventListener("change", draw);
  draw();
  root.dataset.ready = (performance.now() - t0).toFixed(1);
})();
</script>
</div>
"""
