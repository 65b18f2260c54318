"""viewer: the attention patterns of every head on a short sample of the data, for report.html's
interactive attention viewer (written here: inline HTML, CSS and JS, nothing fetched). Pick a layer
and head, or click a cell of the head-score grid; hover a token to see where it attends (blue) and
which later tokens attend to it (orange)."""

from __future__ import annotations

from types import MappingProxyType

import numpy as np
import torch

from interp.drawing import b64, fill
from interp.models.readouts.attention_view import codes_u8
from interp.models.placement.device import to_numpy

from ...document import Html, inline_json
from ...store import NonFiniteResult
from .base import Analysis, Context, Metric, Output, ReportSection, RunView, metrics, per_model, register

PARAMS = MappingProxyType(dict(max_tokens=48))


def _str_tokens(model, tokens) -> list[str]:
    if getattr(model, "tokenizer", None) is None:
        return [str(int(t)) for t in tokens]
    try:
        return list(model.to_str_tokens(tokens))
    except Exception:  # noqa: BLE001 - a tokenizer that cannot decode single ids: show the ids
        return [str(int(t)) for t in tokens]


def sample_window(tokens: torch.Tensor, n: int) -> torch.Tensor:
    """[1, n]: a row's first token (BOS, where attention sinks park) and the n - 1 tokens, from the first
    rows at offsets 1, 9, 17, ..., with the most repeated bigrams, so induction has something to show."""
    best, best_score = tokens[:1, :n], -1
    for row in tokens[:4]:
        for start in range(1, max(2, row.shape[0] - n + 2), 8):
            body = row[start : start + n - 1].tolist()
            if len(body) < n - 1:
                break
            seen, score = set(), 0
            for bigram in zip(body, body[1:]):
                if bigram[0] != bigram[1]:  # runs of one token (indentation) are not what induction copies
                    score += bigram in seen
                    seen.add(bigram)
            if score > best_score:
                best, best_score = torch.cat([row[:1], row[start : start + n - 1]])[None], score
    return best


def run(ctx: Context) -> Output:
    n = min(PARAMS["max_tokens"], ctx.tokens.shape[1])
    sample = sample_window(ctx.tokens, n)
    with torch.no_grad():
        _, cache = ctx.model.run_with_cache(sample, names_filter=lambda name: name.endswith("hook_pattern"))
    patterns = torch.stack([cache["pattern", l][0].to(ctx.tokens.device)  # one device (a model split by device_map)
                            for l in range(ctx.model.cfg.n_layers)])  # [layer, head, q, k]
    broken = (~torch.isfinite(patterns)).flatten(2).any(-1).nonzero().tolist()
    if broken:  # NaN would be stored as a code like any other weight: refuse, naming the heads
        raise NonFiniteResult(f"the attention patterns of {len(broken)} head(s) hold NaN or inf ("
                              + ", ".join(f"L{l}H{h} pattern" for l, h in broken[:8])
                              + "): check the checkpoint's weights for NaN/inf")
    return Output(per_model("viewer_tokens", n), extra={
        "tokens": _str_tokens(ctx.model, sample[0].tolist()), "n_layers": int(patterns.shape[0]),
        "n_heads": int(patterns.shape[1]), "n": n,
        "patterns_u8": b64(to_numpy(codes_u8(patterns))),  # A * 255, rounded; [layer, head, q, k]
    })


def grid_scores(last) -> dict:
    """{metric label: [[score per head] per layer]} of the rows `last` (a run's last checkpoint), for the
    viewer's clickable grid."""
    out = {}
    for m in metrics(lambda m: m.heatmap and m.per == "head"):
        part = last[(last["metric"] == m.name) & last["layer"].notna()]
        if part.empty:
            continue
        grid = part.pivot_table(index="layer", columns="head", values="value", aggfunc="mean")
        out[m.label or m.name] = [[round(float(x), 4) if np.isfinite(x) else None for x in row] for row in grid.to_numpy()]
    return out


def section(v: RunView) -> list:
    data = v.extras.get("viewer")
    if data is None:
        return [f"{v.prefix}No attention sample (see Errors)."]
    uid = "viewer-" + "".join(ch if ch.isalnum() else "-" for ch in v.slug)
    return [f"{v.prefix}The attention of every head on {data['n']} tokens of the data at {v.where} (the first token, "
            "then the stretch of the first sequences with the most repeated token pairs, where induction heads show). "
            "Choose a layer and head, or click a cell of the grid (coloured by the chosen score); hover a token to "
            "see where it attends (blue) and which later tokens attend to it (orange); the matrix on the right is "
            "the head's whole pattern (rows: queries, columns: keys).",
            Html(viewer_html(data, grid_scores(v.last), v.run, v.where, uid),
                 "(The interactive attention viewer is in report.html.)")]


def viewer_html(data: dict | None, scores: dict, run: str, where: str, uid: str) -> str:
    """The viewer as an HTML fragment: `data` is the analysis's extra (None: no attention sample, the grid
    alone), `scores` `grid_scores(...)`; `uid` the element id, unique on the page. `interp.view.heads`
    shows the same fragment in a notebook."""
    data = data or {"tokens": [], "n_layers": _grid_shape(scores)[0], "n_heads": _grid_shape(scores)[1], "n": 0,
                    "patterns_u8": ""}
    return fill(_HTML, UID=uid, DATA=inline_json(dict(data, scores=scores, run=run, where=where)))


