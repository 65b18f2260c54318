"""interp.view without a browser: CircuitsVis's argument conventions, the 8-bit packing read back
against the weights given, every bad input refused before any HTML, rows that do not sum to 1 shown
under a warning (never renormalised), hostile strings kept out of the markup, `save` never
overwriting a file it did not write, `cache.view` against a pattern computed here from q and k, the
streaming statistics view and the atlas's head grid. The same views in chromium: test_view_browser.py."""

from __future__ import annotations

import base64
import json
import re
from html.parser import HTMLParser

import numpy as np
import pandas as pd
import pytest
import torch

import interp
import interp.view as view
from interp.errors import BadValue, UserError


def causal(heads: int, n: int, seed: int = 0) -> torch.Tensor:
    """[heads, n, n] softmax patterns under a causal mask, computed here with torch's softmax."""
    g = torch.Generator().manual_seed(seed)
    s = torch.randn(heads, n, n, generator=g) * 3
    return s.masked_fill(torch.triu(torch.ones(n, n, dtype=torch.bool), 1), float("-inf")).softmax(-1)


def payload(html: str) -> dict:
    m = re.findall(r'<script type="application/json" class="data">(.*?)</script>', html, re.S)
    assert len(m) == 1, "one data block per view"
    return json.loads(m[0])


def weights(d: dict) -> np.ndarray:
    """[heads, n, n] weights decoded from a pattern view's payload (code / 255), as the page's JS does."""
    codes = np.frombuffer(base64.b64decode(d["codes"]), np.uint8)
    h, n = len(d["heads"]), d["n"]
    if not d["tri"]:
        return codes.reshape(h, n, n) / 255
    out = np.zeros((h, n, n))
    rows, cols = np.tril_indices(n)
    out[:, rows, cols] = codes.reshape(h, -1) / 255
    return out


def tokens(n: int) -> list[str]:
    return [f" t{i}" for i in range(n)]


# ---- CircuitsVis's calls --------------------------------------------------------------------------
def test_circuitsvis_argument_conventions_and_packing():
    a = causal(3, 17)
    toks = tokens(17)
    by_keyword = view.attention_heads(attention=a, tokens=toks)
    positional_heads = view.attention_heads(a, toks)  # CircuitsVis: attention_heads(attention, tokens)
    positional_patterns = view.attention_patterns(toks, a)  # CircuitsVis: attention_patterns(tokens, attention)
    from_numpy = view.attention_patterns(tokens=toks, attention=a.numpy())
    from_lists = view.attention_patterns(tokens=toks, attention=a.tolist())
    for v in (by_keyword, positional_heads, positional_patterns, from_numpy, from_lists):
        d = payload(v._repr_html_())
        assert d["tokens"] == toks and d["n"] == 17 and d["tri"]
        assert np.abs(weights(d) - a.numpy()).max() <= 0.5 / 255 + 1e-7  # round(A * 255) / 255
    d = payload(view.attention_heads(a, toks, attention_head_names=["a", "b", "c"])._repr_html_())
    assert d["heads"] == ["a", "b", "c"]
    one = payload(view.attention_pattern(toks, a[1])._repr_html_())  # one head's [dest, src]
    assert np.abs(weights(one)[0] - a[1].numpy()).max() <= 0.5 / 255 + 1e-7
    # a causal pattern ships its lower triangle: 3 x 17 x 18 / 2 bytes, not 3 x 17 x 17
    assert len(base64.b64decode(payload(by_keyword._repr_html_())["codes"])) == 3 * 17 * 18 // 2


def test_a_pattern_that_is_not_causal_ships_whole():
    g = torch.Generator().manual_seed(1)
    a = torch.randn(2, 9, 9, generator=g).softmax(-1)  # bidirectional (an encoder)
    d = payload(view.attention_heads(a, tokens(9))._repr_html_())
    assert not d["tri"] and np.abs(weights(d) - a.numpy()).max() <= 0.5 / 255 + 1e-7


def test_bfloat16_patterns_on_their_rounding():
    a = causal(2, 33).to(torch.bfloat16)
    v = view.attention_heads(a, tokens(33))
    assert v.warnings == []  # bf16 rows sum to 1 within bf16's rounding
    assert np.abs(weights(payload(v._repr_html_())) - a.float().numpy()).max() <= 0.5 / 255 + 1e-7


