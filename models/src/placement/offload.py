"""Layer by layer past memory: a model whose weights stay off the compute device, each block brought
there for the whole batch and released after it (`interp.load(..., offload="disk" | "cpu")`).

What holds the weights between uses:

    "disk"  the checkpoint's own memory-mapped safetensors files (`tensor_files.mapped_safetensors`: the
            same zero-copy mapping safetensors' `safe_open` gives), in the file's dtype and layout (a
            family's conversion is a view of them: transposes, reshapes); nothing is copied or written
            anywhere. After a block has run, its pages are handed back to the kernel (`release_pages`),
            so the process holds one block's weights at a time: anonymous memory is the activations
            and the one block being run, converted to the compute dtype.
    "cpu"   host memory, converted once to the compute dtype (pinned when CUDA is there, so each block
            copies to the GPU asynchronously): for a model that fits in RAM but not on the GPU.

A unit is a block, the token embedding, the learned position embedding or the unembedding; the
small norms around them (ln_final, embed_ln) stay resident. Each unit is materialised by a forward
pre-hook of its module (`empty_strided` in the parameter's own layout, `copy_` from where the weights
live: the same conversion `build_model` makes, so the numbers are bit-identical to the model loaded
in memory) and dropped back to a meta placeholder by its forward hook. `model.holding(layer)` holds
a block for code that reads its weights outside its forward (the ablation sweep's resumption).

Why not accelerate (`dispatch_model` / `disk_offload`): its disk offload writes every weight again to
an offload folder (a second copy of the checkpoint on disk, in float32 for a float32 run), where
interp's own mapped files already are the offload; its hooks align each submodule's weights on every
call rather than a block's for the whole batch; and it would be a new dependency for what is forty
lines over the mapping interp already reads checkpoints through.

A backward pass through an offloaded model is refused in one line: autograd would keep every
layer's materialised weights alive until the backward ran, the whole model in memory.

With "disk" the file is read again for every block of every forward, so it must not change while the
model lives: before a unit brings its weights in (`Unit.enter`), each mapped file it reads is checked
(one os.stat: `tensor_files.MappedFile.check`), and a file written over or truncated in place since the
load is refused in one line (`CheckpointChanged`) before a page of it is touched, between blocks as well
as before a forward; a file replaced by a new one (os.replace) leaves the old pages mapped, so the model
runs on with the weights it loaded and warns once. A truncation while one block runs is not seen in time
and still kills the process (SIGBUS). See `interp.models.placement.tensor_files` for what is and is not caught.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from interp.errors import UserError
from .device_map import unit_of
from .tensor_files import Joined, check_files, fill, mapped_files, release_pages, tensors_of

OFFLOADS = ("cpu", "disk")
UNIT_MODULES = ("embed", "pos_embed", "unembed")  # top-level modules offloaded whole (besides the blocks)


class OffloadRefused(UserError):
    """What an offloaded model cannot do, in one line (a backward pass, a move, saving, weight processing)."""


@dataclass
class _Slot:
    """One parameter of a unit: where its weights live, and the parameter's shape, layout and dtype."""

    module: nn.Module
    name: str
    source: Tensor
    shape: tuple
    stride: tuple
    dtype: torch.dtype
    holds: int = 0

    def placeholder(self) -> nn.Parameter:
        return nn.Parameter(torch.empty_strided(self.shape, self.stride, dtype=self.dtype, device="meta"),
                            requires_grad=False)

    def take(self, device: torch.device) -> None:
        if self.holds == 0:
            if self._usable_as_is(device):  # the mapped file's (or host copy's) own memory: nothing copied
                t = self.source
            else:  # a cast, a move, or a fused weight's parts joined into the block's memory only
                t = torch.empty_strided(self.shape, self.stride, dtype=self.dtype, device=device)
                fill(t, self.source, non_blocking=device.type == "cuda")
            self.module._parameters[self.name] = nn.Parameter(t, requires_grad=False)
        self.holds += 1

    def _usable_as_is(self, device: torch.device) -> bool:
        s = self.source
        return (not isinstance(s, Joined) and s.device == device and s.dtype == self.dtype
                and tuple(s.shape) == self.shape and tuple(s.stride()) == self.stride)

    def give(self, release: bool) -> None:
        self.holds -= 1
        if self.holds == 0:
            self.module._parameters[self.name] = self.placeholder()
            if release:
                release_pages([self.source])


class Unit:
    """The weights of one module (a block, the embedding, the unembedding), held off the compute device."""

    def __init__(self, name: str, module: nn.Module, slots: list[_Slot], offload: "Offload") -> None:
        self.name, self.module, self.slots, self.offload = name, module, slots, offload
        self.holds = 0
        self.hooked = 0  # entries made by the forward pre-hook, each given back by the forward hook
        # the checkpoint files the weights are read from (disk; none for host copies), checked at each entry
        self.files = mapped_files(t for s in slots for t in tensors_of(s.source))

    @property
    def nbytes(self) -> int:
        return sum(s.dtype.itemsize * _numel(s.shape) for s in self.slots)

    def enter(self) -> None:
        check_files(self.files)  # first: a file changed under the model is refused before anything is taken
        for s in self.slots:
            s.take(self.offload.device)
        self.holds += 1

    def exit(self) -> None:
        self.holds -= 1
        for s in self.slots:
            s.give(self.offload.kind == "disk")


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


