"""The drawing of views: self-contained HTML (inline CSS and JavaScript, nothing fetched), for a notebook
cell (`_repr_html_`: Jupyter, JupyterLab, VS Code), a page (`View.save`), or a block of a report.

It takes checked numbers and strings, never a model or a tensor: numpy and the standard library only
(tests/interp/test_view.py imports it without torch). Below the models in the layers, so that
`ActivationCache.view` (interp/models/cache.py) can draw without the models holding HTML: the checks of
what a user hands a view, and the turning of tensors into arrays, are `interp.models.readouts.attention_view`;
`interp.view` is what a notebook calls; the report's viewer (`interp.analyses.atlas.registry.viewer`) takes
the packing and the shared JavaScript from here.

The templates are files beside this module (`pattern.html`, `stats.html`, `common.js`, `common.css`),
filled by `fill`: each `__NAME__` replaced in one pass, so text put in is never searched again. A
pattern travels as 8-bit codes (`codes_u8`: A * 255, rounded), base64, only the lower triangle when it
is causal. Token strings and head names come from strangers: they reach the page only inside JSON that
cannot close its script element (`inline_json`) and are put on the page with `textContent` (never as
markup), control characters and bidirectional marks drawn as visible symbols (`tokenText` in
common.js). Titles and warning lines are HTML-escaped here. Each view has its own random id, so two
views in one notebook never share state.
"""

from __future__ import annotations

import base64
import functools
import html
import json
import os
import re
import secrets
from importlib import resources
from pathlib import Path

import numpy as np

from interp.errors import UserError

__all__ = ["COMMON_JS", "GENERATOR", "View", "b64", "codes_u8", "fill", "inline_json", "pattern_page", "stats_page"]

GENERATOR = "interp.view"  # the page's <meta name="generator">: how `save` knows a file is one it wrote


@functools.cache
def template(name: str) -> str:
    """A template file beside this module; `__CSS__` in it is the shared style sheet (common.css),
    put in before any filling, so its own `__UID__`s are filled with the rest."""
    text = resources.files(__package__).joinpath(name).read_text(encoding="utf-8")
    return text.replace("__CSS__", template("common.css")) if name.endswith(".html") else text


COMMON_JS = template("common.js")  # inserted in each view's own function scope: no two views share a name


def inline_json(value) -> str:
    """`value` as JSON safe inside an HTML <script> element: `<`, `>` and `&` (which JSON only has inside
    strings) become `\\u003c`, `\\u003e`, `\\u0026`, so no data can close the script (`</script>`), open a
    comment (`<!--`) or a nested script; JSON.parse reads the same value back."""
    return json.dumps(value).replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def codes_u8(weights) -> np.ndarray:
    """Attention weights in [0, 1] as uint8 codes, round(A * 255): the packing of the report viewer and of
    every view, decoded as code / 255 (within 0.002). (A tensor on its device: `interp.models.readouts.attention_view.codes_u8`.)"""
    c = np.clip(np.asarray(weights, np.float32), 0.0, 1.0)  # one float32 copy, scaled and rounded in place
    c *= 255.0
    return np.rint(c, out=c).astype(np.uint8)  # half to even, as torch.round


def b64(codes: np.ndarray) -> str:
    return base64.b64encode(np.ascontiguousarray(codes).tobytes()).decode()


def fill(template_text: str, **parts: str) -> str:
    """`template_text` with each `__NAME__` replaced by `parts[NAME]` (`__COMMON__`: COMMON_JS) in one pass,
    so text put in (a title, a token) is never searched for placeholders again."""
    parts.setdefault("COMMON", COMMON_JS)
    return re.sub(r"__([A-Z]+)__", lambda m: parts[m.group(1)], template_text)


def _uid(kind: str) -> str:
    return f"interp-{kind}-{secrets.token_hex(6)}"


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


def _warn_html(warnings) -> str:
    return "".join(f'<div class="warn">{html.escape(w)}</div>' for w in warnings)


def pattern_page(payload: dict, title: str, warnings: list[str]) -> View:
    """The attention pattern view of checked data (`interp.models.readouts.attention_view.pattern_view` builds
    `payload`: tokens, head names, the packed codes, the colour range and choices)."""
    frag = fill(template("pattern.html"), UID=_uid("attn"), TITLE=html.escape(title), WARN=_warn_html(warnings),
                DATA=inline_json(payload))
    return View(frag, title, warnings)


def stats_page(payload: dict, title: str) -> View:
    """The streaming statistics view of checked data (`interp.models.readouts.attention_view.stats_view` builds
    `payload`: layers, heads, per-position codes and per-head means)."""
    frag = fill(template("stats.html"), UID=_uid("stats"), TITLE=html.escape(title), DATA=inline_json(payload))
    return View(frag, title)