def test_colour_and_scale_options():
    a = causal(2, 5)
    d = payload(view.attention_heads(a, tokens(5), max_value=0.5, positive_color="#ff0000", mask_upper_tri=True,
                                     show_tokens=False)._repr_html_())
    assert (d["hi"], d["lo"], d["colour"], d["mask"], d["show_tokens"]) == (0.5, 0.0, "#ff0000", True, False)
    for bad in ("red;} body{display:none", "url(http://x)", "expression(alert(1))", 3):
        with pytest.raises(BadValue, match="CSS colour"):
            view.attention_heads(a, tokens(5), positive_color=bad)
    with pytest.raises(BadValue, match="min_value"):
        view.attention_heads(a, tokens(5), min_value=-1)


# ---- bad input: one error, before any HTML ------------------------------------------------------------
@pytest.mark.parametrize("make, match", [
    (lambda: view.attention_heads(causal(2, 8), tokens(7)), "7 tokens for a pattern over 8 positions"),
    (lambda: view.attention_heads(causal(2, 8), "some text"), "list of strings"),
    (lambda: view.attention_heads(causal(2, 8), list(range(8))), "tokens must be strings"),
    (lambda: view.attention_heads(causal(2, 8)[None], tokens(8)), r"pick one sequence: pattern\[0\]"),
    (lambda: view.attention_heads(torch.rand(2, 8, 7), tokens(8)), "square"),
    (lambda: view.attention_heads(causal(2, 8), tokens(8), attention_head_names=["a"]), "1 head names for 2 heads"),
    (lambda: view.attention_heads(causal(2, 8) * 2, tokens(8)), r"\[0, 1\]"),
    (lambda: view.attention_heads(-causal(2, 8), tokens(8)), r"\[0, 1\]"),
    (lambda: view.attention_heads([["x"]], ["a"]), "numbers"),
])
def test_bad_input_is_one_clear_error(make, match):
    with pytest.raises(BadValue, match=match):
        make()


def test_nan_is_an_error_naming_the_heads():
    a = causal(3, 6)
    a[2, 4, 1] = float("nan")
    with pytest.raises(BadValue, match=r"NaN or inf in 1 head\(s\) \(head 2\)"):
        view.attention_heads(a, tokens(6))


def test_more_than_4096_tokens_points_to_the_streaming_view():
    a = torch.zeros(1, 4097, 4097)  # checked from the shape alone: no 4097^2 float work, no HTML
    with pytest.raises(UserError, match=r"4097 tokens .*interp\.view\.stats\(model\.attention_stats") as e:
        view.attention_heads(a, tokens(4097))
    assert "\n" not in str(e.value)


def test_rows_that_do_not_sum_to_one_are_shown_as_given_with_a_warning():
    a = causal(2, 10).numpy().copy()
    a[1, 3:5] *= 0.5  # two rows of head 1 sum to 0.5
    v = view.attention_heads(a, tokens(10))
    assert len(v.warnings) == 1 and "2 of 20 rows do not sum to 1" in v.warnings[0] and "head 1 (2)" in v.warnings[0]
    assert "not renormalised" in v._repr_html_() and 'class="warn"' in v._repr_html_()
    assert np.abs(weights(payload(v._repr_html_())) - a).max() <= 0.5 / 255 + 1e-7  # the halves, not renormalised
    assert view.attention_heads(causal(2, 10), tokens(10)).warnings == []


# ---- hostile strings ----------------------------------------------------------------------------------
HOSTILE = ["<script>window.__pwned=1</script>", "</script><img src=x onerror=window.__pwned=2>", "\"quote' `tick`",
           "<!--", "]]>", "&amp;&lt;", "\x00\x07\x1b[31m", "\u202eevil\u202c", "\u200f", "__DATA__", "__COMMON__"]


class _Tags(HTMLParser):
    def __init__(self):
        super().__init__()
        self.tags = []

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))