class Offload:
    """A model's offloaded units and where they run. Made by `build_model(..., offload=)`; the model keeps it
    as `model.offload` (None for a model held whole on its device)."""

    def __init__(self, kind: str, device: torch.device, dtype: torch.dtype) -> None:
        self.kind, self.device, self.dtype = kind, torch.device(device), dtype
        self.units: dict[str, Unit] = {}
        self._hooks: list = []

    # ---- building ---------------------------------------------------------------------------------
    @staticmethod
    def unit_of(key: str) -> str | None:
        """The unit a state-dict key belongs to ("blocks.3", "embed", ...), or None (stays resident)."""
        unit = unit_of(key)  # device_map's units; offload holds the blocks and the big matrices
        return unit if unit.startswith("blocks.") or (unit in UNIT_MODULES and key.startswith(unit + ".")) else None

    def source(self, tensor: Tensor, stride: tuple) -> Tensor:
        """What the offload keeps of a checkpoint tensor: the mapped view itself (disk), or a host copy in
        the compute dtype and the parameter's layout `stride` (cpu; pinned when the compute device is a GPU)."""
        if self.kind == "disk" or not tensor.is_floating_point():
            return tensor
        kept = torch.empty_strided(tuple(tensor.shape), stride, dtype=self.dtype, device="cpu",
                                   pin_memory=self.device.type == "cuda")
        return fill(kept, tensor)

    def attach(self, model: nn.Module, sources: dict[str, Tensor], specs: dict[str, Tensor],
               strides: dict[str, tuple]) -> None:
        """Give `model` its units: each key of `sources` (a state-dict name) lives there, with the shape of
        `specs[key]` (the meta model's parameter) and the strides `strides[key]` (those the model held whole
        has: `build.adopted_stride`), and gets a meta placeholder until it is used."""
        slots: dict[str, list[_Slot]] = {}
        for key, source in sources.items():
            owner, _, name = key.rpartition(".")
            module = model.get_submodule(owner)
            spec = specs[key]
            dtype = self.dtype if spec.is_floating_point() else spec.dtype
            slot = _Slot(module, name, source, tuple(spec.shape), strides[key], dtype)
            module._parameters[name] = slot.placeholder()
            slots.setdefault(self.unit_of(key), []).append(slot)
        tied = getattr(model.unembed, "_embed", None)
        if tied is not None and "embed" in slots:  # the tied unembedding reads the embedding's matrix
            slots["unembed"] = slots.get("unembed", []) + [s for s in slots["embed"] if s.name == "W_E"]
        for name, unit_slots in slots.items():
            unit = Unit(name, model.get_submodule(name), unit_slots, self)
            self.units[name] = unit
            self._hooks += [unit.module.register_forward_pre_hook(self._pre(unit)),
                            unit.module.register_forward_hook(self._post(unit), always_call=True)]
        model.offload = self

    def _pre(self, unit: Unit):
        def hook(module, args):
            unit.enter()  # raises before taking anything (a changed file): then there is nothing to give back
            unit.hooked += 1  # from here the forward hook (always called) releases it, whatever raises after
            _refuse_grad(args, unit.name)
        return hook

    def _post(self, unit: Unit):
        def hook(module, args, output):
            if unit.hooked:  # not when this call's pre-hook refused before entering
                unit.hooked -= 1
                unit.exit()
            _refuse_grad((output,), unit.name)
        return hook

    # ---- using ------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def holding(self, *names: str):
        """Hold the named units (`"blocks.3"`, `"unembed"`) materialised on the device for the block."""
        entered = []
        try:
            for u in (self.units[n] for n in names if n in self.units):
                u.enter()  # may refuse (a changed file): those entered so far are given back below
                entered.append(u)
            yield
        finally:
            for u in reversed(entered):
                u.exit()

    @property
    def files(self) -> tuple:
        """The mapped checkpoint files the units read (`tensor_files.MappedFile`), once each."""
        return tuple(dict.fromkeys(f for u in self.units.values() for f in u.files))

    @property
    def largest_unit_bytes(self) -> int:
        return max((u.nbytes for u in self.units.values()), default=0)

    def describe(self) -> str:
        blocks = [u for n, u in self.units.items() if n.startswith("blocks.")]
        where = "the checkpoint's mapped files" if self.kind == "disk" else "host memory"
        return (f"offload={self.kind!r}: {len(self.units)} units ({len(blocks)} blocks) held in {where}, each brought to "
                f"{self.device} in {str(self.dtype).removeprefix('torch.')} when it runs (largest "
                f"{self.largest_unit_bytes / 2**20:,.0f} MiB)")


def _refuse_grad(values, where: str) -> None:
    if not torch.is_grad_enabled():
        return
    for v in torch.utils._pytree.tree_leaves(values):
        if isinstance(v, Tensor) and v.requires_grad:
            raise OffloadRefused(
                f"a backward pass through an offloaded model ({where} saw an input that requires grad): autograd would "
                "keep every layer's weights in memory until the backward ran; load the model without offload for "
                "gradients (attribution, EAP, importance), or use exact patching")


def named_weights(model: nn.Module):
    """(name, tensor) of the model's state dict in sorted name order, each offloaded unit materialised while
    its tensors are read and released after (one unit in memory at a time); a model without offload gives
    its state dict as it is. For code that reads every weight (fingerprints, hashes)."""
    state = model.state_dict()
    offload = getattr(model, "offload", None)
    if offload is None:
        for name in sorted(state):
            yield name, state[name]
        return
    held = None
    try:
        for name in sorted(state):
            unit = offload.unit_of(name)
            unit = unit if unit in offload.units else None
            if unit != held:
                if held is not None:
                    offload.units[held].exit()
                    held = None
                if unit is not None:
                    offload.units[unit].enter()  # may refuse (a changed file): then nothing is held
                    held = unit
            yield name, (state[name] if unit is None else _current(model, name))
    finally:
        if held is not None:
            offload.units[held].exit()


def _current(model: nn.Module, key: str) -> Tensor:
    owner, _, name = key.rpartition(".")
    return model.get_submodule(owner)._parameters[name].detach()
