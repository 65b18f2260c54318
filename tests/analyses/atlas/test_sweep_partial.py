"""A sweep that did not complete is never read as one that did (issue 56, D1). Killed mid-run, its merged
table was read as final: the headline named step 200 as "the last checkpoint" and a phase change that the
finished sweep places elsewhere, `load_results` returned the stale table, and results.csv and
results.parquet disagreed. Now progress.json says whether the sweep completed and how many rows its tables
hold; a reader of an incomplete one reads the parts and says "partial: N of M checkpoints"."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pandas as pd
import pytest
from sweep_fixtures import make_run, settings

from interp.analyses.atlas.report import headline, write_report
from interp.analyses.atlas.sweep import sweep
from interp.analyses.store import PROGRESS, PartialResults, ResultStore, load_results
from interp.cli import main as cli

QUIET = dict(progress=False, report=False, log=lambda *_: None, merge_every=0.0)
ANALYSES = ("previous_token", "loss")


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    return make_run(tmp_path_factory.mktemp("runs"), steps=(0, 50, 200, 400))


def _kill_sweep(run_dir, out, after: int) -> None:
    """`interp sweep` killed with SIGKILL (no cleanup runs) once `after` parts are written."""
    code = (f"import os, signal\nfrom sweep_fixtures import settings\nfrom interp.analyses.atlas.sweep import sweep\n"
            f"def kill(n):\n    if n >= {after}: os.kill(os.getpid(), signal.SIGKILL)\n"
            f"sweep([{str(run_dir)!r}], {str(out)!r}, settings({ANALYSES!r}), executor=None, progress=False, "
            f"report=False, log=lambda *_: None, merge_every=0.0, on_part=kill)")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[2] / "support")}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, cwd=tempfile.gettempdir())
    assert done.returncode == -9, done.stderr


def test_a_killed_sweep_is_partial_everywhere_it_is_read(run_dir, tmp_path, capsys):
    out = tmp_path / "out"
    _kill_sweep(run_dir, out, after=3)  # two analyses a checkpoint: the first checkpoint and half the second
    assert json.loads((out / PROGRESS).read_text())["complete"] is False
    with pytest.warns(PartialResults, match=r"partial: 1 of 4 checkpoints"):
        table = load_results(out)
    assert table.attrs["partial"] == "partial: 1 of 4 checkpoints"
    assert len(table) == len(ResultStore(out).table())  # the parts, not a table merged before the kill
    said = headline(out)
    assert "(partial: 1 of 4 checkpoints, not final): best heads at the latest finished checkpoint" in said
    assert "at the last checkpoint" not in said
    assert cli(["report", str(out), "--headline"]) == 0
    assert "partial: 1 of 4 checkpoints, not final" in capsys.readouterr().out
    write_report(out)
    assert "this sweep did not complete" in (out / "report.md").read_text()

    # finished by a rerun: complete, and the same table as a sweep that never stopped
    sweep([str(run_dir)], out, settings(ANALYSES), **QUIET)
    whole = tmp_path / "whole"
    sweep([str(run_dir)], whole, settings(ANALYSES), **QUIET)
    assert json.loads((out / PROGRESS).read_text())["complete"] is True
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error", PartialResults)
        finished = load_results(out)
    assert "partial" not in finished.attrs and "partial" not in headline(out)
    pd.testing.assert_frame_equal(finished.drop(columns="run"), load_results(whole).drop(columns="run"))


def test_an_interrupted_sweep_is_partial_too(run_dir, tmp_path):
    """An exception (Ctrl-C) runs the final merge; it is marked partial, not complete."""
    out = tmp_path / "out"

    def interrupt(n):
        if n == 5:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        sweep([str(run_dir)], out, settings(ANALYSES), on_part=interrupt, **QUIET)
    with pytest.warns(PartialResults, match="partial: 2 of 4 checkpoints"):
        load_results(out)


def test_a_table_that_is_not_the_one_recorded_is_rebuilt_from_the_parts(run_dir, tmp_path):
    """A kill between writing results.csv and results.parquet left them one merge apart; progress.json is
    written after both, so a table whose rows are not the recorded count is not read."""
    out = tmp_path / "out"
    sweep([str(run_dir)], out, settings(ANALYSES), **QUIET)
    truth = load_results(out)
    stale = truth.iloc[: len(truth) // 2]
    stale.to_csv(out / "results.csv", index=False)
    if (out / "results.parquet").exists():
        stale.to_parquet(out / "results.parquet", index=False)
    pd.testing.assert_frame_equal(load_results(out), truth)
