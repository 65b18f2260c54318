"""Our checkpoint format, read: `config.json` ({"interp_format": 1, "config": ModelConfig}) beside
`model.safetensors` (written by `tensor_files.save_model`). The header's shapes are checked against the
config before any model is built."""

from __future__ import annotations

from pathlib import Path

from .build import build_model, check_shapes
from ..config import ModelConfig
from .folder import local_tokenizer
from ..placement.tensor_files import header_shapes, read_state_dict
from ..native.transformer import HookedTransformer


def claims(raw: dict | None) -> bool:
    """Whether a folder's parsed config.json is ours."""
    return isinstance(raw, dict) and "interp_format" in raw


def config(path: Path, raw: dict) -> ModelConfig:
    return ModelConfig.from_dict(raw["config"])


def check_header(path: Path, cfg: ModelConfig) -> None:
    """The header's shapes against `cfg`, before anything is built or estimated from it (a config that lies
    about its size is refused as a lie, not as too big)."""
    weights = path / "model.safetensors"
    shapes = header_shapes(weights) if weights.is_file() else None
    if shapes is not None:
        check_shapes(cfg, shapes, str(weights))


def load(path: Path, raw: dict, *, dtype, device, tokenizer, offload=None, device_map=None) -> HookedTransformer:
    cfg = config(path, raw)
    weights = path / "model.safetensors"
    check_header(path, cfg)
    model = build_model(cfg, read_state_dict(path), str(weights), dtype, device, fresh=True, offload=offload,
                        device_map=device_map)
    model.tokenizer = tokenizer if tokenizer is not None else local_tokenizer(path)
    return model
