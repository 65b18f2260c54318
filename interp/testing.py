"""Test tooling that patches torch: run a pipeline on the CPU and find what a GPU would refuse, without one.

* `refuse_host_copies()`: a context in which any host copy of a tensor other than through
  `interp.models.device.to_numpy` raises `HostCopyError`: ``t.numpy()``, ``np.asarray(t)``, and what calls
  them for you (``pd.DataFrame({"x": t})``, ``plt.imshow(t)``). On a CUDA tensor those fail (``.numpy()``)
  or are the scattered implicit copies that one door replaces. ``.tolist()``, ``.item()``, ``float(t)`` are
  allowed: they work on every device. The CLI runs every command under it when INTERP_REFUSE_HOST_COPIES=1
  (the test suite sets it).
* `simulated_gpu()`: the CPU plays a GPU: tensors put on "the device" are told apart from host tensors,
  and an operation mixing the two raises `DeviceMixError` (``tests/test_device.py`` runs every command so).

Not the model: it lived in models/device.py until the models' room was kept for the model.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
import sys
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode

from interp.models.device import leaving

__all__ = ["DeviceMixError", "HostCopyError", "refuse_host_copies", "simulated_gpu"]


class HostCopyError(RuntimeError):
    """A tensor copied to the host outside `to_numpy`: a call that fails or stalls on a GPU."""


_NUMPY, _ARRAY = torch.Tensor.numpy, torch.Tensor.__array__
_HOST_COPIES = {_NUMPY, _ARRAY}
# Source roots of interp's own code: the guard judges a host copy by who asked for it.
@functools.cache
def _ours() -> tuple[str, ...]:
    return tuple(str(Path(importlib.util.find_spec(m).origin).resolve().parent) + os.sep
                 for m in ("interp", "interp.models", "interp.kernels", "interp.analyses"))


_RELAYS = tuple(f"{os.sep}{name}{os.sep}" for name in ("numpy", "pandas", "matplotlib", "torch"))


def _asked_by_us(depth: int = 2) -> bool:
    """Whether the code that asked for the host copy is interp's own: the first caller outside numpy, pandas,
    matplotlib and torch (which relay `np.asarray(t)` from whoever handed them the tensor). A third-party
    library's own `.numpy()` on a host tensor we gave it (TransformerLens's detection patterns) is its affair."""
    frame = sys._getframe(depth)
    while frame is not None:
        name = frame.f_code.co_filename
        if not any(r in name for r in _RELAYS) and name != __file__:  # this module's own frames relay too
            return str(Path(name).resolve()).startswith(_ours())
        frame = frame.f_back
    return False


def _refusing(original, name: str):
    def guarded(self, *args, **kwargs):
        if not leaving() and _asked_by_us():
            raise HostCopyError(
                f"a tensor left its device by {name}() outside interp.models.device.to_numpy: on a CUDA tensor "
                "this fails; take results off the device with to_numpy / to_host")
        return original(self, *args, **kwargs)

    return guarded


_guard_depth = 0


class DeviceMixError(RuntimeError):
    """Under `simulated_gpu`: an operation that mixes device and host tensors, which fails on a GPU."""


_TAG = "_interp_on_device"
# Operations that may take tensors of both sides on a GPU too: moves and copies, indexing with a host index.
_CROSSING = {torch.Tensor.to, torch.Tensor.cpu, torch.Tensor.cuda, torch.Tensor.copy_, torch.Tensor.__getitem__,
             torch.Tensor.__setitem__, torch.Tensor.tolist, torch.Tensor.item, torch.Tensor.__repr__,
             torch.Tensor.__format__, torch.Tensor.__bool__, torch.Tensor.__float__, torch.Tensor.__int__,
             torch.Tensor.__index__}


def _on_device(x) -> bool:
    return isinstance(x, torch.nn.Parameter) or getattr(x, _TAG, False)


def _moves_to_device(args, kwargs) -> bool | None:
    """For `Tensor.to(...)`: True when it names a device (or a tensor on the device), False for a tensor on the
    host, None when it only changes the dtype."""
    if kwargs.get("device") is not None:
        return True
    for a in args[1:]:
        if isinstance(a, (str, torch.device)):
            return True
        if isinstance(a, torch.Tensor):
            return _on_device(a)
    return None


class _SimulatedGPU(TorchFunctionMode):
    """Tensors carry a flag: on the (simulated) device, or on the host. The model's parameters, whatever `.to(d)`,
    `.cuda()` or a factory's ``device=`` puts there, and every result of an operation on such a tensor are on
    the device; ``.cpu()`` comes back. An operation that mixes the two sides (a host tensor of one element or
    more with a device tensor: what CUDA refuses), or ``.numpy()`` of a device tensor, raises."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tensors = [x for x in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor)]
        on = any(_on_device(t) for t in tensors)
        name = getattr(func, "__name__", str(func))
        if func in _HOST_COPIES and on and not leaving():
            raise DeviceMixError(f"{name}() of a tensor on the device: on a GPU this fails; use "
                                 "interp.models.device.to_numpy")
        if on and func not in _CROSSING:
            host = [tuple(t.shape) for t in tensors if not _on_device(t) and t.dim() > 0]
            if host:
                raise DeviceMixError(f"{name}() mixes tensors on the device with host tensor(s) of shape "
                                     f"{', '.join(map(str, host[:3]))}: on a GPU this fails (\"Expected all tensors "
                                     "to be on the same device\"); create them with device=..., or move them with .to()")
        out = func(*args, **kwargs)
        if func is torch.Tensor.cpu or (func is torch.Tensor.to and _moves_to_device(args, kwargs) is False):
            return out.view_as(out) if out is args[0] else out  # a new object on the host; the original stays
        if func in (torch.Tensor.to, torch.Tensor.cuda) and (func is torch.Tensor.cuda
                                                              or _moves_to_device(args, kwargs)):
            if out is args[0] and not _on_device(out):
                out = out.view_as(out)  # .to(device) of a host tensor: a new object, the host one stays there
            setattr(out, _TAG, True)
            return out
        if func in (torch.Tensor.copy_, torch.Tensor.__setitem__):
            return out  # the destination stays where it was
        if func is torch.Tensor.__getitem__:
            on = _on_device(args[0])
        elif kwargs.get("device") is not None:
            on = True  # a factory told where (torch.zeros(..., device=d))
        if on:
            for t in torch.utils._pytree.tree_leaves(out):
                if isinstance(t, torch.Tensor) and not isinstance(t, torch.nn.Parameter):
                    try:
                        setattr(t, _TAG, True)
                    except (AttributeError, RuntimeError):  # pragma: no cover - a tensor type without attributes
                        pass
        return out


