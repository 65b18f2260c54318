"""The README quotes the main job's results as the report states them, not typed by hand."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from interp.cli import main as cli

README = Path(__file__).resolve().parents[2] / "README.md"


@pytest.mark.slow
def test_readme_headline_is_the_reports(tmp_path, capsys):
    block = re.search(r"<!-- headline: interp sweep (\S+) -->\n(.*?)\n<!-- /headline -->", README.read_text(), re.S)
    assert block, "README.md lost its generated headline block"
    run, quoted = block.group(1), block.group(2).strip()
    out = tmp_path / "out"
    # the headline needs only these analyses; their numbers do not depend on the others
    assert cli(["sweep", run, "--out", str(out), "--analyses", "induction,previous_token,duplicate_token",
                "--no-progress", "--no-report"]) == 0
    capsys.readouterr()
    assert cli(["report", str(out), "--headline"]) == 0
    assert capsys.readouterr().out.strip() == quoted, "regenerate the block: interp report DIR --headline"
