"""Several GPUs: a model's blocks split over devices (`interp.load(..., device_map=...)`, `--device-map`).

A unit is the token embedding ("embed"), its norm ("embed_ln", Bloom), the learned or sinusoidal position
embedding ("pos_embed"), a block ("blocks.L"), the final norm ("ln_final") or the unembedding ("unembed"),
as in `interp.models.placement.offload`. A map gives each unit a device:

    "auto"    the blocks split evenly, in contiguous runs, over the CUDA devices torch sees (block L on
              device L * k // n_layers); with one device or none, everything on that one (`device=`'s, else
              cuda, else the CPU).
    a dict    {unit name or layer number: device}, an int L meaning "blocks.L". A block not named runs where
              the block before it does (the first blocks, before any named one, where the first named one
              does); the embedding units, unless named, where the first block does; ln_final and the
              unembedding where the last block does. A tied unembedding reads the embedding's matrix, so it
              runs where the embedding does (naming them apart is refused).

`build_model` puts each parameter straight on its unit's device (the model is never whole on one device
first) and `attach` gives each unit's module a forward pre-hook that brings its inputs there (tensors, tuples
of tensors, the `AttentionMask`): the residual stream crosses devices at block boundaries only, and hooks
see each block's activations on that block's device. `model.device` stays the embedding's (where inputs go);
`model.device_map` is {unit: torch.device}. What combines layers (the statistics of every layer, the
analyses' stacks) brings them to the first device or the host first.

Why not accelerate's `dispatch_model`: its hooks align every submodule's weights and inputs on every call,
and it would be a new dependency for what is thirty lines over the units interp already has.

A KV cache is refused on a model split over several devices (one line): `KVCache` holds every layer's keys
in one tensor [n_layers, ...] on one device, read as such by the cache policies and the KV analyses; giving
each layer its own device is a change of the cache's layout, left for when someone needs generation split.
"""

from __future__ import annotations

import dataclasses
import re
import warnings

import torch
from torch import Tensor, nn

from interp.errors import Note, UserError
from . import device as machine  # attributes looked up at call time: interp.testing.simulated_gpu patches them
from . import memory

FIXED_UNITS = ("embed", "embed_ln", "pos_embed", "ln_final", "unembed")


class DeviceMapRefused(UserError, ValueError):
    """A device map interp cannot use, said in one line before any weight is read."""


def units_of(cfg) -> list[str]:
    """The units of a model of config `cfg`, in the order of computation."""
    out = ["embed"]
    if cfg.post_embedding_ln:
        out.append("embed_ln")
    if cfg.positional in ("learned", "sinusoidal"):
        out.append("pos_embed")
    out += [f"blocks.{l}" for l in range(cfg.n_layers)]
    return out + ["ln_final", "unembed"]


def unit_of(key: str) -> str:
    """The unit a state-dict key (or module name) belongs to: "blocks.3", "embed", ...; "embed" for anything
    else (the rotary frequencies: computed where the embedding is)."""
    head, _, rest = key.partition(".")
    if head == "blocks":
        return f"blocks.{rest.partition('.')[0]}"
    return head if head in FIXED_UNITS else "embed"


def parse_device_map(text: str):
    """The command line's spelling: "auto", or comma-separated KEY:DEVICE items where KEY is a layer ("3"), a
    range of layers ("0-15", both ends included) or a unit ("unembed"), and DEVICE a device ("cuda:1"):
    "0-15:cuda:0,16-31:cuda:1". Returns "auto" or {layer or unit: device}; a malformed item is one line."""
    if isinstance(text, dict):  # a library caller's map, as it is
        return text
    text = str(text).strip()
    if text == "auto":
        return "auto"
    said = f"device_map (--device-map) {text!r}"
    out: dict = {}
    for item in (s.strip() for s in text.split(",")):
        key, sep, device = item.partition(":")
        key, device = key.strip(), device.strip()
        if not sep or not key or not device:
            raise DeviceMapRefused(f"{said}: give 'auto', a dict {{layer or unit: device}}, or items LAYERS:DEVICE "
                                   f"(0-15:cuda:0) or UNIT:DEVICE (unembed:cuda:1); {item!r} is not one")
        if key.isdigit():
            keys = [int(key)]
        elif re.fullmatch(r"\d+-\d+", key):
            a, b = map(int, key.split("-"))
            if b < a:
                raise DeviceMapRefused(f"{said}: the range {key} runs backwards; write {b}-{a}")
            keys = list(range(a, b + 1))
        elif key in FIXED_UNITS:
            keys = [key]
        else:
            raise DeviceMapRefused(f"{said}: {key!r} is not a layer, a range of layers (0-15) or a unit "
                                   f"({', '.join(FIXED_UNITS)})")
        for k in keys:
            if k in out:
                raise DeviceMapRefused(f"{said} names {k} twice: give each layer and unit once")
            out[k] = device
    return out


