"""A Hugging Face checkpoint folder, read without `transformers`: config.json's `model_type` picks the
family (`families/`), which writes our config and converts the weights (safetensors, sharded or not,
or a weights-only `pytorch_model.bin`)."""

from __future__ import annotations

from pathlib import Path

from .build import build_model, convert_weights
from ..config import ModelConfig
from ..families import get_family
from .folder import local_tokenizer
from ..tensor_files import read_state_dict
from ..transformer import HookedTransformer


def config(path: Path, raw: dict) -> ModelConfig:
    return get_family(raw.get("model_type")).config(raw)


def load(path: Path, raw: dict, *, dtype, device, tokenizer) -> HookedTransformer:
    family = get_family(raw.get("model_type"))
    cfg = family.config(raw)
    sd = convert_weights(family, cfg, read_state_dict(path), str(path))
    model = build_model(cfg, sd, str(path), dtype, device)
    model.tokenizer = tokenizer if tokenizer is not None else local_tokenizer(path)
    return model
