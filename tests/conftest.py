"""Suite-wide settings.

Under pytest-xdist (`pytest -n 2`, the README's command) every worker is its own process; two
workers with two torch threads each oversubscribe a 2-core machine, which made tiny-model forwards
up to 30x slower here. One thread per worker keeps the suite fast; a plain `pytest` keeps torch's
default.
"""

import os

# Idle OpenMP threads sleep instead of spinning: spinning workers starve each other when the
# suite's processes share two cores (5-20x slowdowns seen here). Must be set before torch loads.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import matplotlib  # noqa: E402
import torch  # noqa: E402

matplotlib.use("Agg")

if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)
