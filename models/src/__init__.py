"""The model: the hookable base every model shares (base.py), interp's own transformer and its
components, the wrapped one (wrapped/: transformers runs it), the caches (kv/), the families (one file
each) and formats that load checkpoints, RoPE chosen at load (rope/), runs and the zoo."""

from .base import HookedModel
from .config import ModelConfig, RopeScaling
from .generate import Sampling
from .transformer import HookedTransformer, TransformerBlock, lm_loss

__all__ = ["HookedModel", "HookedTransformer", "ModelConfig", "RopeScaling", "Sampling", "TransformerBlock", "lm_loss"]
