"""Where a load puts the weights: one choice, made and refused here (`Placement`).

`device`, `offload` and `device_map` all say where the weights go, so they are one value:

    device      where the model runs: a torch device or its name ("cuda:1"); None, the library's default (the
                CPU for `interp.load`), or for a command `resolved()`: cuda when torch sees a GPU, else the CPU
    offload     None (every weight on the device), "disk" or "cpu": layer by layer past memory
                (`interp.models.placement.offload`)
    device_map  None (the whole model on `device`), "auto", {layer or unit: device}, or the command line's
                "LAYERS:DEVICE,..." (parsed here): the blocks split over devices (`interp.models.placement.device_map`)

What can be refused without a model's config is refused when the value is made, in one line, whoever makes it
(`interp.load`, `load_checkpoint`'s caller, a command's `--device` / `--offload` / `--device-map`, a study's or
a sweep's settings): an offload misspelt, a malformed map, a device this machine lacks, and a map beside an
offload. What needs the config (the map against the model's layers and units, `device=` against the map's
embedding, the memory each device needs, a model transformers runs, a split where one device is needed) is a
method here, called with it. Each refusal is written once, naming both spellings (`device_map` and
`--device-map`) where the library's and the command line's differ: the same line from every surface.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from . import memory
from .device import resolve_device
from .device_map import DeviceMapRefused, check_fits_split, is_split, may_split, parse_device_map, resolve_device_map
from .offload import OFFLOADS, OffloadRefused

__all__ = ["Placement"]


@dataclass(frozen=True)
class Placement:
    """Where a load puts the weights (see the module doc), checked when made: `offload` is None, "disk" or
    "cpu"; `device_map` is kept parsed (None, "auto" or {layer or unit: device}); `device`, when named, is one
    this machine has; a map and an offload together are refused."""

    device: torch.device | str | None = None
    offload: str | None = None
    device_map: str | dict | None = None

    def __post_init__(self) -> None:
        if self.offload is not None and self.offload not in OFFLOADS:
            raise OffloadRefused(f"offload={self.offload!r}: give 'disk' (weights stay in the checkpoint's mapped "
                                 "files), 'cpu' (in host memory, each block moved to the device when it runs) or None "
                                 "(the whole model on the device)")
        if self.device_map is not None:
            object.__setattr__(self, "device_map", parse_device_map(self.device_map))
            if self.offload is not None:
                raise DeviceMapRefused(f"device_map (--device-map) and offload={self.offload!r} (--offload "
                                       f"{self.offload}) both say where the weights go: give one of the two")
        if self.device is not None:
            resolve_device(self.device)  # a device this machine lacks: one line, before a name is resolved

    def keywords(self) -> dict:
        """`interp.load`'s keywords for this placement: device=, offload=, device_map=."""
        return {"device": self.device, "offload": self.offload, "device_map": self.device_map}

    def resolved(self) -> Placement:
        """The placement a command loads with: `device` resolved on this machine (None: cuda when torch sees a
        GPU, else the CPU), or left None when a device map says where (it puts the embedding where it says)."""
        if self.device is None and self.device_map is not None:
            return self
        return dataclasses.replace(self, device=resolve_device(self.device))

    # ---- against a model's config ------------------------------------------------------------------
    def units(self, cfg) -> dict[str, torch.device] | None:
        """{unit: device} of the map resolved against a model of config `cfg` and this machine (one line on a
        layer out of range, an unknown unit, a device the machine lacks, `device` elsewhere than the map's
        embedding: `device_map.resolve_device_map`); None without a map."""
        return None if self.device_map is None else resolve_device_map(self.device_map, cfg, device=self.device)

    def may_split(self) -> bool:
        """Whether the map would use several devices on this machine, whatever the model."""
        return may_split(self.device_map)

    def refuse_split(self, cfg, needs: str, *, name: str = "the model") -> None:
        """Refuse, in one line, a map that splits a model of config `cfg` over several devices for what needs it
        on one (`needs`: what, and why, e.g. "generation reads interp's KV cache, which holds every layer on
        one device"); `name`: the model's, in the line."""
        placed = self.units(cfg)
        if is_split(placed):
            raise DeviceMapRefused(f"{needs}, and device_map (--device-map) splits {name} over "
                                   f"{len(set(placed.values()))} devices: run it on one device (device=, --device)")

    def refuse_wrapped(self, source: str, model_type) -> None:
        """Refuse, in one line, an offload or a map for `source`, a model transformers runs (wrapped, its
        `model_type`): both work on interp's own transformer, unit by unit."""
        where = f"{source}: transformers runs this architecture ({model_type}, wrapped)"
        if self.device_map is not None:
            raise DeviceMapRefused(f"{where}, which interp does not split over devices (device_map, --device-map): "
                                   "load it on one device, or with transformers' from_pretrained(device_map=...) and "
                                   "interp.from_hf")
        if self.offload is not None:
            raise OffloadRefused(f"{where}, which interp does not offload (offload={self.offload!r}, --offload "
                                 f"{self.offload}): load it without offload, or with transformers' device_map and "
                                 "offload_folder and interp.from_hf")

    def check_fits(self, cfg, batch: int, length: int, *, what: str = "--seq-len") -> memory.Fit:
        """`memory.check_fits` where this placement puts the weights: whole (or offloaded) on `device`, or each
        device's share of the map. What the study commands and the sweep check before loading."""
        if self.device_map is None:
            return memory.check_fits(cfg, batch, length, resolve_device(self.device), what=what, offload=self.offload)
        return check_fits_split(cfg, batch, length, self.device_map, device=self.device, what=what)
