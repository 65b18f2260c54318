"""A Hugging Face checkpoint folder, read without `transformers`: config.json's `model_type` picks the
family (`families/`), which writes our config and converts the weights (safetensors, sharded or not,
or a weights-only `pytorch_model.bin`). A `model_type` no native family claims is loaded by
transformers and wrapped (`interp.models.wrapped`), when its attention goes through transformers'
attention interface; otherwise it is refused in one line before any weight is read."""

from __future__ import annotations

from pathlib import Path

from .build import build_model, convert_weights
from ..config import ModelConfig
from ..families import FAMILIES, get_family
from .folder import local_tokenizer
from ..tensor_files import read_state_dict
from ..transformer import HookedTransformer
from .. import wrapped


def native(raw: dict) -> bool:
    """Whether a native family converts this config.json's model_type (else it is wrapped)."""
    return raw.get("model_type") in FAMILIES


def config(path: Path, raw: dict) -> ModelConfig:
    if not native(raw):
        return wrapped.config_from_raw(raw)
    return get_family(raw.get("model_type")).config(raw)


def load(path: Path, raw: dict, *, dtype, device, tokenizer) -> HookedTransformer:
    if not native(raw):
        return wrapped.load_wrapped(path, raw, dtype=dtype, device=device,
                                    tokenizer=tokenizer if tokenizer is not None else local_tokenizer(path))
    family = get_family(raw.get("model_type"))
    cfg = family.config(raw)
    sd = convert_weights(family, cfg, read_state_dict(path), str(path))
    model = build_model(cfg, sd, str(path), dtype, device)
    model.tokenizer = tokenizer if tokenizer is not None else local_tokenizer(path)
    return model
