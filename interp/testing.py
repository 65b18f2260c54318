"""Test tooling that patches torch: run a pipeline on the CPU and find what a GPU would refuse, without one.

* `refuse_host_copies()`: a context in which any host copy of a tensor other than through
  `interp.models.placement.device.to_numpy` raises `HostCopyError`: ``t.numpy()``, ``np.asarray(t)``, and what calls
  them for you (``pd.DataFrame({"x": t})``, ``plt.imshow(t)``). On a CUDA tensor those fail (``.numpy()``)
  or are the scattered implicit copies that one door replaces. ``.tolist()``, ``.item()``, ``float(t)`` are
  allowed: they work on every device. The CLI runs every command under it when INTERP_REFUSE_HOST_COPIES=1
  (the test suite sets it).
* `simulated_gpu()`: the CPU plays a GPU: tensors put on "the device" are told apart from host tensors,
  and an operation mixing the two raises `DeviceMixError` (``tests/models/placement/test_device.py`` runs every command so).

Not the model: it lived in models/src/placement/device.py until the models' room was kept for the model.
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

from interp.models.placement.device import leaving

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
                f"a tensor left its device by {name}() outside interp.models.placement.device.to_numpy: on a CUDA tensor "
                "this fails; take results off the device with to_numpy / to_host")
        return original(self, *args, **kwargs)

    return guarded


_guard_depth = 0


class DeviceMixError(RuntimeError):
    """Under `simulated_gpu`: an operation that mixes device and host tensors, which fails on a GPU."""


_TAG = "_interp_on_device"  # the simulated device a tensor is on (0, 1, ...); absent: the host
# Operations that may take tensors of both sides on a GPU too: moves and copies, indexing with a host index.
_CROSSING = {torch.Tensor.to, torch.Tensor.cpu, torch.Tensor.cuda, torch.Tensor.copy_, torch.Tensor.__getitem__,
             torch.Tensor.__setitem__, torch.Tensor.tolist, torch.Tensor.item, torch.Tensor.__repr__,
             torch.Tensor.__format__, torch.Tensor.__bool__, torch.Tensor.__float__, torch.Tensor.__int__,
             torch.Tensor.__index__}
_AUTOGRAD = {torch.autograd.grad, torch.autograd.backward, torch.Tensor.backward}  # a graph may span devices
_DEVICE_GETTER = torch.Tensor.device  # the `t.device` property (its __get__ comes through the mode)


def _index(device) -> int | None:
    """The simulated device a `device=` argument names: cuda:N -> N (cuda -> 0), anything else (cpu, meta) None."""
    dev = torch.device(device)
    return (dev.index or 0) if dev.type == "cuda" else None


class _SimulatedGPU(TorchFunctionMode):
    """Tensors carry a tag: the (simulated) device they are on, or none (the host).

    One device (`devices=1`, the CPU playing one GPU): the model's parameters, whatever `.to(d)`, `.cuda()` or a
    factory's ``device=`` puts there, and every result of an operation on such a tensor are on the device;
    ``.cpu()`` comes back. Several (`devices=N`): "cuda:0" ... "cuda:N-1" are devices (accepted by
    `resolve_device`, reported by ``t.device``), "cpu" is the host; a tensor moved or created on "cuda:i" really
    lives on the CPU, tagged i, and a parameter's device is the one its memory was placed on (parameters are
    made afresh from tensors, so the tag is kept by address too). An operation that mixes two sides (a host
    tensor of one element or more with a device tensor: what CUDA refuses; or two devices), or ``.numpy()`` of
    a device tensor, raises."""

    def __init__(self, devices: int = 1) -> None:
        super().__init__()
        self.devices = devices
        self.where: dict[int, int | None] = {}  # several devices: data_ptr -> device, for parameters

    def place(self, x) -> int | None:
        tag = getattr(x, _TAG, None)
        if tag is not None:
            return tag
        if isinstance(x, torch.nn.Parameter):
            return 0 if self.devices == 1 else self.where.get(x.data_ptr())
        return None

    def _target(self, func, args, kwargs) -> tuple[bool, int | None, tuple, dict]:
        """For a move or a factory: (whether it names where, the device it names, args and kwargs with the
        simulated devices spelled "cpu", where everything really lives)."""
        def real(d):
            return "cpu" if isinstance(d, (str, torch.device)) and torch.device(d).type == "cuda" else d

        if func is torch.Tensor.cpu:
            return True, None, args, kwargs
        if func is torch.Tensor.cuda:  # run as .to("cpu"): the tensors live there
            d = args[1] if len(args) > 1 else kwargs.get("device")
            return True, (0 if d is None else d if isinstance(d, int) else _index(d)), (args[0], "cpu"), {
                k: v for k, v in kwargs.items() if k in ("non_blocking", "memory_format")}
        named, target = False, None
        if kwargs.get("device") is not None:
            named, target = True, _index(kwargs["device"])
            kwargs = {**kwargs, "device": real(kwargs["device"])}
        if func is torch.Tensor.to:
            for a in args[1:]:
                if isinstance(a, (str, torch.device)):
                    named, target = True, _index(a)
                elif isinstance(a, torch.Tensor):
                    named, target = True, self.place(a)
            args = tuple(real(a) for a in args)
        if self.devices == 1 and named and func in (torch.Tensor.to, torch.Tensor.cuda):
            target = 0 if not (func is torch.Tensor.to and any(isinstance(a, torch.Tensor) for a in args[1:])) \
                else target  # one device: any device named is the device; .to(t) follows t
        return named, target, args, kwargs

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__self__", None) is _DEVICE_GETTER:  # t.device
            if self.devices > 1:
                where = self.place(args[0])
                return torch.device("cuda", where) if where is not None else func(*args, **kwargs)
            return func(*args, **kwargs)
        if func is torch._C._nn._parse_to:  # Module.to's parsing of its arguments: the devices as they were named
            return func(*args, **kwargs)
        tensors = [x for x in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor)]
        places = [self.place(t) for t in tensors]
        devices = {p for p in places if p is not None}
        on = bool(devices)
        name = getattr(func, "__name__", str(func))
        if func in _HOST_COPIES and on and not leaving():
            raise DeviceMixError(f"{name}() of a tensor on the device: on a GPU this fails; use "
                                 "interp.models.placement.device.to_numpy")
        indexing = func in (torch.Tensor.__getitem__, torch.Tensor.__setitem__)  # a host index is fine, another GPU's not
        if on and (func not in _CROSSING or indexing) and func not in _AUTOGRAD:
            if len(devices) > 1:
                raise DeviceMixError(f"{name}() mixes tensors on {', '.join(f'cuda:{d}' for d in sorted(devices))}: on "
                                     "GPUs this fails (\"Expected all tensors to be on the same device\"); move them "
                                     "to one device first")
            host = [tuple(t.shape) for t, p in zip(tensors, places) if p is None and t.dim() > 0]
            if host and not indexing:
                raise DeviceMixError(f"{name}() mixes tensors on the device with host tensor(s) of shape "
                                     f"{', '.join(map(str, host[:3]))}: on a GPU this fails (\"Expected all tensors "
                                     "to be on the same device\"); create them with device=..., or move them with .to()")
        if func is torch.autograd.grad:  # autograd takes inputs on every device; each gradient is where its input is
            inputs = args[1] if len(args) > 1 else kwargs["inputs"]
            inputs = [inputs] if isinstance(inputs, torch.Tensor) else list(inputs)
            out = func(*args, **kwargs)
            for g, x in zip(out, inputs):
                if isinstance(g, torch.Tensor):
                    self._tag(g, self.place(x))
            return out
        named, target, args, kwargs = self._target(func, args, kwargs)
        if self.devices == 1 and named and func not in (torch.Tensor.cpu, torch.Tensor.to, torch.Tensor.cuda):
            target = 0  # one device: a factory told where (torch.zeros(..., device=d)) is on it
        out = (torch.Tensor.to if func is torch.Tensor.cuda else func)(*args, **kwargs)
        if func in (torch.Tensor.cpu, torch.Tensor.to, torch.Tensor.cuda) and named:
            same = out is args[0]
            if self.place(out) != target:
                out = out.view_as(out)  # a new object where it was asked; the original stays where it was
            if target is not None:
                # a new tensor's memory (or a host tensor's, placed) is the target's from now on; a device
                # tensor's own memory stays its device's (a parameter's view moved elsewhere does not move it)
                self._tag(out, target, register=not same or self.place(args[0]) is None)
            return out
        if func in (torch.Tensor.copy_, torch.Tensor.__setitem__):
            return out  # the destination stays where it was
        if func is torch.Tensor.to:  # a dtype change only: where it was
            target = self.place(args[0])
        elif func is torch.Tensor.__getitem__:
            target = self.place(args[0])
        elif not named:
            target = next(iter(devices)) if devices else None
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and not isinstance(t, torch.nn.Parameter):
                if target is not None or self.devices > 1:
                    self._tag(t, target)
        return out

    def _tag(self, t: torch.Tensor, where: int | None, register: bool = True) -> None:
        if where is None:
            if getattr(t, _TAG, None) is not None:
                try:
                    delattr(t, _TAG)
                except (AttributeError, RuntimeError):  # pragma: no cover
                    pass
        else:
            try:
                setattr(t, _TAG, where)
            except (AttributeError, RuntimeError):  # pragma: no cover - a tensor type without attributes
                pass
        if register and self.devices > 1 and t.device.type == "cpu":
            try:
                ptr = t.data_ptr()
            except RuntimeError:  # pragma: no cover - no storage
                return
            if ptr:
                self.where[ptr] = where


def _simulated_cuda_available(n: int):
    def devices() -> list[str]:
        return ["cpu"] + [f"cuda:{i}" for i in range(n)]
    return devices


@contextlib.contextmanager
def simulated_gpu(devices: int = 1):
    """Inside the block, the CPU plays a GPU: tensors put on "the device" (a model's parameters, `.to(device)`,
    ``device=`` in a factory) are told apart from host tensors, and what a real GPU refuses raises
    `DeviceMixError`: an operation mixing the two (``x_on_device + torch.arange(n)``, ``torch.cat`` of both),
    or ``.numpy()`` of a device tensor. Host scalars (0-dim) mix freely, as on CUDA. For tests: run a command
    on the CPU and find the device bugs a GPU would (``tests/models/placement/test_device.py``).

    devices=N (N >= 2): the CPU plays N GPUs, "cuda:0" ... "cuda:N-1": `resolve_device` and `available_devices`
    accept and list them (patched for the block, with the memory query, the device's name, and the statistics
    kernel's Triton check: the tensors are CPU tensors), ``t.device`` says which one a tensor is on, "cpu" is
    the host, and an operation mixing two of them, or one with a host tensor, raises `DeviceMixError`
    (``tests/models/placement/test_device_map.py``: a model split over two devices by `device_map`)."""
    if devices < 1:
        raise ValueError(f"devices must be >= 1, got {devices}")
    if devices == 1:
        with _SimulatedGPU():
            yield
        return
    import interp.kernels.stats as stats
    from interp.models.placement import device as device_module, memory

    host_bytes = memory.available_bytes

    patches = [(device_module, "available_devices", _simulated_cuda_available(devices)),
               (device_module, "device_name", lambda d: f"simulated GPU ({torch.device(d)})"),
               (memory, "available_bytes", lambda d="cpu": host_bytes("cpu")),
               (stats, "_triton_available", lambda: False)]
    saved = [(m, a, getattr(m, a)) for m, a, _ in patches]
    for m, a, v in patches:
        setattr(m, a, v)
    try:
        with _SimulatedGPU(devices):
            yield
    finally:
        for m, a, v in saved:
            setattr(m, a, v)


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