def test_hostile_tokens_and_names_never_become_markup():
    n = len(HOSTILE)
    v = view.attention_heads(causal(2, n), HOSTILE, attention_head_names=["<b>bold</b>", "</script>"],
                             title="<img src=x onerror=alert(1)>")
    html = v._repr_html_()
    parser = _Tags()
    parser.feed(html)
    tags = [t for t, _ in parser.tags]
    assert tags.count("script") == 2 and "img" not in tags and "b" not in tags  # ours only: the data and the code
    assert [a.get("type") for t, a in parser.tags if t == "script"] == ["application/json", None]
    d = payload(html)
    assert d["tokens"] == HOSTILE and d["heads"] == ["<b>bold</b>", "</script>"]  # the same strings, read back
    assert "&lt;img src=x onerror=alert(1)&gt;" in html  # the title, escaped
    assert v.html().count("<script") == 2


def test_two_views_never_share_an_id():
    a, b = (view.attention_heads(causal(1, 4), tokens(4))._repr_html_() for _ in range(2))
    ida, idb = (re.search(r'id="(interp-attn-[0-9a-f]+)"', h).group(1) for h in (a, b))
    assert ida != idb


# ---- save ---------------------------------------------------------------------------------------------
def test_save_writes_the_page_and_never_overwrites_a_file_it_did_not_write(tmp_path):
    v = view.attention_heads(causal(2, 6), tokens(6))
    out = v.save(tmp_path / "sub" / "f.html")
    page = out.read_text()
    assert page.startswith("<!DOCTYPE html>") and v._repr_html_() in page and "http" not in page.replace(
        "http-equiv", "")
    assert v.save(out) == out  # ours: replaced
    mine = tmp_path / "mine.html"
    mine.write_text("my notes")
    with pytest.raises(UserError, match="interp.view did not write it.*overwrite=True"):
        v.save(mine)
    assert mine.read_text() == "my notes"
    v.save(mine, overwrite=True)
    assert mine.read_text() == page
    with pytest.raises(UserError, match="is a folder"):
        v.save(tmp_path)
    assert not list(tmp_path.glob("**/.*.tmp"))


# ---- cache.view: the pattern of our model, against one computed here from q and k -------------------------
def test_cache_view_against_a_pattern_computed_from_q_and_k():
    model = interp.load("attn-only-2l")
    text = "def f(x):\n    return x + 1"
    names = ("blocks.1.attn.hook_pattern", "blocks.1.attn.hook_q", "blocks.1.attn.hook_k")
    _, cache = model.run_with_cache(text, names_filter=list(names))
    q, k = cache["q", 1][0].double(), cache["k", 1][0].double()  # [pos, head, d_head]
    n = q.shape[0]
    scores = torch.einsum("qhd,khd->hqk", q, k) / model.cfg.d_head ** 0.5
    want = scores.masked_fill(torch.triu(torch.ones(n, n, dtype=torch.bool), 1), float("-inf")).softmax(-1)
    v = cache.view(1, text)
    d = payload(v._repr_html_())
    assert d["tokens"] == model.to_str_tokens(text) and d["heads"] == [f"L1H{h}" for h in range(model.cfg.n_heads)]
    assert np.abs(weights(d) - want.numpy()).max() <= 0.5 / 255 + 1e-6
    assert payload(cache.view(-1)._repr_html_())["tokens"] == [str(i) for i in range(n)]  # no tokens: positions
    ids = model.to_tokens(text)
    assert payload(cache.view(1, ids)._repr_html_())["tokens"] == d["tokens"]
    with pytest.raises(KeyError, match="no attention pattern of layer 0"):
        cache.view(0)
    with pytest.raises(BadValue, match="batch 3"):
        cache.view(1, batch=3)


