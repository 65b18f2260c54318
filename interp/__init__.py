"""interp: mechanistic interpretability for PyTorch transformers.

Attention runs fused (SDPA / FlashAttention) by default and switches, per layer and on demand, to an
instrumented path that exposes scores and patterns to hooks.
"""

from interp.models.cache import ActivationCache, KVCache
from interp.models.hooks import HookPoint, act_name
from interp.models import HookedTransformer, ModelConfig, RopeScaling
from interp.loading import CheckpointError, from_hf, load, save_model
from interp.interop import from_transformer_lens  # imports transformer_lens only when called

__version__ = "0.1.0"

__all__ = [
    "ActivationCache",
    "CheckpointError",
    "HookPoint",
    "HookedTransformer",
    "KVCache",
    "ModelConfig",
    "RopeScaling",
    "act_name",
    "from_hf",
    "from_transformer_lens",
    "load",
    "save_model",
]
