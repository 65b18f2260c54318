"""Tests marked `heavy` run one at a time across the suite's workers (tests/support/heavy.py, held by the
conftest's autouse fixture), under the README's `pytest -n 2`: two of them drawn by the two workers at once wait for
each other; unmarked ones do not."""

import json
import os
import subprocess
import sys
from pathlib import Path

SUPPORT = Path(__file__).resolve().parents[1] / "support"

_CONFTEST = '''
import os, time
import heavy
import pytest

@pytest.fixture(autouse=True, scope="session")
def both_workers_up(tmp_path_factory):  # a barrier: each worker starts its tests once both are running
    shared = tmp_path_factory.getbasetemp().parent
    (shared / ("up-" + os.environ["PYTEST_XDIST_WORKER"])).touch()
    deadline = time.time() + 240
    while len(list(shared.glob("up-*"))) < 2:
        assert time.time() < deadline, "the second worker never started"
        time.sleep(0.05)

@pytest.fixture(autouse=True)
def heavy_alone(request, tmp_path_factory):  # as tests/conftest.py's
    with heavy.held(request.node, tmp_path_factory):
        yield
'''

_SUITE = '''
import json, os, time
import pytest

def _record(name):
    start = time.time()
    time.sleep(1.5)
    with open(os.environ["SPANS"], "a") as f:
        f.write(json.dumps([name, start, time.time()]) + "\\n")

@pytest.mark.heavy
def test_heavy_a():
    _record("heavy")

@pytest.mark.heavy
def test_heavy_b():
    _record("heavy")

def test_light_a():
    _record("light")

def test_light_b():
    _record("light")
'''


def _spans(tmp_path, suite_args):
    (tmp_path / "test_spans.py").write_text(_SUITE)
    (tmp_path / "conftest.py").write_text(_CONFTEST)
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    heavy: one at a time\n")
    spans = tmp_path / "spans.jsonl"
    env = {**os.environ, "SPANS": str(spans), "PYTHONPATH": str(SUPPORT)}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "2", *suite_args,
                           "-p", "no:cacheprovider", str(tmp_path)], capture_output=True, text=True, env=env,
                          cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out: dict[str, list] = {}
    for line in spans.read_text().splitlines():
        name, start, end = json.loads(line)
        out.setdefault(name, []).append((start, end))
    return out


def _overlap(a, b) -> bool:
    return a[0] < b[1] and b[0] < a[1]


def test_two_heavy_tests_never_overlap_on_two_workers(tmp_path):
    # --dist each hands every test to both workers, in the same order, and both start together (the barrier): each
    # heavy test runs on the two workers at once unless the lock holds one back (without it, they overlap)
    spans = _spans(tmp_path, ["--dist", "each"])
    heavy, light = spans["heavy"], spans["light"]
    assert len(heavy) == 4 and len(light) == 4
    assert not any(_overlap(a, b) for i, a in enumerate(heavy) for b in heavy[i + 1:]), heavy
