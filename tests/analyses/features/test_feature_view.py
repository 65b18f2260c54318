"""The feature view: the payload read back (the contexts' tokens in order, each token's activation within one 8-bit
step of the feature's largest, the context's own position marked), hostile token strings kept out of the markup."""

from __future__ import annotations

import base64
import json
import re

import numpy as np
import pandas as pd

from interp.analyses.features.view import feature_view

HOSTILE = "</script><img src=x onerror=alert(1)>"


def payload(html: str) -> dict:
    found = re.findall(r'<script type="application/json" class="data">(.*?)</script>', html, re.S)
    assert len(found) == 1
    return json.loads(found[0])


def test_the_view_carries_the_contexts_and_keeps_strings_out_of_the_markup():
    contexts = pd.DataFrame({"feature": 3, "rank": [0, 0, 0, 1, 1], "document": [2, 2, 2, 5, 5],
                             "position": [7, 7, 7, 1, 1], "activation": [2.0, 2.0, 2.0, 0.5, 0.5],
                             "offset": [-1, 0, 1, -1, 0], "token": [10, 11, 12, 13, 11],
                             "token_activation": [0.25, 2.0, 1.0, 0.0, 0.5]}).iloc[::-1]  # rows in any order
    summary = pd.DataFrame({"feature": [3], "n_active": [4], "positions": [100], "frequency": [0.04],
                            "mean_activation": [1.0], "max_activation": [2.0]})
    logits = pd.DataFrame({"feature": 3, "direction": ["top", "bottom"], "rank": 0, "token": [11, 10],
                           "token_text": [HOSTILE, "b"], "effect": [0.5, -0.5]})
    heads = pd.DataFrame({"feature": [3, 3], "layer": 1, "head": [0, 1], "share": [0.75, 0.25]})
    strings = {10: "a", 11: HOSTILE, 12: "\n", 13: "d"}
    view = feature_view([3], summary, contexts, logits, strings, heads=heads, title="<b>features</b>")
    html = view.fragment
    assert "<img" not in html and "<b>features" not in html and "&lt;b&gt;features&lt;/b&gt;" in html
    d = payload(html)
    (f,) = d["features"]
    assert f["id"] == 3 and f["heads"] == [["L1H0", 0.75], ["L1H1", 0.25]] and f["raises"] == [[HOSTILE, 0.5]]
    assert [c["tokens"] for c in f["contexts"]] == [["a", HOSTILE, "\n"], ["d", HOSTILE]]
    assert [c["at"] for c in f["contexts"]] == [1, 1] and [c["act"] for c in f["contexts"]] == [2.0, 0.5]
    codes = np.frombuffer(base64.b64decode(f["codes"]), np.uint8) / 255 * f["top"]
    np.testing.assert_allclose(codes, [0.25, 2.0, 1.0, 0.0, 0.5], atol=f["top"] / 255)


def test_the_view_runs_in_chromium_and_shows_each_feature(tmp_path):
    """In a browser: no error, nothing fetched, one row per context with its tokens as text (the hostile one too),
    the clicked feature shown."""
    import pytest
    from headless import CHROMIUM, browser_page

    if CHROMIUM is None:
        pytest.skip("no chromium: apt-get install -y chromium (.ci/run does)")
    rows = []
    for f in (3, 8):
        for r in range(2):
            rows += [dict(feature=f, rank=r, document=r, position=4, activation=1.0 + f - r, offset=o, token=10 + o,
                          token_activation=abs(o) / 2) for o in (-1, 0, 1)]
    contexts = pd.DataFrame(rows)
    summary = pd.DataFrame({"feature": [3, 8], "n_active": [4, 2], "positions": 100, "frequency": [0.04, 0.02],
                            "mean_activation": [1.0, 2.0], "max_activation": [4.0, 9.0]})
    logits = pd.DataFrame(columns=["feature", "direction", "rank", "token", "token_text", "effect"])
    page_file = tmp_path / "view.html"
    feature_view([3, 8], summary, contexts, logits, {9: "x", 10: HOSTILE, 11: "z"}).save(page_file)
    with browser_page() as (page, seen):
        page.goto(page_file.as_uri())
        page.wait_for_selector(".feature-view[data-ready]")
        assert page.get_attribute(".feature-view", "data-selected") == "3"
        assert len(page.query_selector_all(".feature-view .ctx")) == 2
        assert HOSTILE.replace(" ", "\u00b7") in page.inner_text(".feature-view .contexts")
        page.query_selector_all(".feature-view .list button")[1].click()
        assert page.get_attribute(".feature-view", "data-selected") == "8"
        assert "feature 8" in page.inner_text(".feature-view .card .name")
    assert not seen["errors"] and not seen["requests"] and not seen["dialogs"]
