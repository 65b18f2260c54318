"""Checkpoints that are not what their steps say (issue 56, checkpoint integrity; pythia#205: 86 of 154
pythia-2.8b branches serve final-era weights). A sweep fingerprints each checkpoint it loads; identical
weights, near-copies (and which of them are the copies) and a step out of place are named in the sweep's log,
the report, its headline and fingerprints.csv. Issue 65: a fingerprint guards the rows beside it (a checkpoint
whose weights changed is recomputed on resume), near-copies are found over the whole run's distance matrix, and
a fingerprint file is validated and checked against its checkpoint's files before it is trusted."""

from __future__ import annotations

import functools
import json

import numpy as np
import pandas as pd
import torch
from sweep_fixtures import CFG, make_run, settings

import interp
from interp.analyses.atlas.fingerprints import CHUNK, SKETCH, findings, fingerprint, identical, kept, out_of_place
from interp.analyses.atlas.report import headline
from interp.analyses.atlas.sweep import sweep
from interp.analyses.document import md_escape
from interp.cli import main as cli

STEPS = (0, 100, 200, 400, 800)
LONG = tuple(range(0, 1000, 100))  # ten checkpoints, step 0 to step 900


@functools.lru_cache(maxsize=None)
def _ends():
    return interp.HookedTransformer(CFG, seed=1), interp.HookedTransformer(CFG, seed=2)


def _genuine(position: float, last: int, seed: int | None = None):
    """The weights at `position` of a run drifting along a line from seed 1's to seed 2's by step `last`, with a
    little noise of their own (the same for the same position, unless `seed` says otherwise)."""
    start, end = _ends()
    torch.manual_seed(int(position) if seed is None else seed)
    model = interp.HookedTransformer(CFG, seed=3)
    with torch.no_grad():
        for p, a, b in zip(model.parameters(), start.parameters(), end.parameters()):
            p.copy_(a + (b - a) * position / last + 1e-3 * torch.randn_like(p))
    return model


def _trajectory(root, steps=STEPS, holds: dict | None = None, jitter: float = 0.0, copy_final_to: int | None = None):
    """A run whose weights move along a line from its first step to its last (as training drifts). `holds`
    {step: other step}: that step's folder serves the other step's weights, byte for byte or plus `jitter` noise;
    `copy_final_to`: that step's folder serves the last step's."""
    holds = {**(holds or {}), **({copy_final_to: steps[-1]} if copy_final_to is not None else {})}
    run = root / "run"
    for step in steps:
        model = _genuine(holds.get(step, step), steps[-1])
        if step in holds and jitter:
            torch.manual_seed(10_000 + step)
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(jitter * torch.randn_like(p))
        interp.save_model(model, run / f"step{step}", meta={"step": step})
    return run


def _fix(run, steps, last):
    """Each of `steps` saved again with its own step's weights (the run's checkpoints repaired)."""
    for step in steps:
        interp.save_model(_genuine(step, last), run / f"step{step}", meta={"step": step})


def _prints(out):
    return kept(out).prints


def _rows(out, steps=None):
    table = pd.read_csv(out / "results.csv")
    table = table[table.step.isin(steps)] if steps is not None else table
    return table.sort_values(["step", "analysis", "metric", "layer", "head"]).reset_index(drop=True)


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
    assert "checkpoint integrity: run: step200 holds a copy of step800's weights" in said  # the copy, not step800
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


