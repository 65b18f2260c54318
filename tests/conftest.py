"""Suite-wide settings and fixtures (pytest gives every test module these fixtures; none is imported).

Under pytest-xdist (`pytest -n 2`, the README's command) every worker is its own process; two
workers with two torch threads each oversubscribe a 2-core machine, which made tiny-model forwards
up to 30x slower here. One thread per worker keeps the suite fast; a plain `pytest` runs each test
module on one thread too (`one_thread`) and restores torch's setting after it.

Shared helpers that are not fixtures (models, data, cases) live in support modules a test module
imports: core_models.py, analyses_fixtures.py, sweep_fixtures.py, tl_pairs.py, hf_cases.py, smol.py.
"""

import os

# Idle OpenMP threads sleep instead of spinning: spinning workers starve each other when the
# suite's processes share two cores (5-20x slowdowns seen here). Must be set before torch loads.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# Every `interp ...` command a test runs (in process through interp.cli.main, or as a subprocess) runs as
# if its tensors were on a GPU: a tensor taken to the host other than by interp.models.placement.device.to_numpy
# raises (`.numpy()` on a CUDA tensor fails). See tests/test_device.py.
os.environ["INTERP_REFUSE_HOST_COPIES"] = "1"

import matplotlib  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

matplotlib.use("Agg")

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