# ---- the streaming statistics view ------------------------------------------------------------------------
def test_stats_view_holds_the_kernel_statistics():
    model = interp.load("attn-only-2l")
    g = torch.Generator().manual_seed(0)
    r = torch.randint(1, 256, (1, 60), generator=g)
    ids = torch.cat([r, r], 1)
    stats = model.attention_stats(ids)
    v = view.stats(stats, model.to_str_tokens(ids[0]))
    d = payload(v._repr_html_())
    L, H, n = len(d["layers"]), d["heads"], d["n"]
    assert d["plotted"] == ["sink", "previous", "induction"] and d["fields"] == d["plotted"] + ["duplicate"]
    got = np.frombuffer(base64.b64decode(d["codes"]), np.uint8).reshape(L, 3, H, n) / 255  # plotted, per position
    for li, layer in enumerate(d["layers"]):
        for fi, field in enumerate(d["fields"]):
            want = getattr(stats[layer], field)[0].numpy()
            if fi < 3:
                assert np.abs(got[li, fi] - want).max() <= 0.5 / 255 + 1e-6, (layer, field)
            assert np.allclose(d["means"][li][fi], want.mean(-1), atol=1e-4)
    with pytest.raises(BadValue, match="119 tokens"):
        view.stats(stats, model.to_str_tokens(ids[0])[:-1])
    bad = dict(stats)
    bad[0] = type(stats[0])(**{**stats[0].to_dict(), "sink": stats[0].sink.clone().fill_(float("nan"))})
    with pytest.raises(BadValue, match="NaN"):
        view.stats(bad)
    with pytest.raises(BadValue, match="attention_stats"):
        view.stats({})


# ---- the atlas's head grid --------------------------------------------------------------------------------
def test_heads_grid_from_a_results_table():
    rows = [dict(run="r", checkpoint="c", step=5, analysis="induction", layer=l, head=h, metric="induction_score",
                 value=0.1 * l + 0.01 * h) for l in range(3) for h in range(4)]
    v = view.heads(pd.DataFrame(rows))
    frag = v._repr_html_()
    d = json.loads(re.search(r'class="data">(.*?)</script>', frag, re.S).group(1))
    (label, grid), = d["scores"].items()
    assert np.allclose(grid, [[0.1 * l + 0.01 * h for h in range(4)] for l in range(3)])
    assert d["n"] == 0 and d["n_layers"] == 3 and d["n_heads"] == 4  # a table has no pattern sample
    with pytest.raises(BadValue, match="missing columns"):
        view.heads(pd.DataFrame({"x": [1]}))
    with pytest.raises(BadValue, match="choose one with run"):
        view.heads(pd.DataFrame(rows + [dict(rows[0], run="s")]))
    with pytest.raises(UserError, match="not a folder"):
        view.heads("/nonexistent/folder")


# ---- the documentation quotes what is measured ------------------------------------------------------------------
README = __import__("pathlib").Path(__file__).resolve().parents[2] / "docs" / "views.md"  # linked from the README


def _readme_section() -> str:
    text = README.read_text()
    start = text.index("## Attention in a notebook")
    end = text.find("\n## ", start + 3)
    return text[start:] if end < 0 else text[start:end]


def test_readme_size_at_1024_tokens_9_heads_is_the_measured_one():
    v = view.attention_heads(causal(9, 1024), [f" x{i}" for i in range(1024)])  # as test_view_browser.py opens it
    size = len(v.html().encode())
    assert size <= 16e6
    assert f"{size / 1e6:.1f} MB page" in _readme_section(), size


def test_readme_images_exist():
    images = re.findall(r"\((images/view_[^)]+\.png)\)", _readme_section())
    assert len(images) == 3
    for rel in images:
        data = (README.parent / rel).read_bytes()
        assert data.startswith(b"\x89PNG") and len(data) > 10_000, rel


# ---- against CircuitsVis itself -------------------------------------------------------------------------------
def _cv_props(rendered) -> dict:
    """The props CircuitsVis renders its component with (its HTML: render("id", Component, {...}))."""
    return json.loads(re.search(r"render\(\s*\"[^\"]+\",\s*\w+,\s*(\{.*\})\s*\)", str(rendered), re.S).group(1))


