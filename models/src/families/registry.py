"""The family registry: `model_type` -> `Family`. A family file registers itself when imported
(`register(Family(...))`), and `families/__init__.py` imports every module of the folder, so a new
family is one new file and nothing else to edit."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

from torch import Tensor

from ..config import ModelConfig
# What every converter builds with; also importable from here, their first home.
from .builders import TensorGetter, qkv, reject, require, rms_decoder, rotary_from_hf, t  # noqa: F401

if TYPE_CHECKING:
    from .gguf_layout import GGUFLayout


@dataclass(frozen=True)
class Family:
    """config: HF config dict -> ModelConfig.  weights: (our config, getter) -> our state dict.
    gguf: how llama.cpp writes it, per GGUF architecture name (`gguf_layout.GGUFLayout`); empty where
    interp reads no GGUF file of the family."""

    name: str
    model_types: tuple[str, ...]
    config: Callable[[dict[str, Any]], ModelConfig]
    weights: Callable[[ModelConfig, TensorGetter], dict[str, Tensor]]
    gguf: Mapping[str, GGUFLayout] = field(default_factory=dict)


FAMILIES: dict[str, Family] = {}


def register(family: Family) -> Family:
    for mt in family.model_types:
        if mt in FAMILIES:
            raise ValueError(f"model_type {mt!r} is registered twice ({FAMILIES[mt].name}, {family.name})")
        FAMILIES[mt] = family
    return family


def get_family(model_type: str | None) -> Family:
    if model_type not in FAMILIES:
        raise NotImplementedError(
            f"unsupported architecture model_type={model_type!r}; interp converts {sorted(FAMILIES)}. "
            "A new family is one file in models/src/families/ that registers a config and a weight mapping."
        )
    return FAMILIES[model_type]
