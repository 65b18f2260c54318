"""Headless chromium for the browser tests (a support module: test files import this, never each other).
Debian's chromium, driven by Playwright pointed at the system binary (nothing downloaded); a test module
that imports this is skipped, saying why, where chromium or Playwright is missing. Screenshots go to the
test's temp folder, or to $INTERP_SCREENSHOTS when set (how docs/images/ are made)."""

from __future__ import annotations

import os
import shutil
from contextlib import contextmanager
from pathlib import Path

import pytest

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
needs_chromium = pytest.mark.skipif(CHROMIUM is None, reason="no chromium: apt-get install -y chromium (.ci/run does)")


def sync_api():
    return pytest.importorskip("playwright.sync_api", reason="pip install playwright (the dev extra has it)")


def shots(tmp_path: Path) -> Path:
    folder = Path(os.environ.get("INTERP_SCREENSHOTS", tmp_path / "screenshots"))
    folder.mkdir(parents=True, exist_ok=True)
    return folder


@contextmanager
def browser_page(width: int = 1200, height: int = 900):
    """(page, seen): `seen["errors"]` collects console errors and page errors, `seen["requests"]` every URL
    the page asked for other than file: and data: ones (those are refused, so a test sees any attempt)."""
    api = sync_api()
    with api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        try:
            page = browser.new_page(viewport={"width": width, "height": height})
            seen: dict = {"errors": [], "requests": [], "dialogs": []}
            page.on("console", lambda m: seen["errors"].append(m.text) if m.type == "error" else None)
            page.on("pageerror", lambda e: seen["errors"].append(str(e)))
            page.on("dialog", lambda d: (seen["dialogs"].append(d.message), d.dismiss()))

            def route(r):
                url = r.request.url
                if url.startswith(("file:", "data:", "about:")):
                    return r.continue_()
                seen["requests"].append(url)
                return r.abort()

            page.route("**/*", route)
            yield page, seen
        finally:
            browser.close()
