"""The feature view: an SAE's features, each with its max-activating contexts (windows of text, every token
shaded by the feature's activation there), the heads it is attributed to, and the tokens whose logits it raises and
lowers. Self-contained HTML as every view here (`interp.drawing`): the template `features.html`, filled once; token
strings reach the page only inside the inline JSON and through `textContent`; the activations travel as 8-bit codes
of each feature's largest (`codes_u8`, base64). The payload is built and checked by
`interp.analyses.features.view.feature_view`; this module takes it as it is."""

from __future__ import annotations

import html
import secrets

from . import View, fill, inline_json, template


def features_page(payload: dict, title: str, warnings: list[str] | tuple = ()) -> View:
    """The feature view of checked data: payload {"features": [{"id", "label", "name", "facts", "heads":
    [[name, share]], "raises" / "lowers": [[text, value]], "top" (the largest activation shown), "codes" (base64
    uint8 of token activation / top, the contexts' windows one after another), "contexts": [{"act", "doc", "pos",
    "tokens", "at"}]}], "head_legend": str}."""
    warn = "".join(f'<div class="warn">{html.escape(w)}</div>' for w in warnings)
    frag = fill(template("features.html"), UID=f"interp-features-{secrets.token_hex(6)}", TITLE=html.escape(title),
                WARN=warn, DATA=inline_json(payload))
    return View(frag, title, warnings)


__all__ = ["features_page"]