def test_every_value_of_every_tensor_moves_the_sketch_and_its_distances_are_the_weights():
    """The sketch was a sample of 2048 values: a change anywhere else left it unchanged, and two checkpoints
    differing only there measured 0 apart (near-copies that are not)."""
    class Big(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.arange(2 * CHUNK + 5, dtype=torch.float32) / CHUNK)

    model = Big()
    first = np.asarray(fingerprint(model)["sketch"])
    with torch.no_grad():
        model.w[5] += 0.25  # in the first million values read
        model.w[CHUNK + 9] -= 0.5  # in the second
    moved = np.asarray(fingerprint(model)["sketch"]) - first
    assert len(first) == SKETCH and sorted(np.flatnonzero(np.abs(moved) > 1e-9)) == [5, 9]
    assert sorted(np.abs(moved[[5, 9]]).round(9)) == [0.25, 0.5]
    a, b = interp.HookedTransformer(CFG, seed=0), interp.HookedTransformer(CFG, seed=1)
    true = float(torch.sqrt(sum(((p - q) ** 2).sum() for p, q in zip(a.state_dict().values(), b.state_dict().values()))))
    sketched = float(np.linalg.norm(np.subtract(fingerprint(a)["sketch"], fingerprint(b)["sketch"])))
    assert abs(sketched / true - 1) < 0.15


def test_checkpoints_repaired_after_a_sweep_are_recomputed_on_resume(tmp_path):
    """Issue 65, 2: steps 500-800 serve step 900's weights; the sweep names them. The run is repaired and the
    sweep resumed into the same --out: it recomputed nothing and kept the finding, now false, beside the old rows."""
    broken = {s: 900 for s in (500, 600, 700, 800)}
    run = _trajectory(tmp_path, LONG, holds=broken)
    out = tmp_path / "out"
    first = sweep([str(run)], out, settings(["loss"]), progress=False, log=lambda *a: None)
    assert first.integrity[0].startswith("run: identical weights at step500, step600, step700, step800, step900")
    _fix(run, broken, LONG[-1])
    lines = []
    again = sweep([str(run)], out, settings(["loss"]), progress=False, log=lines.append)
    said = [line for line in lines if "its weights are not those its results were computed from" in line]
    assert [line.split(":")[0] for line in said] == [f"run/step{s}" for s in broken]
    assert all(line.endswith("recomputing loss") for line in said)
    assert again.n_run == len(broken) and again.integrity == []
    fresh = sweep([str(run)], tmp_path / "fresh", settings(["loss"]), progress=False, log=lambda *a: None)
    pd.testing.assert_frame_equal(_rows(out), _rows(tmp_path / "fresh"))
    assert fresh.integrity == [] and "checkpoint integrity" not in headline(out)
    assert "Every checkpoint's weights differ" in (out / "report.md").read_text()
    quiet = sweep([str(run)], out, settings(["loss"]), progress=False, log=lambda *a: None)
    assert quiet.n_run == 0 and quiet.n_skipped == len(LONG)  # once recomputed, trusted again


def test_resuming_with_another_analysis_recomputes_the_stale_rows_too(tmp_path, monkeypatch):
    """Issue 65, 2: resuming with an analysis added rewrote every fingerprint (the finding vanished, the report
    said every checkpoint differs) and kept the old rows of the repaired checkpoints beside the new ones."""
    from interp.models.formats import checkpoint

    broken = {s: 900 for s in (700, 800)}
    run = _trajectory(tmp_path, LONG, holds=broken)
    out = tmp_path / "out"
    sweep([str(run)], out, settings(["loss"]), progress=False, log=lambda *a: None)
    _fix(run, broken, LONG[-1])
    loads = []
    real = checkpoint.load_checkpoint
    monkeypatch.setattr(checkpoint, "load_checkpoint", lambda path, **kw: loads.append(path) or real(path, **kw))
    lines = []
    result = sweep([str(run)], out, settings(["loss", "previous_token"]), progress=False, log=lines.append)
    assert [line for line in lines if "recomputing loss" in line] == [
        f"run/step{s}: its weights are not those its results were computed from (fingerprint "
        f"{_print_of(out, 900)[:12]}, now {_print_of(out, s)[:12]}): recomputing loss" for s in broken]
    assert len(loads) == len(LONG) and result.n_run == len(LONG) + len(broken) and result.integrity == []
    sweep([str(run)], tmp_path / "fresh", settings(["loss", "previous_token"]), progress=False, log=lambda *a: None)
    pd.testing.assert_frame_equal(_rows(out), _rows(tmp_path / "fresh"))


