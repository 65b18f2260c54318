"""Where tensors live, and the one door by which results leave it.

* `resolve_device(name)`: the device a user named (None: ``cuda`` when torch sees a GPU, else ``cpu``),
  checked against this machine before any work: ``cuda`` without CUDA, ``cuda:7`` on a one-GPU machine,
  ``mps`` where torch has none, or a name torch does not know, is one line naming what is available.
* `to_numpy(t)` / `to_host(t)`: how every output path (result frames, JSON, figures, the viewer's
  codes) takes a tensor off its device: detached, copied to the host, as float64/int64 numpy or a CPU
  tensor. One place, so that a result computed on a GPU is the same object a CPU run gives. The test
  tooling that finds, on the CPU, the host copies and device mixes a GPU would refuse
  (`refuse_host_copies`, `simulated_gpu`) is `interp.testing`: it patches torch, so it is not the model's.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import importlib.util
import os
import platform
import threading

import numpy as np
import torch
from torch import Tensor

from interp.kernels import resolve_backend

from interp.errors import BadValue

__all__ = ["available_devices", "compute_record", "device_name", "installed_version", "leaving", "resolve_device", "to_host",
           "to_numpy"]


def available_devices() -> list[str]:
    """The devices torch can use on this machine, e.g. ``['cpu', 'cuda:0', 'cuda:1']``."""
    found = ["cpu"]
    if torch.cuda.is_available():
        found += [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    mps = getattr(torch.backends, "mps", None)
    if mps is not None and mps.is_available():
        found.append("mps")
    return found


def resolve_device(name: str | torch.device | None = None) -> torch.device:
    """`name` as a device this machine has (None: ``cuda`` when available, else ``cpu``); else BadValue,
    one line naming the devices there are."""
    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(name)
    except (RuntimeError, TypeError):
        raise BadValue(f"device {name!r} is not a device name (cpu, cuda, cuda:N, mps); this machine has: "
                       f"{', '.join(available_devices())}") from None
    have = available_devices()
    ok = (dev.type == "cpu" or (dev.type == "cuda" and f"cuda:{dev.index or 0}" in have)
          or (dev.type == "mps" and "mps" in have))
    if not ok:
        raise BadValue(f"device {name!r} is not available: this machine has {', '.join(have)}"
                       + ("" if len(have) > 1 else " (no CUDA or MPS device torch can use)")
                       + "; pick one of those")
    return dev


def device_name(device: torch.device | str) -> str:
    """What the device is, in words: the GPU's name, or the CPU's architecture."""
    dev = torch.device(device)
    if dev.type == "cuda":
        return torch.cuda.get_device_name(dev)
    if dev.type == "mps":
        return "Apple GPU (MPS)"
    return f"CPU ({platform.machine() or 'unknown'}, {os.cpu_count()} cores)"


def compute_record(device: str | torch.device | None = None) -> dict:
    """Where a run computes and with which kernels, for settings.json and reports: the device, its name,
    the streaming statistics kernel that ``backend="auto"`` picks there, torch's threads, the CUDA and
    Triton versions (None where absent)."""
    dev = resolve_device(device)
    return {"device": str(dev), "device_name": device_name(dev), "stats_backend": resolve_backend("auto", dev),
            "threads": torch.get_num_threads(), "cuda": torch.version.cuda, "triton": installed_version("triton")}


def installed_version(dist: str) -> str | None:
    """The installed version of a distribution, without importing it (transformers takes seconds); None if absent."""
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


# ---- the one way out -------------------------------------------------------------------------------
_leaving = threading.local()


@contextlib.contextmanager
def _door():
    depth = getattr(_leaving, "depth", 0)
    _leaving.depth = depth + 1
    try:
        yield
    finally:
        _leaving.depth = depth


def to_host(t: Tensor) -> Tensor:
    """`t` detached and on the CPU (a copy only when it was elsewhere)."""
    return t.detach().cpu()


def to_numpy(t: Tensor | np.ndarray, dtype=None) -> np.ndarray:
    """`t` as a numpy array on the host (bfloat16, which numpy lacks, goes through float32); `dtype` to
    cast. The one place results leave their device (see the module doc). An array passes through."""
    if isinstance(t, np.ndarray):
        return t if dtype is None else t.astype(dtype, copy=False)
    t = to_host(t)
    if t.dtype == torch.bfloat16:
        t = t.float()
    with _door():
        out = t.numpy()
    return out if dtype is None else out.astype(dtype, copy=False)


def leaving() -> bool:
    """Whether the current thread is inside `to_numpy`'s own host copy (the one door): what the test
    tooling's host-copy guard (`interp.testing.refuse_host_copies`) lets through."""
    return bool(getattr(_leaving, "depth", 0))
