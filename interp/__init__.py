"""interp: mechanistic interpretability for PyTorch transformers.

Attention runs fused (SDPA / FlashAttention) by default and switches, per layer and on demand, to an
instrumented path that exposes scores and patterns to hooks.

The names below are imported on first use (PEP 562), so `import interp` (and the `interp` command's
`--help`) does not pay for torch until a model is touched.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_LAZY = {
    "ActivationCache": "interp.models.readouts.activation_cache",
    "KVCache": "interp.models.kv.cache",
    "FactoredMatrix": "interp.models.readouts.factored",
    "HookPoint": "interp.models.hooks",
    "act_name": "interp.models.hooks",
    "HookedTransformer": "interp.models",
    "ModelConfig": "interp.models",
    "RopeScaling": "interp.models",
    "CheckpointError": "interp.loading",
    "UserError": "interp.errors",  # every bad-input error (a bad name, file or setting) is one
    "from_hf": "interp.loading",
    "load": "interp.loading",
    "save_model": "interp.loading",
    "from_transformer_lens": "interp.interop",  # imports transformer_lens only when called
    "SAE": "interp.models.saes",  # sparse autoencoders: read, spliced into any model (model.add_sae, run_with_saes)
    "load_sae": "interp.models.saes",
    "HookedSAETransformer": "interp.saes",  # SAELens's way in (from_pretrained); every interp model has its methods
}

__all__ = sorted(_LAZY)

def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value  # later lookups skip this function
        return value
    raise AttributeError(f"module 'interp' has no attribute {name!r}")


def __dir__():
    return sorted([*globals(), *_LAZY])
