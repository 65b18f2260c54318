"""Attention in a notebook, offline: CircuitsVis's calls as drop-ins, the atlas's head grid, and the
streaming statistics for contexts too long for a pattern.

    import interp.view as view                     # where a notebook had `import circuitsvis as cv`
    view.attention_heads(attention=cache["pattern", 5][0], tokens=model.to_str_tokens(text))
    view.attention_patterns(tokens=str_tokens, attention=pattern)      # [heads, dest, src]
    cache.view(5, text)                            # the same, from a run_with_cache result
    view.heads("out/smollm2")                      # the atlas: layers x heads by any score; click a head
    view.stats(model.attention_stats(tokens), model.to_str_tokens(tokens))   # any length

Each returns a `View`: Jupyter, JupyterLab and VS Code show it inline (`_repr_html_`); `.save("f.html")`
writes the same page. Nothing is fetched (no CDN): the script and the data are in the HTML, the pattern
as 8-bit codes. Bad input (a token count that is not the pattern's, NaN, weights outside [0, 1], more
than 4,096 tokens) is a `BadValue` / `UserError` before any HTML is built; rows that do not sum to 1
are drawn as given under a warning line. The checks are `interp.models.readouts.attention_view` and the drawing `interp.drawing` (low
enough for `ActivationCache.view`); the head grid is the report's viewer (`analyses/src/atlas/registry/viewer.py`).
"""

from __future__ import annotations

import html
import os
import secrets
from pathlib import Path

import pandas as pd

from interp.analyses.atlas.registry.viewer import grid_scores, viewer_html
from interp.analyses.atlas.report import run_view  # what a report section sees of one run (RunView)
from interp.analyses.store import ResultStore, as_table, load_results
from interp.drawing import View
from interp.models.readouts.attention_view import MAX_TOKENS, pattern_view, stats_view
from interp.errors import BadValue, UserError

__all__ = ["MAX_TOKENS", "View", "attention_heads", "attention_pattern", "attention_patterns", "heads", "stats"]


def attention_heads(attention, tokens, attention_head_names=None, max_value=None, min_value=None,
                    negative_color=None, positive_color=None, mask_upper_tri=None, show_tokens=None,
                    match_color=None, *, title=None, selected: int = 0) -> View:
    """CircuitsVis's `attention_heads`: a thumbnail per head, click one to see it in full, hover a token.
    `attention` [heads, dest, src] (tensor, array or lists; weights in [0, 1]), `tokens` one string per
    position. `max_value` is drawn at full colour (default 1); `min_value` >= 0; `positive_color` any CSS
    colour; `negative_color` is checked but never drawn (a pattern has no negative weight) and
    `match_color` is accepted for compatibility (each view has one colour). `selected`: the head shown first."""
    return pattern_view(tokens, attention, head_names=attention_head_names, title=title, max_value=max_value,
                        min_value=min_value, positive_color=positive_color, negative_color=negative_color,
                        mask_upper_tri=mask_upper_tri, show_tokens=show_tokens, selected=selected)


def attention_patterns(tokens, attention, head_names=None, *, title=None, **options) -> View:
    """CircuitsVis's `attention_patterns(tokens, attention)`: the same view as `attention_heads` (its
    successor there too); `head_names` optional, `options` those of `attention_heads`."""
    return attention_heads(attention, tokens, attention_head_names=head_names, title=title, **options)


def attention_pattern(tokens, attention, max_value=None, min_value=None, negative_color=None, show_axis_labels=None,
                      positive_color=None, mask_upper_tri=None, *, title=None, **options) -> View:
    """CircuitsVis's `attention_pattern`: one head's [dest, src] pattern (`show_axis_labels` is accepted for
    compatibility: the view always says which axis is which)."""
    return attention_heads(attention, tokens, max_value=max_value, min_value=min_value, negative_color=negative_color,
                           positive_color=positive_color, mask_upper_tri=mask_upper_tri, title=title, **options)


def heads(results, run: str | None = None, *, title: str | None = None) -> View:
    """The atlas's head grid in a notebook: layers x heads coloured by any per-head score of the results
    (choose it), click a head to see its pattern on the sample (hover a token). `results`: an output
    folder of `interp analyze` / `interp sweep`, or its results table (`load_results(folder)`; a table
    has no pattern sample, so the grid only). `run`: which run, when the results hold several."""
    extras: list[dict] = []
    settings: dict = {}
    if isinstance(results, (str, os.PathLike)):
        out = Path(results)
        if not out.is_dir():
            raise UserError(f"{out} is not a folder: give the --out folder of `interp analyze` or `interp sweep`")
        table = load_results(out)
        store = ResultStore(out)
        extras, settings = store.extras(), store.read_json("settings.json", {})
    elif isinstance(results, pd.DataFrame):
        missing = {"run", "layer", "head", "metric", "value", "step"} - set(results.columns)
        if missing:
            raise BadValue(f"results must be a results table (load_results(folder)); missing columns {sorted(missing)}")
        table = as_table(results)
    else:
        raise BadValue(f"results must be an output folder or its results table, got {type(results).__name__}")
    runs = sorted(table["run"].dropna().unique())
    if not runs:
        raise UserError(f"{results if not isinstance(results, pd.DataFrame) else 'the table'} holds no results yet")
    if run is None:
        if len(runs) > 1:
            raise BadValue(f"the results hold {len(runs)} runs ({', '.join(runs[:5])}): choose one with run=...")
        run = runs[0]
    elif run not in runs:
        raise BadValue(f"no run {run!r} in the results; they hold {', '.join(runs[:5])}")
    v = run_view(table, run, False, settings, extras=extras)
    scores = grid_scores(v.last)
    if not scores:
        raise UserError(f"{run} has no per-head scores to colour the grid: run an analysis such as induction")
    title = title or f"{run}: head scores at {v.where}"
    frag = viewer_html(v.extras.get("viewer"), scores, run, v.where, f"interp-heads-{secrets.token_hex(6)}")
    return View(f'<div class="interp-view heads-view"><div style="font-weight:600">{html.escape(title)}</div>{frag}</div>',
                title)


def stats(stats, tokens=None, *, batch: int = 0, title: str | None = None) -> View:
    """Per-query attention mass along a long sequence, where a pattern would be too big: `stats` is
    `model.attention_stats(tokens)` ({layer: AttentionStats}, computed without materialising any
    pattern), `tokens` its strings (optional). A layers x heads grid coloured by the mean sink /
    previous-token / induction / duplicate mass (click a head), and the chosen head's sink,
    previous-token and induction mass at every position."""
    return stats_view(stats, tokens, batch=batch, title=title)

