"""What CHANGELOG.md says moved (a support module: test_packaging.py and test_names.py read it)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def moved_modules(root: Path = ROOT) -> dict[str, str]:
    """{old module path: new} as CHANGELOG.md's table of removed module paths lists them."""
    text = (root / "CHANGELOG.md").read_text()
    section = text.split("### Removed: the old module paths", 1)[1].split("\n### ", 1)[0]
    return dict(re.findall(r"^\| `(interp[\w.]*)` \| `(interp[\w.]*)`.*\|$", section, re.M))