def _print_of(out, step):
    return json.loads((out / "fingerprints" / "run" / f"step{step}.json").read_text())["weights"]


def test_near_copies_of_the_final_weights_are_named_in_the_report_and_headline(tmp_path, capsys):
    """Issue 65, 3: steps 500-800 hold step 900's weights plus 1e-6 noise. Each was compared with its neighbours
    only, near-copies too: nothing was flagged, and the report said all is well."""
    run = _trajectory(tmp_path, LONG, holds={s: 900 for s in (500, 600, 700, 800)}, jitter=1e-6)
    result = sweep([str(run)], tmp_path / "out", settings(["loss"]), progress=False, log=lambda *a: None)
    near, blame = result.integrity
    assert near.startswith("run: near-copies at step500..step900 (5 checkpoints): their weights lie within ")
    assert "from any other checkpoint (the nearest, step400)" in near
    assert blame.startswith("run: step500..step800 (4 checkpoints) hold copies of step900's weights")
    assert identical(_prints(tmp_path / "out")) == [] and out_of_place(_prints(tmp_path / "out")) == []
    assert cli(["report", str(tmp_path / "out"), "--headline"]) == 0
    assert f"checkpoint integrity: {near}" in capsys.readouterr().out
    summary = (tmp_path / "out" / "report.md").read_text().split("Errors and skipped checkpoints")[0]
    assert "near-copies at step500..step900" in summary and "hold copies of step900" in summary

    clean = _trajectory(tmp_path / "clean", LONG)  # the same run, every step its own
    assert sweep([str(clean)], tmp_path / "clean_out", settings(["loss"]), progress=False,
                 log=lambda *a: None).integrity == []


def test_last_checkpoints_copying_an_early_one_blame_the_copies_not_the_early_step(tmp_path):
    """Issue 65, 3: steps 700-900 serve step 200's weights. The genuine step 200 was named "closer to the later
    step700 than to the checkpoints beside it"; the copies, byte for byte or with 1e-6 noise, were not."""
    for jitter in (0.0, 1e-6):
        root = tmp_path / f"jitter{jitter}"
        run = _trajectory(root, LONG, holds={700: 200, 800: 200, 900: 200}, jitter=jitter)
        found = sweep([str(run)], root / "out", settings(["loss"]), progress=False, log=lambda *a: None).integrity
        assert "run: step700..step900 (3 checkpoints) hold copies of step200's weights (step200 fits its place" \
            in "\n".join(found)
        assert not any("step200 is" in line or "step200 holds" in line for line in found), found
        assert out_of_place(_prints(root / "out")) == []


def test_a_displaced_step_is_blamed_not_the_genuine_step_it_resembles(tmp_path):
    """A step holding another step's weights (not a copy of a served one: its own noise) is named; the genuine
    step it resembles is not, whether the displaced one is earlier (step 200 holding step 700's weights) or later
    (step 800 holding step 100's, which named step 100)."""
    for displaced, source in ((200, 700), (800, 100)):
        root = tmp_path / f"step{displaced}"
        run = _trajectory(root, LONG)
        interp.save_model(_genuine(source, LONG[-1], seed=99), run / f"step{displaced}", meta={"step": displaced})
        found = sweep([str(run)], root / "out", settings(["loss"]), progress=False, log=lambda *a: None).integrity
        where = "later" if source > displaced else "earlier"
        assert len(found) == 1 and found[0].startswith(f"run: step{displaced} is closer to the {where} step{source} "), found