def _device(value, key) -> torch.device:

    try:
        dev = machine.resolve_device(value)
    except UserError as e:
        raise DeviceMapRefused(f"device_map[{key!r}]: {e}") from None
    return torch.device("cuda", 0) if dev.type == "cuda" and dev.index is None else dev


def resolve_device_map(device_map, cfg, *, device=None) -> dict[str, torch.device]:
    """{unit: torch.device} for every unit of a model of config `cfg`, from "auto" or a dict (see the module
    doc), each device checked against this machine (`resolve_device`); "auto" without a GPU says so (a `Note`
    warning: the CLI's one note line). Refused in one line: a device the
    machine lacks, a layer out of range, an unknown unit, an empty map, a tied unembedding apart from the
    embedding, and `device` (the `device=` of the load) other than where the map puts the embedding."""

    units = units_of(cfg)
    n = cfg.n_layers
    if isinstance(device_map, str):
        if device_map != "auto":
            raise DeviceMapRefused(f"device_map={device_map!r}: give 'auto' or a dict {{layer or unit: device}}")
        gpus = [d for d in machine.available_devices() if d.startswith("cuda:")]
        if len(gpus) > 1:
            named = {f"blocks.{l}": torch.device(gpus[l * len(gpus) // max(1, n)]) for l in range(n)}
        else:
            one = _device(device if device is not None else (gpus[0] if gpus else "cpu"), "auto")
            named = {u: one for u in units}
            if not gpus:  # nothing to split over: said, as it would otherwise pass for a split
                warnings.warn(f"device_map='auto' (--device-map auto): torch sees no GPU on this machine, so no GPU took "
                              f"the map and the whole model runs on {one}", Note, stacklevel=2)
    elif isinstance(device_map, dict):
        if not device_map:
            raise DeviceMapRefused("device_map={} names no device: give 'auto' or {layer or unit: device}")
        named = {}
        for key, value in device_map.items():
            if isinstance(key, bool) or not isinstance(key, (int, str)):
                raise DeviceMapRefused(f"device_map key {key!r}: give a layer number or a unit name ({', '.join(FIXED_UNITS)}, "
                                       "blocks.L)")
            unit = f"blocks.{key}" if isinstance(key, int) else key
            if isinstance(key, int) and not 0 <= key < n or re.fullmatch(r"blocks\.\d+", unit) and unit not in units:
                raise DeviceMapRefused(f"device_map names layer {unit.partition('.')[2]}, and this model has layers "
                                       f"0-{n - 1}")
            if unit not in units:
                raise DeviceMapRefused(f"device_map names {key!r}, which this model does not have; its units: "
                                       f"{', '.join(u for u in units if not u.startswith('blocks.'))}, blocks.0-{n - 1} "
                                       "(or a layer number)")
            if unit in named:
                raise DeviceMapRefused(f"device_map names {unit} twice ({key!r}): give each once")
            named[unit] = _device(value, key)
    else:
        raise DeviceMapRefused(f"device_map={device_map!r}: give 'auto' or a dict {{layer or unit: device}}")

    blocks = [f"blocks.{l}" for l in range(n)]
    first_named = next((named[b] for b in blocks if b in named), None)
    if first_named is None:  # no block named: they follow the first unit named
        first_named = next(named[u] for u in units if u in named)
    full: dict[str, torch.device] = {}
    current = first_named
    for b in blocks:
        current = named.get(b, current)
        full[b] = current
    first = full[blocks[0]] if blocks else first_named
    last = full[blocks[-1]] if blocks else first_named
    for u in units:
        if u in ("embed", "embed_ln", "pos_embed"):
            full[u] = named.get(u, named.get("embed", first) if u != "embed" else first)
        elif u == "ln_final":
            full[u] = named.get(u, last)
    full["unembed"] = named.get("unembed", full["embed"] if cfg.tie_embeddings else full["ln_final"])
    if cfg.tie_embeddings and full["unembed"] != full["embed"]:
        raise DeviceMapRefused(f"device_map puts the unembedding on {full['unembed']} and the embedding on "
                               f"{full['embed']}, and this model ties them (the unembedding reads the embedding's "
                               "matrix): name them on the same device, or leave unembed out (it follows the embedding)")
    if device is not None:
        asked = _device(device, "device")
        if asked != full["embed"]:
            raise DeviceMapRefused(f"device={str(device)!r} and device_map, which puts the embedding (where inputs go) on "
                                   f"{full['embed']}, disagree: give one of the two (or the same device)")
    return {u: full[u] for u in units}


def is_split(device_map) -> bool:
    """Whether a resolved map uses more than one device."""
    return device_map is not None and len(set(device_map.values())) > 1


def may_split(device_map) -> bool:
    """Whether an unresolved map ("auto" or a dict, `parse_device_map`'s) would use several devices on this
    machine, whatever the model (a dict naming two devices; "auto" with several GPUs)."""
    if device_map is None:
        return False
    if device_map == "auto":

        return sum(d.startswith("cuda:") for d in machine.available_devices()) > 1
    return len({str(torch.device(v)) for v in device_map.values()}) > 1


# ---- running -----------------------------------------------------------------------------------------
def move(value, device: torch.device):
    """`value` with its tensors on `device`: a tensor, a tuple or list of them (rotary cos/sin), an
    `AttentionMask` (a dataclass: its tensor fields), nested; anything else as it is."""
    if isinstance(value, Tensor):
        return value if value.device == device else value.to(device)
    if isinstance(value, list):
        return [move(v, device) for v in value]
    if isinstance(value, tuple):
        moved = [move(v, device) for v in value]
        return type(value)(*moved) if hasattr(value, "_fields") else tuple(moved)  # a named tuple keeps its type
    if isinstance(value, dict):
        return {k: move(v, device) for k, v in value.items()}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        changes = {f.name: move(getattr(value, f.name), device) for f in dataclasses.fields(value)
                   if f.init and isinstance(getattr(value, f.name), (Tensor, tuple, list, dict))}
        return dataclasses.replace(value, **changes) if changes else value
    return value


def attach(model: nn.Module, device_map: dict[str, torch.device]) -> None:
    """Record the map on `model` (`model.device_map`) and, when it spans several devices, give each unit's
    module a forward pre-hook that brings its inputs to the unit's device."""
    model.device_map = dict(device_map)
    if not is_split(device_map):
        return
    for unit, device in device_map.items():
        attach_unit(model, unit, device)


def attach_unit(model: nn.Module, unit: str, device: torch.device) -> None:
    """The pre-hook that brings `unit`'s module its inputs on `device` (again, for a module replaced: weight
    processing's untied unembedding), when the model's map spans several devices."""
    if not is_split(model.device_map):
        return
    module = getattr(model, unit, None) if "." not in unit else model.get_submodule(unit)
    if isinstance(module, nn.Module):
        module.register_forward_pre_hook(_bring_to(device), with_kwargs=True)


def _bring_to(device: torch.device):
    def hook(module, args, kwargs):
        return move(args, device), move(kwargs, device)
    return hook


def spread(ropes, layer_devices: list[torch.device]):
    """The per-layer rotary tables (cos, sin), each on its layer's device; a table shared by several layers is
    moved once per device."""
    if ropes is None:
        return None
    moved: dict = {}
    out = []
    for rope, device in zip(ropes, layer_devices):
        key = (id(rope), device)
        if key not in moved:
            moved[key] = move(rope, device)
        out.append(moved[key])
    return out


def refuse_kv_cache(model) -> None:
    if is_split(getattr(model, "device_map", None)):
        raise DeviceMapRefused(
            f"a KV cache (generation, KV analyses) on a model split over {len(set(model.device_map.values()))} devices: "
            "the cache holds every layer's keys in one tensor on one device; load the model on one device (device=) "
            "for that")


def describe(device_map: dict[str, torch.device]) -> str:
    """One line: the runs of units per device, e.g. "embed, blocks.0-15 on cuda:0; blocks.16-31, ln_final, unembed on cuda:1"."""
    parts: list[tuple[torch.device, list[str]]] = []
    for unit, dev in device_map.items():
        if parts and parts[-1][0] == dev:
            parts[-1][1].append(unit)
        else:
            parts.append((dev, [unit]))

    def names(units: list[str]) -> str:
        blocks = [int(u.split(".")[1]) for u in units if u.startswith("blocks.")]
        other = [u for u in units if not u.startswith("blocks.")]
        head = [u for u in other if u in ("embed", "embed_ln", "pos_embed")]
        tail = [u for u in other if u not in head]
        span = [] if not blocks else [f"blocks.{blocks[0]}" if len(blocks) == 1 else f"blocks.{blocks[0]}-{blocks[-1]}"]
        return ", ".join(head + span + tail)

    return "; ".join(f"{names(units)} on {dev}" for dev, units in parts)


def unit_bytes(cfg, unit: str, element_size: int) -> int:
    """Estimated bytes of a unit's weights: the embedding and unembedding matrices (d_vocab x d_model; a tied
    unembedding holds none of its own), the learned positions, a block's share of the rest; norms are small."""
    matrix = cfg.d_vocab * cfg.d_model
    if unit == "embed":
        return matrix * element_size
    if unit == "unembed":
        return 0 if cfg.tie_embeddings else matrix * element_size
    if unit == "pos_embed":
        return cfg.n_ctx * cfg.d_model * element_size if cfg.positional == "learned" else 0
    if unit.startswith("blocks."):
        rest = cfg.n_params() - matrix * (1 if cfg.tie_embeddings else 2)
        if cfg.positional == "learned":
            rest -= cfg.n_ctx * cfg.d_model
        return max(0, rest) // max(1, cfg.n_layers) * element_size
    return cfg.d_model * 2 * element_size


def check_fits_split(cfg, batch: int, length: int, device_map, *, device=None, what: str = "--seq-len",
                     element_size: int = 4):
    """`memory.check_fits` on each device of `device_map` ("auto", a dict, or the command line's spelling), with
    that device's share of the weights and one layer's activations: one line naming the device that runs
    short; returns the tightest `Fit`."""

    placed = resolve_device_map(parse_device_map(device_map), cfg, device=device)
    fits = []
    for dev in dict.fromkeys(placed.values()):
        share = sum(unit_bytes(cfg, u, element_size) for u, d in placed.items() if d == dev)
        fits.append(memory.check_fits(cfg, batch, length, dev, what=what, element_size=element_size, weights=share))
    return min(fits, key=lambda f: float("inf") if f.longest is None else f.longest)


def check_fits(cfg, dtype: torch.dtype, device_map: dict[str, torch.device], *, source: str) -> None:
    """Refuse (`memory.WeightsDoNotFit`, one line) a map that gives a device more weights than it has free,
    from the config, before any weight is read."""

    element = torch.empty((), dtype=dtype, device="meta").element_size()
    per: dict[torch.device, int] = {}
    for unit, dev in device_map.items():
        per[dev] = per.get(dev, 0) + unit_bytes(cfg, unit, element)
    for dev, needed in per.items():
        free = memory.available_bytes(dev)
        if free is not None and needed > free:
            units = [u for u, d in device_map.items() if d == dev]
            raise memory.WeightsDoNotFit(
                f"{source}: device_map puts about {needed / memory.GiB:.1f} GiB of weights ({len(units)} units, "
                f"{str(dtype).removeprefix('torch.')}) on {dev}, which has {free / memory.GiB:.1f} GiB free: move "
                "blocks to another device, or use a smaller dtype")
