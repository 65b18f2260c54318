"""Loading and saving: our checkpoint format, Hugging Face checkpoint directories and model objects.

Our format is a directory with `config.json` ({"interp_format": 1, "config": ModelConfig}) and
`model.safetensors` (tensors may be stored in fp16/bf16; they are restored to the requested dtype).
A Hugging Face directory (`config.json` with a `model_type`, `model.safetensors`, a sharded
`model.safetensors.index.json` or `pytorch_model.bin`) is converted by its family in
`interp.models.families`, without needing `transformers` installed.
"""

from __future__ import annotations

from pathlib import Path

import torch

from interp.models import HookedTransformer, ModelConfig
from interp.models.checkpoint import (
    FORMAT_VERSION,
    CheckpointError,
    build_model,
    convert_weights,
    load_checkpoint,
    save_model,
)
from interp.models.families import get_family

def load(path, *, dtype: torch.dtype = torch.float32, device: torch.device | str | None = None, tokenizer=None) -> HookedTransformer:
    """Load a model from a directory: our format or a Hugging Face checkpoint (by its config.json)."""
    path = Path(path)
    if not path.exists():
        resolved = _resolve_named(str(path))
        if resolved is None:
            raise FileNotFoundError(f"no checkpoint at {path}: give a directory with config.json and model.safetensors")
        path = resolved
    return load_checkpoint(path, dtype=dtype, device=device, tokenizer=tokenizer)


def from_hf(hf_model, *, tokenizer=None, dtype: torch.dtype | None = None, device=None) -> HookedTransformer:
    """Convert a `transformers` causal-LM object (GPT-2, GPT-NeoX/Pythia, Llama, Mistral, Qwen2)."""
    config = hf_model.config.to_dict()
    family = get_family(config.get("model_type"))
    cfg = family.config(config)
    tensors = dict(hf_model.state_dict())
    sd = convert_weights(family, cfg, tensors, f"{type(hf_model).__name__} state_dict")
    first = next(iter(tensors.values()))
    model = build_model(cfg, sd, type(hf_model).__name__, dtype or first.dtype, device or first.device)
    model.tokenizer = tokenizer
    return model


# ---- internals -----------------------------------------------------------------------------
def _resolve_named(name: str) -> Path | None:
    """Hook for named models (the zoo); None when `name` names nothing."""
    try:
        from interp.models import zoo  # noqa: F401
    except ImportError:
        return None
    return zoo.resolve(name)