@contextlib.contextmanager
def simulated_gpu():
    """Inside the block, the CPU plays a GPU: tensors put on "the device" (a model's parameters, `.to(device)`,
    ``device=`` in a factory) are told apart from host tensors, and what a real GPU refuses raises
    `DeviceMixError`: an operation mixing the two (``x_on_device + torch.arange(n)``, ``torch.cat`` of both),
    or ``.numpy()`` of a device tensor. Host scalars (0-dim) mix freely, as on CUDA. For tests: run a command
    on the CPU and find the device bugs a GPU would (``tests/test_device.py``)."""
    with _SimulatedGPU():
        yield


@contextlib.contextmanager
def refuse_host_copies():
    """Inside the block, ``t.numpy()`` and ``np.asarray(t)`` (and pandas / matplotlib on tensors) raise
    `HostCopyError` when interp's own code asks for them other than through `to_numpy`. For tests and debugging:
    run a pipeline on the CPU as if its tensors were on a GPU. It costs nothing per operation (the two methods are
    swapped for checking ones while the block runs, for every thread), so the test suite runs every command in it."""
    global _guard_depth
    if _guard_depth == 0:
        torch.Tensor.numpy = _refusing(_NUMPY, "numpy")
        torch.Tensor.__array__ = _refusing(_ARRAY, "__array__")
    _guard_depth += 1
    try:
        yield
    finally:
        _guard_depth -= 1
        if _guard_depth == 0:
            del torch.Tensor.numpy  # back to TensorBase.numpy
            torch.Tensor.__array__ = _ARRAY
