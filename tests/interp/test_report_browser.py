"""Reports opened in a real browser: Debian's chromium, driven headless by Playwright (pointed at the
system binary, so nothing is downloaded). The page loads with no console error, and the attention
viewer answers a click on the head grid and a hover on a token. Screenshots go to the test's temp
folder, or to $INTERP_SCREENSHOTS when set. Skipped, saying why, where chromium or Playwright is missing."""

from __future__ import annotations

from pathlib import Path

import pytest
from headless import CHROMIUM, needs_chromium
from headless import shots as _shots
from headless import sync_api as _sync_api
from smol import needs_smol, smollm2_atlas

from interp.cli import main as cli

pytestmark = needs_chromium
sync_api = _sync_api()


def exercise(report: Path, shots: Path, name: str) -> dict:
    """Open `report`, click a head in the viewer's grid, hover a token; return what the page showed."""
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 1200, "height": 900})
        errors: list[str] = []
        page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.goto(report.resolve().as_uri())
        page.wait_for_load_state("load")
        page.screenshot(path=str(shots / f"{name}_report.png"), full_page=True)
        viewer = page.locator(".attn-viewer").first
        first = viewer.get_attribute("data-selected")
        viewer.locator(".grid div[data-layer='0'][data-head='1']").click()
        clicked = viewer.get_attribute("data-selected")
        label = viewer.locator(".label").inner_text()
        token = viewer.locator(".tok").nth(8)
        token.hover()
        weights = [viewer.locator(".tok").nth(i).get_attribute("data-weight") for i in range(9)]
        hovered = token.get_attribute("class")
        viewer.scroll_into_view_if_needed()
        viewer.screenshot(path=str(shots / f"{name}_viewer.png"))
        images = page.eval_on_selector_all("img", "els => els.map(e => e.naturalWidth)")
        browser.close()
    return dict(errors=errors, first=first, clicked=clicked, label=label, weights=weights, hovered=hovered,
                images=images)


def _check(seen: dict, shots: Path, name: str) -> None:
    assert seen["errors"] == [], seen["errors"]
    assert seen["first"] and seen["clicked"] == "L0H1" and "L0H1" in seen["label"]
    assert "hover" in seen["hovered"]
    weights = [float(w) for w in seen["weights"]]  # row 8 of L0H1's pattern: keys 0..8, a distribution
    assert sum(weights) == pytest.approx(1.0, abs=0.02)
    assert seen["images"] and min(seen["images"]) > 0  # every figure decoded
    for suffix in ("report", "viewer"):
        assert (shots / f"{name}_{suffix}.png").stat().st_size > 10_000


def test_zoo_sweep_report_in_a_browser(tmp_path):
    out = tmp_path / "out"
    assert cli(["sweep", "attn-only-2l", "--out", str(out), "--analyses", "induction,previous_token,sinks,viewer",
                "--no-progress"]) == 0
    shots = _shots(tmp_path)
    _check(exercise(out / "report.html", shots, "attn-only-2l"), shots, "attn-only-2l")


@needs_smol
@pytest.mark.slow
def test_real_model_atlas_in_a_browser(tmp_path):
    out = smollm2_atlas(tmp_path / "atlas", seq_len=64, analyses="previous_token,induction,sinks,viewer")
    shots = _shots(tmp_path)
    seen = exercise(out / "report.html", shots, "smollm2-135m")
    _check(seen, shots, "smollm2-135m")
