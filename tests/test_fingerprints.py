"""Checkpoints that are not what their steps say (issue 56, checkpoint integrity; pythia#205: 86 of 154
pythia-2.8b branches serve final-era weights). A sweep fingerprints each checkpoint it loads; identical
weights and a step much nearer a later step than its neighbours are named in the sweep's log, the report and
fingerprints.csv."""

from __future__ import annotations

import shutil

import pandas as pd
import torch
from sweep_fixtures import CFG, settings

import interp
from interp.analyses.atlas.fingerprints import findings, fingerprint, identical, out_of_place
from interp.analyses.atlas.sweep import sweep

STEPS = (0, 100, 200, 400, 800)


def _trajectory(root, copy_final_to: int | None = None):
    """A run whose weights move along a line from step 0 to step 800 (as training drifts), each checkpoint
    with a little noise of its own; `copy_final_to`: that step's folder serves step 800's weights."""
    torch.manual_seed(0)
    start, end = interp.HookedTransformer(CFG, seed=1), interp.HookedTransformer(CFG, seed=2)
    run = root / "run"
    for step in STEPS:
        model = interp.HookedTransformer(CFG, seed=3)
        with torch.no_grad():
            for (name, p), a, b in zip(model.named_parameters(), start.parameters(), end.parameters()):
                p.copy_(a + (b - a) * step / STEPS[-1] + 1e-3 * torch.randn_like(p))
        interp.save_model(model, run / f"step{step}", meta={"step": step})
    if copy_final_to is not None:
        shutil.rmtree(run / f"step{copy_final_to}")
        shutil.copytree(run / f"step{STEPS[-1]}", run / f"step{copy_final_to}")
        meta = run / f"step{copy_final_to}" / "meta.json"
        meta.write_text(meta.read_text().replace(f'"step": {STEPS[-1]}', f'"step": {copy_final_to}'))
    return run


def test_the_fingerprint_sees_one_changed_value_and_survives_a_save(tmp_path):
    model = interp.HookedTransformer(CFG, seed=0)
    first = fingerprint(model)
    interp.save_model(model, tmp_path / "m")
    assert fingerprint(interp.load(tmp_path / "m")) == first
    with torch.no_grad():
        next(model.parameters()).view(-1)[7] += 1e-6
    changed = fingerprint(model)
    assert changed["weights"] != first["weights"] and len(changed["sketch"]) == len(first["sketch"])


def test_final_weights_served_at_an_early_step_are_named(tmp_path):
    run = _trajectory(tmp_path, copy_final_to=200)
    lines = []
    result = sweep([str(run)], tmp_path / "out", settings(["loss"]), progress=False, log=lines.append)
    said = "\n".join(lines)
    assert "checkpoint integrity: run: identical weights at step200, step800" in said
    assert "step200 is closer to the later step800" in said
    assert result.integrity == findings(_prints(tmp_path / "out"))
    csv = pd.read_csv(tmp_path / "out" / "fingerprints.csv")
    assert len(csv) == len(STEPS) and csv.weights.nunique() == len(STEPS) - 1
    report = (tmp_path / "out" / "report.md").read_text()
    assert "identical weights at step200, step800" in report


def test_a_run_that_moves_as_its_steps_say_has_no_findings(tmp_path):
    run = _trajectory(tmp_path)
    result = sweep([str(run)], tmp_path / "out", settings(["loss"]), progress=False, log=lambda *a: None)
    prints = _prints(tmp_path / "out")
    assert result.integrity == [] and identical(prints) == [] and out_of_place(prints) == []
    assert "Every checkpoint's weights differ" in (tmp_path / "out" / "report.md").read_text()


def _prints(out):
    from interp.analyses.store import ResultStore

    return ResultStore(out).fingerprints()


def test_a_tensor_past_float32s_whole_numbers_is_sampled_inside_it():
    """SmolLM2's embedding (28,311,552 values): a float32 linspace of its indices ended one past the end."""
    class Big(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.arange(2**24 + 3, dtype=torch.float32))

    sketch = fingerprint(Big())["sketch"]
    assert len(sketch) == 2048 and sketch[0] == 0 and sketch[-1] == 2**24 + 2
