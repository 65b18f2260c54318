"""A report as data: `Section`s of blocks (a paragraph, a table, an image), rendered to a
self-contained HTML page (PNGs inlined as base64, no external assets, opens offline) and to
Markdown (PNGs written to `figures/`). Sweep reports and the model atlas are both built of these.

Names come from strangers (run and checkpoint folders, token strings), so none of them is ever read
as markup: HTML escapes everything, JSON inlined in a page escapes `<`, `>` and `&` (`inline_json`),
a paragraph is Markdown whose names are escaped where they are put in (`md_escape`; the HTML page
shows the same text without the escapes), and every table cell is escaped. A number that is not
finite is never printed: its cell is left empty.
"""

from __future__ import annotations

import base64
import html
import io
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from interp.drawing import inline_json  # noqa: F401 - here since the report first used it; moved
# to interp.drawing with the attention views, which `ActivationCache.view` draws from the models layer

from .store import atomic_write_bytes, atomic_write_text


@dataclass
class Image:
    name: str  # file name under figures/
    png: bytes
    caption: str = ""


@dataclass
class Html:
    """A self-contained interactive block (inline HTML, CSS and JS; nothing fetched): shown as is in
    report.html; report.md gets `markdown` instead."""

    html: str
    markdown: str = "(interactive: open report.html)"


@dataclass
class Section:
    id: str
    title: str
    blocks: list = field(default_factory=list)  # str (a paragraph; ``` fenced = preformatted), DataFrame, Image

    def add(self, *blocks) -> "Section":
        self.blocks.extend(b for b in blocks if b is not None)
        return self


def png(fig, name: str, caption: str = "") -> Image | None:
    """A matplotlib figure as an `Image` (None passes through: "nothing to draw")."""
    if fig is None:
        return None
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90)
    import matplotlib.pyplot as plt  # start-up time: pyplot takes ~0.5 s to import (plots.py draws without it)

    plt.close(fig)  # figures from pyplot must be released; harmless for the others
    return Image(name, buf.getvalue(), caption)


_MD_SPECIAL = re.compile(r"([\\`*_\[\]<>&|~#!])")
_MD_ESCAPED = re.compile(r"\\([!-/:-@\[-`{-~])")  # CommonMark's backslash escapes: ASCII punctuation


def md_escape(text) -> str:
    """`text` (a name: a run, a checkpoint, a title) as literal Markdown on one line: characters Markdown
    or HTML would read as syntax (emphasis, code, links, tables, tags, entities) are backslash-escaped."""
    return _MD_SPECIAL.sub(r"\\\1", " ".join(str(text).splitlines()))


def number(x, spec: str = ".4g") -> str:
    """`x` formatted, or "" where it is missing or not finite (a table never shows nan or inf)."""
    if x is None or x is pd.NA or (isinstance(x, float) and not math.isfinite(x)):
        return ""
    return format(x, spec)


def head_name(layer, head) -> str:
    """`L{layer}H{head}`, the way heads are named in every table and sentence."""
    return f"L{int(layer)}H{int(head)}"


# ---- rendering ---------------------------------------------------------------------------------
_CSS = """body{font-family:system-ui,sans-serif;max-width:1100px;margin:2em auto;padding:0 1em;color:#222}
h1{font-size:1.6em}h2{border-bottom:1px solid #ddd;padding-bottom:.2em;margin-top:1.8em}
table{border-collapse:collapse;font-size:.85em;margin:.8em 0}td,th{border:1px solid #ccc;padding:.2em .5em;text-align:right}
th{background:#f3f3f3}img{max-width:100%;display:block;margin:.8em 0}pre{background:#f6f6f6;padding:.8em;overflow:auto;font-size:.8em}
nav a{margin-right:1em}figcaption{font-size:.85em;color:#555}"""


def _html_block(b) -> str:
    if isinstance(b, Html):
        return b.html
    if isinstance(b, pd.DataFrame):
        return b.to_html(index=False, border=0, na_rep="", float_format=number)
    if isinstance(b, Image):
        data = base64.b64encode(b.png).decode()
        img = f'<img alt="{html.escape(b.caption or b.name)}" src="data:image/png;base64,{data}">'
        return f"<figure>{img}<figcaption>{html.escape(b.caption)}</figcaption></figure>" if b.caption else img
    if b.startswith("```"):
        return f"<pre>{html.escape(_code(b))}</pre>"
    return f"<p>{html.escape(_MD_ESCAPED.sub(_unescape, b))}</p>"


def _unescape(m: re.Match) -> str:
    return m.group(1)


def _code(block: str) -> str:
    """The text of a ``` fenced paragraph."""
    return block.strip("`").strip()


def render_html(title: str, sections: list[Section]) -> str:
    nav = "".join(f'<a href="#{s.id}">{html.escape(s.title)}</a>' for s in sections)
    body = "".join(f'<section id="{s.id}"><h2>{html.escape(s.title)}</h2>{"".join(_html_block(b) for b in s.blocks)}</section>'
                   for s in sections)
    return (f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>'
            f"<style>{_CSS}</style></head><body><h1>{html.escape(title)}</h1><nav>{nav}</nav>{body}</body></html>\n")


def md_table(frame: pd.DataFrame) -> str:
    def cell(v) -> str:
        if v is None or v is pd.NA or isinstance(v, (float, np.floating)):
            return number(None if v is None or v is pd.NA else float(v))
        return md_escape(v)

    head = "| " + " | ".join(map(md_escape, frame.columns)) + " |\n|" + "---|" * len(frame.columns) + "\n"
    return head + "".join("| " + " | ".join(cell(v) for v in row) + " |\n" for row in frame.itertuples(index=False))


def render_markdown(title: str, sections: list[Section]) -> str:
    parts = [f"# {md_escape(title)}\n"]
    for s in sections:
        parts.append(f"\n## {s.title}\n")
        for b in s.blocks:
            if isinstance(b, pd.DataFrame):
                parts.append("\n" + md_table(b))
            elif isinstance(b, Image):
                parts.append(f"\n![{md_escape(b.caption or b.name)}](figures/{b.name})\n")
            elif isinstance(b, Html):
                parts.append(f"\n{b.markdown}\n")
            elif b.startswith("```"):  # a fence longer than any run of backticks inside: data cannot close it
                text = _code(b)
                fence = "`" * max(3, 1 + max((len(r) for r in re.findall("`+", text)), default=0))
                parts.append(f"\n{fence}\n{text}\n{fence}\n")
            else:
                parts.append(f"\n{b}\n")
    return "".join(parts)


def write_document(out, title: str, sections: list[Section], folder=None) -> Path:
    """Write `out/report.html`, `out/report.md` and `out/figures/*.png`; return the HTML path. With
    `folder` (the `store.OutputFolder` of `out`), every file is claimed there before it is written."""
    out = Path(out)
    images = [b for s in sections for b in s.blocks if isinstance(b, Image)]
    if folder is not None:
        folder.claim("figures/", *(f"figures/{b.name}" for b in images), "report.html", "report.md")
    (out / "figures").mkdir(parents=True, exist_ok=True)
    for b in images:
        atomic_write_bytes(out / "figures" / b.name, b.png)
    atomic_write_text(out / "report.html", render_html(title, sections))
    atomic_write_text(out / "report.md", render_markdown(title, sections))
    return out / "report.html"
