"""Executors: a real local Ray cluster and local worker processes give the in-process table exactly."""

from __future__ import annotations

import pandas as pd
import pytest

from interp.analyses.atlas.executors import ExecutorSettings
from interp.analyses.atlas.sweep import sweep

from sweep_fixtures import CHEAP, STEPS, make_run, settings

QUIET = dict(progress=False, report=False, log=lambda *_: None)


@pytest.fixture(scope="module")
def run_and_reference(tmp_path_factory):
    root = tmp_path_factory.mktemp("executors")
    run = make_run(root)
    reference = sweep([str(run)], root / "inline", settings(), **QUIET)
    assert not reference.errors
    return run, reference.table


@pytest.mark.slow
def test_ray_matches_local_and_resumes(run_and_reference, tmp_path):
    """A real local Ray cluster: the resumed Ray sweep runs only the missing (checkpoint, analysis)
    pairs, one Ray task per checkpoint, and its table equals the in-process one exactly."""
    ray = pytest.importorskip("ray")
    run, reference = run_and_reference
    partial = sweep([str(run)], tmp_path, settings(analyses=("loss",)), **QUIET)  # 3 of the 15 pairs
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        result = sweep([str(run)], tmp_path, settings(), ExecutorSettings("ray"), **QUIET)
        assert ray.is_initialized(), "the executor must not shut down a cluster it did not start"
    finally:
        ray.shutdown()
    assert partial.n_run == len(STEPS) and result.n_skipped == len(STEPS)
    assert result.n_run == len(STEPS) * (len(CHEAP) - 1) and not result.errors
    pd.testing.assert_frame_equal(result.table, reference)


@pytest.mark.slow
def test_local_worker_processes_match_in_process(run_and_reference, tmp_path):
    run, reference = run_and_reference
    result = sweep([str(run)], tmp_path, settings(), ExecutorSettings("local", workers=2), **QUIET)
    assert result.n_run == len(STEPS) * len(CHEAP) and not result.errors
    pd.testing.assert_frame_equal(result.table, reference)


def test_executor_settings_are_checked():
    with pytest.raises(ValueError, match="unknown executor"):
        ExecutorSettings("slurm")
    with pytest.raises(ValueError, match="only applies to --executor ray"):
        ExecutorSettings("local", ray_address="auto")
    with pytest.raises(ValueError, match="workers"):
        ExecutorSettings("local", workers=0)
