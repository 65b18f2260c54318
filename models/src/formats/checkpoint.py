"""One loader for every checkpoint format. Each format is a sibling module with the same two entry
points, `config(path, raw) -> ModelConfig` (without reading weights) and `load(path, raw, *, dtype,
device, tokenizer) -> HookedTransformer`:

    format_ours   our folder: config.json {"interp_format": 1, ...} + model.safetensors
    format_hf     a Hugging Face folder (config.json with a model_type), converted by its family
    gguf          a llama.cpp .gguf file, dequantized, with its tokenizer

`_format_of` decides which, once, and refuses a folder that carries its own code before any format
reads it. What the formats share sits below them: `tensor_files` (reading and writing tensors),
`build` (checks, conversion, building the model), `folder` (tokenizer files, code that never runs),
`errors`. Finding checkpoints by name is the user surface's (`interp.loading`).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from . import hf as format_hf
from . import ours as format_ours
from . import gguf
from .build import build_model, check_finite, convert_weights, refuse_quantized, refuse_quantization_config
from ..rope import choice as rope_choice
from ..placement import memory
from ..placement import device_map as device_maps
from ..placement.choice import Placement
from ..config import ModelConfig, RopeScaling
from interp.errors import BadValue, CheckpointError, OwnCodeRefused
from .folder import local_tokenizer, refuse_files_outside, refuse_own_code
from ..placement.tensor_files import FORMAT_VERSION, index_shards, read_state_dict, safetensors_header, save_model
from ..base import HookedModel, rope_refusal

__all__ = ["CheckpointError", "FORMAT_VERSION", "OwnCodeRefused", "build_model", "check_finite", "check_placement",
           "convert_weights", "is_wrapped", "load_checkpoint", "local_tokenizer", "parse_dtype", "read_config",
           "read_state_dict", "rope_scaling_for", "save_model"]


def _format_of(path, *, tokenizer_given: bool):
    """(format module, folder or file, parsed config.json or None) for a checkpoint path: a .gguf
    file, or a folder (or a file inside one) with config.json."""
    path = Path(path)
    if path.suffix == ".gguf":
        return gguf, path, None
    if path.is_file():
        path = path.parent
    config_file = path / "config.json"
    if not config_file.exists():
        raise CheckpointError(f"{path} has no config.json; a checkpoint directory needs config.json and model.safetensors")
    try:
        raw = json.loads(config_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{config_file} is not valid JSON ({e}); the file is truncated or corrupt") from None
    except OSError as e:
        raise CheckpointError(f"cannot read {config_file} ({e})") from None
    if not isinstance(raw, dict):
        raise CheckpointError(f"{config_file} holds a JSON {type(raw).__name__}, not an object: it is not a model config")
    refuse_own_code(path, raw, tokenizer_given=tokenizer_given)  # before any format reads anything
    refuse_files_outside(path, raw, tokenizer_given=tokenizer_given)
    refuse_quantization_config(config_file, raw)
    return (format_ours if format_ours.claims(raw) else format_hf), path, raw


def load_checkpoint(path, *, dtype: torch.dtype | str | None = None, tokenizer=None, rope_scaling=None,
                    placement: Placement = Placement()) -> HookedModel:
    """A model from a local checkpoint directory (or a file inside it): our format, or a Hugging Face
    checkpoint converted by its family (by config.json's `model_type`), without `transformers`;
    or a llama-architecture `.gguf` file (`interp.models.formats.gguf`). `rope_scaling` (any spelling of
    `rope_choice`; None: the checkpoint's own) replaces the checkpoint's rotary scaling, checked against
    its config before a weight is read (`rope_scaling_for`). `dtype`: see `resolve_dtype`; the weights in
    it must fit in the device's free memory (`memory.check_weights_fit`, from the config, before any weight
    is read). `placement` (`interp.models.placement.choice.Placement`: device, offload, device map; default
    the CPU, whole): with an offload the weights stay off the device, each block brought there when it runs
    (`interp.models.placement.offload`), and only the largest block must fit; with a device map the blocks
    split over devices (`interp.models.placement.device_map`), checked against the config and the machine, and
    each device's share of the weights against its free memory, before a weight is read. Either is refused for
    a model transformers runs (`Placement.refuse_wrapped`). A quantized checkpoint (config.json's
    `quantization_config`, integer or float8 weights in its safetensors headers) is refused first, in one line
    naming its layout (`build.refuse_quantized`)."""
    dtype = parse_dtype(dtype)
    fmt, path, raw = _format_of(path, tokenizer_given=tokenizer is not None)
    if fmt is not gguf:  # integer or float8 weights: a quantized layout, refused from the headers alone
        refuse_quantized({k: d for k, (d, _) in stored_dtypes(path).items()}, str(path))
    wrapped = fmt is format_hf and not format_hf.native(raw)
    if wrapped:
        placement.refuse_wrapped(str(path), raw.get("model_type"))
    scaling = None if rope_scaling is None else _rope_scaling(fmt, path, raw, rope_scaling)
    device, offload = placement.device, placement.offload
    asked, dtype = dtype, resolve_dtype(dtype, device, fmt, path, raw)
    placed = None
    if not wrapped:  # a wrapped config's size is transformers' to build
        cfg = fmt.config(path, raw)
        if fmt is format_ours:
            format_ours.check_header(path, cfg)
        placed = placement.units(cfg)
        if placed is None:
            memory.check_weights_fit(cfg, dtype, device, source=str(path), offload=offload)
        else:
            device = placed["embed"]
            dtype = resolve_dtype(asked, device, fmt, path, raw)  # the checkpoint's own on GPUs, as device= does
            device_maps.check_fits(cfg, dtype, placed, source=str(path))
    else:  # transformers builds it: its parameters counted on the meta device
        memory.check_weights_fit(fmt.config(path, raw), dtype, device, source=str(path),
                                 n_params=format_hf.wrapped_n_params(raw))
    extra = {} if placed is None else {"device_map": placed}
    model = fmt.load(path, raw, dtype=dtype, device=device, tokenizer=tokenizer, offload=offload, **extra)
    return model if rope_scaling is None else model.rescale_rope_(scaling)


def check_placement(path, placement: Placement, *, cfg: ModelConfig | None = None) -> None:
    """`placement` checked against the checkpoint at `path` from its config alone (`cfg`, when the caller has
    read it already), as `load_checkpoint` checks it: an offload or a map for a model transformers runs, and a
    map against the model's layers, units and this machine, refused in one line (`Placement`)."""
    fmt, path, raw = _format_of(path, tokenizer_given=False)
    if fmt is format_hf and not format_hf.native(raw):
        placement.refuse_wrapped(str(path), raw.get("model_type"))
    else:
        placement.units(cfg or fmt.config(path, raw))


def rope_scaling_for(path, rope_scaling, *, cfg: ModelConfig | None = None) -> RopeScaling | None:
    """The `RopeScaling` that `rope_scaling` (any spelling of `rope_choice`) means for the checkpoint at
    `path`, from its config alone (`cfg`, when the caller has read it already); refused in one line for a
    model without rotary positions or one that transformers runs (wrapped: its rope_parameters are
    transformers' to apply)."""
    return _rope_scaling(*_format_of(path, tokenizer_given=False), rope_scaling, cfg=cfg)


def _rope_scaling(fmt, path, raw, rope_scaling, *, cfg: ModelConfig | None = None) -> RopeScaling | None:
    if fmt is format_hf and not format_hf.native(raw):
        raise rope_refusal(raw.get("model_type"), str(path), rope_scaling)  # a bad spelling is said as such first
    return rope_choice.choose(cfg or fmt.config(path, raw), rope_scaling)


def is_wrapped(path) -> bool:
    """Whether the checkpoint at `path` is a Hugging Face folder of an architecture no native family
    converts: transformers runs it, wrapped (`interp.models.wrapped`). Reads config.json only."""
    fmt, _, raw = _format_of(path, tokenizer_given=False)
    return fmt is format_hf and not format_hf.native(raw)


def read_config(path) -> ModelConfig:
    """The ModelConfig of a checkpoint (folder, file inside one, or .gguf) without reading its weights."""
    fmt, path, raw = _format_of(path, tokenizer_given=False)
    return fmt.config(path, raw)


# The dtypes a load gives weights in, under every name a caller may use (transformers' strings among them).
LOADABLE = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
DTYPE_NAMES = {"float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
               "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
               "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
               "float64": torch.float64, "fp64": torch.float64, "double": torch.float64}


def parse_dtype(dtype) -> torch.dtype | str | None:
    """`dtype` as a load takes it: None, "auto", or a floating torch dtype interp loads weights in (float32,
    bfloat16, float16, float64), given as the dtype or its name ("float16", "fp16", "torch.float16", as
    transformers takes them). Anything else is refused in one line listing what is accepted (`BadValue`)."""
    if dtype is None or (isinstance(dtype, torch.dtype) and dtype in LOADABLE):
        return dtype
    if isinstance(dtype, str):
        name = dtype.strip().lower().removeprefix("torch.")
        if name == "auto":
            return "auto"
        if name in DTYPE_NAMES:
            return DTYPE_NAMES[name]
    raise BadValue(f"dtype {dtype!r} is not one interp loads weights in: give 'auto', 'float32' ('fp32'), 'bfloat16' "
                   "('bf16'), 'float16' ('fp16') or 'float64', as a string or a torch dtype (torch.bfloat16), or None "
                   "(float32 on the CPU, the checkpoint's own on a GPU)")


def resolve_dtype(dtype, device, fmt, path, raw) -> torch.dtype:
    """The dtype a load gives the weights: `dtype` itself when it names one (`parse_dtype`); "auto", the
    checkpoint's own (`checkpoint_dtype`); None (the default), the checkpoint's own on an accelerator, and
    float32 on the CPU: exact numbers, TransformerLens's default, and CPUs without bf16 matrix units (AMX)
    multiply bf16 several times slower than float32 (docs/models.md, "Big models")."""
    dtype = parse_dtype(dtype)
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype is None and torch.device(device or "cpu").type == "cpu":
        return torch.float32
    return checkpoint_dtype(fmt, path, raw)


def stored_dtypes(path) -> dict[str, tuple[torch.dtype, int]]:
    """{tensor name: (stored dtype, bytes)} of a checkpoint folder's safetensors files, from their headers (no
    weight read); {} for a folder of `pytorch_model.bin` (its tensors are checked as they are converted)."""
    index = path / "model.safetensors.index.json"
    files = [path / "model.safetensors"]
    if index.exists() and not files[0].exists():
        files = sorted(set(index_shards(index).values()))  # a shard outside the folder: refused, not probed
    return {name: (e["torch_dtype"], e["data_offsets"][1] - e["data_offsets"][0])
            for f in files if f.is_file() for name, e in safetensors_header(f)[0].items()}


def checkpoint_dtype(fmt, path, raw) -> torch.dtype:
    """The floating dtype a checkpoint stores most of its weights in, from the safetensors headers (no
    weight read), else config.json's `dtype` / `torch_dtype`; float32 for a GGUF file (dequantized) and
    for a folder that says nothing."""
    if fmt is gguf:
        return torch.float32
    count: dict[torch.dtype, int] = {}
    for dtype, nbytes in stored_dtypes(path).values():
        if dtype.is_floating_point:
            count[dtype] = count.get(dtype, 0) + nbytes
    if count:
        return max(count, key=count.get)
    named = (raw or {}).get("dtype") or (raw or {}).get("torch_dtype")
    found = getattr(torch, named, None) if isinstance(named, str) else None
    return found if found in LOADABLE else torch.float32