def _grid_shape(scores: dict) -> tuple[int, int]:
    grid = next(iter(scores.values()), [])
    return len(grid), max((len(r) for r in grid), default=0)


register(Analysis(
    "viewer", run, "attention patterns of every head on a short sample of the data, for the report's viewer",
    PARAMS, expensive=True,
    metrics=(Metric("viewer_tokens", "model", "tokens in the sample (the patterns are in the part's extra)"),),
    section=ReportSection("viewer", "Attention viewer", section)))


_HTML = r"""
<div class="attn-viewer" id="__UID__">
<style>
#__UID__ .controls{display:flex;gap:1em;align-items:center;flex-wrap:wrap;margin:.5em 0}
#__UID__ .panes{display:flex;gap:1.5em;align-items:flex-start;flex-wrap:wrap}
#__UID__ .grid{display:inline-grid;gap:1px;background:#ddd;padding:1px}
#__UID__ .grid div{cursor:pointer}
#__UID__ .grid div.sel{outline:2px solid #e4572e;outline-offset:-2px}
#__UID__ .tokens{flex:1 1 320px;max-width:480px;min-width:0;overflow:hidden;line-height:1.9;font-family:ui-monospace,monospace;font-size:.85em}
#__UID__ .tok{padding:1px 2px;margin:0 1px;border-radius:3px;cursor:default;white-space:pre-wrap;word-break:break-all;unicode-bidi:isolate;direction:ltr}
#__UID__ .tok.hover{outline:2px solid #222}
#__UID__ .legend{font-size:.8em;color:#555}
#__UID__ canvas{border:1px solid #ccc;image-rendering:pixelated}
</style>
<div class="controls">
  <label>layer <select class="layer"></select></label>
  <label>head <select class="head"></select></label>
  <label>grid colour <select class="metric"></select></label>
  <span class="label" style="font-weight:600"></span>
</div>
<div class="panes">
  <div><div class="grid" title="rows: layers, columns: heads; click a head"></div>
       <div class="legend">rows: layers, columns: heads</div></div>
  <div class="tokens"></div>
  <div><canvas width="240" height="240"></canvas><div class="legend">pattern: queries down, keys across</div></div>
</div>
<script type="application/json" class="data">__DATA__</script>
<script>
(function () {
  const me = document.currentScript;  // a notebook may run this before the id is unique in its document
  const root = (me && me.closest(".attn-viewer")) || document.getElementById("__UID__");
  __COMMON__
  const d = JSON.parse(root.querySelector("script.data").textContent);
  const A = decodeCodes(d.patterns_u8);
  const L = d.n_layers, H = d.n_heads, n = d.n;
  const at = (l, h, q, k) => A[((l * H + h) * n + q) * n + k] / 255;
  const layerSel = root.querySelector("select.layer"), headSel = root.querySelector("select.head");
  const metricSel = root.querySelector("select.metric"), grid = root.querySelector(".grid");
  const tokensDiv = root.querySelector(".tokens"), label = root.querySelector(".label");
  const canvas = root.querySelector("canvas"), ctx = canvas.getContext("2d");
  if (!n) { tokensDiv.textContent = "(no attention sample: run the viewer analysis to click a head and see its pattern)";
            canvas.parentElement.remove(); }
  for (let l = 0; l < L; l++) layerSel.add(new Option(String(l), l));
  for (let h = 0; h < H; h++) headSel.add(new Option(String(h), h));
  const metrics = Object.keys(d.scores);
  metrics.forEach(m => metricSel.add(new Option(m, m)));
  if (!metrics.length) metricSel.parentElement.style.display = "none";
  let layer = 0, head = 0, hover = null;
  // start on the best head of the first score, so the viewer opens on something worth seeing
  if (metrics.length) {
    let best = -Infinity;
    d.scores[metrics[metrics.length > 1 ? 1 : 0]].forEach((row, l) => row.forEach((x, h) => {
      if (x !== null && x > best) { best = x; layer = l; head = h; } }));
  }
  const w = (q, k) => at(layer, head, q, k);
  const paintCells = headGrid(grid, L, H, (l, h) => { layer = l; head = h; draw(); });
  const spans = tokenSpans(tokensDiv, d.tokens, i => { hover = i; paintTokens(spans, hover, w); });
  function paintPattern() {
    if (!n) return;
    const off = document.createElement("canvas");
    drawPattern(off, n, w, n);
    ctx.imageSmoothingEnabled = false; ctx.clearRect(0, 0, canvas.width, canvas.height);
    ctx.drawImage(off, 0, 0, canvas.width, canvas.height);
  }
  function draw() {
    layerSel.value = layer; headSel.value = head;
    label.textContent = d.run + ": L" + layer + "H" + head + " at " + d.where;
    root.dataset.selected = "L" + layer + "H" + head;
    paintGrid(); paintTokens(spans, hover, w); paintPattern();
  }
  const paintGrid = () => paintCells(d.scores[metricSel.value], metricSel.value, layer, head);
  layerSel.addEventListener("change", () => { layer = +layerSel.value; draw(); });
  headSel.addEventListener("change", () => { head = +headSel.value; draw(); });
  metricSel.addEventListener("change", paintGrid);
  draw();
})();
</script>
</div>
"""