def test_circuitsvis_calls_run_unchanged_and_carry_the_same_data():
    cv = pytest.importorskip("circuitsvis.attention", reason="pip install circuitsvis (the dev extra has it)")
    import inspect

    for name in ("attention_heads", "attention_patterns", "attention_pattern"):
        theirs, ours = inspect.signature(getattr(cv, name)), inspect.signature(getattr(view, name))
        positional = [p for p in theirs.parameters.values() if p.default is inspect.Parameter.empty]
        assert [p.name for p in positional] == list(ours.parameters)[:len(positional)], name  # same order
        assert set(theirs.parameters) <= set(ours.parameters), (name, set(theirs.parameters) - set(ours.parameters))
    a = causal(3, 11)
    toks = [f" t{i}" for i in range(11)]
    names = ["first", "second", "third"]
    for call in (lambda m: m.attention_heads(a, toks, names), lambda m: m.attention_heads(attention=a, tokens=toks,
                 attention_head_names=names, max_value=1.0, min_value=0.0, positive_color="#1f77b4",
                 mask_upper_tri=True), lambda m: m.attention_patterns(toks, a)):
        props = _cv_props(call(cv))
        d = payload(call(view)._repr_html_())
        assert d["tokens"] == props["tokens"]
        assert np.abs(weights(d) - np.array(props["attention"])).max() <= 0.5 / 255 + 1e-6
        if "attentionHeadNames" in props:
            assert d["heads"] == props["attentionHeadNames"]
    one = _cv_props(cv.attention_pattern(toks, a[0], show_axis_labels=True))
    d = payload(view.attention_pattern(toks, a[0], show_axis_labels=True)._repr_html_())
    assert np.abs(weights(d)[0] - np.array(one["attention"])).max() <= 0.5 / 255 + 1e-6


def test_one_packing_for_tensors_and_arrays():
    """The report viewer packs a tensor on its device, the views an array on the host: the same codes,
    halves rounded to even both ways, against round-half-even written here."""
    from interp.models.readouts.attention_view import codes_u8

    a = torch.cat([causal(2, 9).flatten(), torch.tensor([0.5 / 255, 1.5 / 255, 2.5 / 255, 1.0, 0.0])])
    on_device = codes_u8(a).numpy()
    on_host = codes_u8(a.numpy())
    assert on_device.dtype == on_host.dtype == np.uint8 and (on_device == on_host).all()
    assert on_host[-5:].tolist() == [0, 2, 2, 255, 0]


def test_views_of_device_tensors_leave_through_the_one_door():
    """On the CPU playing a GPU, with host copies refused but through `to_numpy`: the views take a model's
    device tensors as a GPU user would hand them over (a cache's pattern, the streaming statistics)."""
    from interp.testing import refuse_host_copies, simulated_gpu

    with simulated_gpu(), refuse_host_copies():
        model = interp.load("attn-only-2l")
        text = "for i in range(3): print(i)"
        _, cache = model.run_with_cache(text, names_filter="blocks.0.attn.hook_pattern")
        d = payload(cache.view(0, text)._repr_html_())
        d2 = payload(view.attention_heads(attention=cache["pattern", 0][0], tokens=model.to_str_tokens(text))._repr_html_())
        stats = payload(view.stats(model.attention_stats(model.to_tokens(text)))._repr_html_())
    assert d["codes"] == d2["codes"] and d["tokens"] == d2["tokens"] and stats["n"] == len(d["tokens"])


# ---- the drawing layer ---------------------------------------------------------------------------------
def test_the_drawing_needs_no_torch_and_every_template_ships_and_fills():
    """interp.drawing is below the models: numpy and strings only (a fresh interpreter imports it without
    torch), its template files are package data in pyproject.toml, and a drawn page keeps no placeholder."""
    import fnmatch
    import subprocess
    import sys
    import tempfile
    import tomllib
    from pathlib import Path

    import interp.drawing as drawing

    code = "import sys, interp.drawing; print('torch' in sys.modules, 'interp.models' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=tempfile.gettempdir()).stdout.split()
    assert out == ["False", "False"]
    root = Path(drawing.__file__).parent
    globs = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["interp.drawing"]
    files = [f.name for f in root.iterdir() if f.is_file() and f.suffix != ".py"]
    assert sorted(files) == ["common.css", "common.js", "features.html", "pattern.html", "stats.html"]
    assert all(any(fnmatch.fnmatch(f, g) for g in globs) for f in files)
    page = drawing.pattern_page(dict(tokens=["a"], heads=["h"], n=1, tri=True, codes=drawing.b64(drawing.codes_u8([[1.0]])),
                                     lo=0, hi=1, colour="red", mask=False, show_tokens=True, selected=0), "t", ["w"])
    assert not re.search(r"__[A-Z]+__", page.html()) and page.fragment.count('id="interp-attn-') == 1
