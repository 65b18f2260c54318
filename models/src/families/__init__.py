"""Model families: each maps a Hugging Face `model_type` to our config and weights (and, where llama.cpp
writes it, its GGUF layout).

A family is one file in this folder that registers itself when imported (`register(Family(...))`), with
the HF config keys it understands; anything it cannot represent raises instead of loading a silently
different model. Every module here is imported below, found by `pkgutil`, so a new file needs no import
line anywhere; what the families share is `builders.py` (and `gguf_layout.py` for their GGUF layouts).
"""

import importlib
import pkgutil

from .registry import FAMILIES, Family, get_family, register

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")  # a family registers itself

__all__ = ["FAMILIES", "Family", "get_family", "register"]
