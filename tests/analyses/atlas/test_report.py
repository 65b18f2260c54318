"""Reports: every section present, images inlined, no external assets, the phase change found, and
(where Chromium is installed) a non-blank render."""

from __future__ import annotations

import base64
import shutil
import subprocess
import tempfile
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from interp.analyses.atlas.report import SECTION_IDS, phase_change, write_report
from interp.analyses.store import as_table
from interp.analyses.atlas.sweep import DEFAULT_ANALYSES, sweep

from sweep_fixtures import make_run, settings

PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def swept(tmp_path_factory):
    """A sweep of every default analysis over a 3-checkpoint run, with one truncated checkpoint."""
    root = tmp_path_factory.mktemp("report")
    run = make_run(root, steps=(0, 50, 120, 200))
    weights = run / "step120" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    out = root / "out"
    sweep([str(run)], out, settings(DEFAULT_ANALYSES, expensive_on="last"), progress=False, log=lambda *_: None)
    return out


class _Collect(HTMLParser):
    def __init__(self):
        super().__init__()
        self.ids, self.imgs, self.external, self.text = [], [], [], []

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if "id" in attrs:
            self.ids.append(attrs["id"])
        if tag == "img":
            self.imgs.append(attrs.get("src", ""))
        for key in ("src", "href"):
            value = attrs.get(key) or ""
            if value and not value.startswith(("data:", "#")):
                self.external.append((tag, value))
        if tag == "link" or (tag == "script" and "src" in attrs):  # inline scripts (the viewer) are fine
            self.external.append((tag, attrs))

    def handle_data(self, data):
        self.text.append(data)


def test_html_has_every_section_and_only_inline_images(swept):
    page = _Collect()
    page.feed((swept / "report.html").read_text())
    assert [i for i in page.ids if i in SECTION_IDS] == list(SECTION_IDS)
    assert not page.external, f"the report must open offline, found {page.external}"
    assert len(page.imgs) >= 7  # heatmaps, small multiples, curves, sinks, ablation, pruning, attribution
    for src in page.imgs:
        assert src.startswith("data:image/png;base64,")
        assert base64.b64decode(src.split(",", 1)[1]).startswith(PNG)
    text = " ".join(page.text)
    assert "step120" in text and "CheckpointError" in text  # the truncated checkpoint is reported
    assert "Not run in this sweep" not in text


def test_markdown_links_existing_figures(swept):
    md = (swept / "report.md").read_text()
    figures = [line.split("](", 1)[1].rstrip(")") for line in md.splitlines() if line.startswith("![")]
    assert len(figures) >= 7
    for f in figures:
        assert (swept / f).read_bytes().startswith(PNG)
    for title in ("## Summary", "## Head ablation", "## Pruning curve", "## Attention sinks"):
        assert title in md
    assert "| layer | head | delta mean | delta resample | delta zero |" in md  # the ablation table


def test_report_of_a_partial_sweep_says_what_was_not_run(tmp_path):
    """Sections without data are left out; the summary names what was not run and how to add it."""
    run = make_run(tmp_path, steps=(0, 10))
    out = tmp_path / "out"
    sweep([str(run)], out, settings(["previous_token"]), progress=False, report=False, log=lambda *_: None)
    write_report(out)
    page = _Collect()
    page.feed((out / "report.html").read_text())
    text = " ".join(page.text)
    assert "Not run here (add to --analyses): " in text
    for analysis, section in (("sinks", "sinks"), ("ablation", "ablation"), ("pruning", "pruning"),
                              ("importance", "attribution")):
        assert f"`{analysis}`" in text.split("Not run here")[1].split(".")[0]
        assert section not in page.ids


def test_phase_change_is_the_steepest_rise_outside_layer_zero():
    steps = [0, 100, 200, 400, 600, 700, 800, 1000, 2000]
    rise = {600: 0.1, 700: 0.6, 800: 0.8}  # the jump: 600 -> 700
    rows = []
    for s in steps:
        level = 0.05 if s < 600 else rise.get(s, 0.85)
        rows += [dict(run="r", checkpoint=f"s{s}", step=s, analysis="induction", layer=1, head=0,
                      metric="induction_score", value=level),
                 dict(run="r", checkpoint=f"s{s}", step=s, analysis="induction", layer=1, head=1,
                      metric="induction_score", value=0.02),
                 # a layer-0 head jumping early must not count: layer 0 cannot be an induction head
                 dict(run="r", checkpoint=f"s{s}", step=s, analysis="induction", layer=0, head=0,
                      metric="induction_score", value=0.9 if s >= 100 else 0.0)]
    phase = phase_change(as_table(pd.DataFrame(rows)))
    assert (phase["start"], phase["end"]) == (600, 700)
    assert phase["score_before"] == pytest.approx(0.1) and phase["score_after"] == pytest.approx(0.6)
    flat = as_table(pd.DataFrame([dict(r, value=0.1) for r in rows if r["layer"] == 1]))
    assert phase_change(flat) is None


@pytest.mark.skipif(shutil.which("chromium") is None and shutil.which("chromium-browser") is None,
                    reason="chromium is not installed")
def test_renders_in_headless_chromium(swept, tmp_path):
    import matplotlib.image

    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    shot = tmp_path / "report.png"
    subprocess.run(
        [browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--no-first-run", f"--user-data-dir={tempfile.mkdtemp()}",
         "--window-size=1200,2400", f"--screenshot={shot}", (swept / "report.html").as_uri()],
        check=True, capture_output=True, timeout=120, cwd=tmp_path)
    pixels = matplotlib.image.imread(shot)[..., :3]
    assert pixels.shape[0] >= 1000
    ink = (pixels < 0.9).any(axis=-1)  # not white
    assert ink.mean() > 0.02, "the screenshot is blank"
    colourful = np.ptp(pixels, axis=-1) > 0.2  # heatmaps and curves, not only black text
    assert colourful.mean() > 0.005