def test_a_malformed_fingerprint_file_is_named_in_one_line_and_taken_again(tmp_path, capsys):
    """A crafted fingerprint file gave a 27-line traceback (KeyError: 'weights') in the sweep and the report."""
    run = make_run(tmp_path)
    out = tmp_path / "out"
    sweep([str(run)], out, settings(["loss"]), progress=False, log=lambda *a: None)
    bad = {"step50": json.dumps({"run": "run", "checkpoint": "step50", "step": 50}), "step200": "{not json"}
    for name, text in bad.items():
        (out / "fingerprints" / "run" / f"{name}.json").write_text(text)
    assert cli(["report", str(out)]) == 0
    report = (out / "report.md").read_text()
    assert md_escape(f"{out / 'fingerprints' / 'run' / 'step50.json'} (no 'weights'): not a fingerprint interp wrote; "
                     "rerun interp sweep with this --out") in report
    assert md_escape(f"{out / 'fingerprints' / 'run' / 'step200.json'} (JSONDecodeError): not a fingerprint") in report
    assert cli(["report", str(out), "--headline"]) == 0
    lines = []
    result = sweep([str(run)], out, settings(["loss"]), progress=False, log=lines.append)
    named = [line for line in lines if "not a fingerprint interp wrote" in line]
    assert len(named) == 2 and all(line.startswith("note: ") and "\n" not in line for line in named)
    assert "note: 2 checkpoint(s) with every result finished are loaded again" in "\n".join(lines)
    assert result.n_run == 0 and kept(out).malformed == [] and len(kept(out).prints) == 3


def test_a_forged_or_foreign_fingerprint_makes_no_finding(tmp_path, capsys):
    """A forged hash (step 300's file given step 900's) made a false "identical weights" finding, and so did the
    fingerprint of a checkpoint that is not in the run."""
    run = _trajectory(tmp_path, LONG)
    out = tmp_path / "out"
    sweep([str(run)], out, settings(["loss"]), progress=False, log=lambda *a: None)
    folder = out / "fingerprints" / "run"
    forged = json.loads((folder / "step300.json").read_text())
    (folder / "step300.json").write_text(json.dumps({**forged, "weights": _print_of(out, 900)}))
    ghost = json.loads((folder / "step400.json").read_text())
    (folder / "ghost.json").write_text(json.dumps({**ghost, "checkpoint": "ghost", "step": 950}))
    assert cli(["report", str(out), "--headline"]) == 0
    assert "identical" not in capsys.readouterr().out
    assert cli(["report", str(out)]) == 0
    report = (out / "report.md").read_text()
    assert "identical weights" not in report and "every checkpoint's weights differ" in report
    assert md_escape("their hashes agree and their sketches do not (a file was changed outside interp): run/step300, "
                     "run/step900") in report
    assert md_escape("fingerprints ignored, of checkpoints not in this folder's runs: run/ghost") in report
    lines = []
    result = sweep([str(run)], out, settings(["loss"]), progress=False, log=lines.append)
    assert "note: fingerprints ignored, of checkpoints not in this folder's runs: run/ghost" in lines
    assert [line.split(":")[0] for line in lines if "not those its results" in line] == ["run/step300"]
    assert result.n_run == 1 and result.integrity == [] and _print_of(out, 300) != _print_of(out, 900)


def test_the_report_does_not_trust_a_fingerprint_whose_checkpoint_changed_since(tmp_path, capsys):
    """Repaired after the sweep, without a resume: the report and headline still named identical weights."""
    run = _trajectory(tmp_path, copy_final_to=200)
    out = tmp_path / "out"
    sweep([str(run)], out, settings(["loss"]), progress=False, log=lambda *a: None)
    assert "identical weights at step200, step800" in headline(out)
    _fix(run, [200], STEPS[-1])
    assert cli(["report", str(out), "--headline"]) == 0
    assert "identical" not in capsys.readouterr().out
    assert cli(["report", str(out)]) == 0
    report = (out / "report.md").read_text()
    assert md_escape("taken by an older interp or before their checkpoint's files changed: run/step200; rerun interp "
                     "sweep with this --out") in report
    assert "identical weights" not in report
