"""A report as data: `Section`s of blocks (a paragraph, a table, an image), rendered to a
self-contained HTML page (PNGs inlined as base64, no external assets, opens offline) and to
Markdown (PNGs written to `figures/`). Sweep reports and the model atlas are both built of these.
"""

from __future__ import annotations

import base64
import html
import io
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd


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
    import matplotlib.pyplot as plt

    plt.close(fig)  # figures from pyplot must be released; harmless for the others
    return Image(name, buf.getvalue(), caption)


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
        return b.to_html(index=False, border=0, na_rep="", float_format=lambda x: f"{x:.4g}")
    if isinstance(b, Image):
        data = base64.b64encode(b.png).decode()
        img = f'<img alt="{html.escape(b.caption or b.name)}" src="data:image/png;base64,{data}">'
        return f"<figure>{img}<figcaption>{html.escape(b.caption)}</figcaption></figure>" if b.caption else img
    if b.startswith("```"):
        return f"<pre>{html.escape(b.strip('`').strip())}</pre>"
    return f"<p>{html.escape(b)}</p>"


def render_html(title: str, sections: list[Section]) -> str:
    nav = "".join(f'<a href="#{s.id}">{html.escape(s.title)}</a>' for s in sections)
    body = "".join(f'<section id="{s.id}"><h2>{html.escape(s.title)}</h2>{"".join(_html_block(b) for b in s.blocks)}</section>'
                   for s in sections)
    return (f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>'
            f"<style>{_CSS}</style></head><body><h1>{html.escape(title)}</h1><nav>{nav}</nav>{body}</body></html>\n")


def md_table(frame: pd.DataFrame) -> str:
    def cell(v) -> str:
        if v is None or (isinstance(v, float) and np.isnan(v)) or v is pd.NA:
            return ""
        return f"{v:.4g}" if isinstance(v, float) else str(v).replace("|", "\\|").replace("\n", " ")

    head = "| " + " | ".join(map(str, frame.columns)) + " |\n|" + "---|" * len(frame.columns) + "\n"
    return head + "".join("| " + " | ".join(cell(v) for v in row) + " |\n" for row in frame.itertuples(index=False))


def render_markdown(title: str, sections: list[Section]) -> str:
    parts = [f"# {title}\n"]
    for s in sections:
        parts.append(f"\n## {s.title}\n")
        for b in s.blocks:
            if isinstance(b, pd.DataFrame):
                parts.append("\n" + md_table(b))
            elif isinstance(b, Image):
                parts.append(f"\n![{b.caption or b.name}](figures/{b.name})\n")
            elif isinstance(b, Html):
                parts.append(f"\n{b.markdown}\n")
            else:
                parts.append(f"\n{b}\n")
    return "".join(parts)


def write_document(out, title: str, sections: list[Section]) -> Path:
    """Write `out/report.html`, `out/report.md` and `out/figures/*.png`; return the HTML path."""
    from .store import atomic_write_text

    out = Path(out)
    figures = out / "figures"
    figures.mkdir(parents=True, exist_ok=True)
    for s in sections:
        for b in s.blocks:
            if isinstance(b, Image):
                (figures / b.name).write_bytes(b.png)
    atomic_write_text(out / "report.html", render_html(title, sections))
    atomic_write_text(out / "report.md", render_markdown(title, sections))
    return out / "report.html"
