"""`interp analyze FOLDER` on a saved Hugging Face folder of every native family (and one wrapped
architecture): the atlas's head analyses run end to end from the folder a researcher has, each row finite."""

from __future__ import annotations

import pandas as pd
import pytest
import torch

from interp.cli import main as cli
from interp.models.families import FAMILIES

pytest.importorskip("transformers")
from arch_cases import COVERED, builder  # noqa: E402 - needs transformers

NATIVE = [t for t in COVERED if t in FAMILIES]


@pytest.mark.slow
@pytest.mark.parametrize("model_type", [*NATIVE, "phi"])
def test_analyze_a_saved_folder(model_type, tmp_path, capsys):
    hf = builder(model_type)()
    hf.config.max_position_embeddings = max(getattr(hf.config, "max_position_embeddings", 0) or 0, 64)
    if getattr(hf.config, "n_positions", None):
        hf.config.n_positions = max(hf.config.n_positions, 64)
    folder, out = tmp_path / model_type, tmp_path / "out"
    hf.save_pretrained(folder)
    assert cli(["analyze", str(folder), "--out", str(out), "--seq-len", "24", "--n-seqs", "2", "--no-progress",
                "--no-report", "--analyses", "previous_token,duplicate_token,induction,sinks,ablation"]) == 0, \
        capsys.readouterr().out
    table = pd.read_csv(out / "results.csv")
    assert {"previous_token", "duplicate_token", "induction", "sinks", "ablation"} <= set(table["analysis"])
    assert table["value"].notna().all() and torch.isfinite(torch.tensor(table["value"].to_numpy())).all()
