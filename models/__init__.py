"""The transformer, its components, model families and their weight converters."""

from .base import HookedModel
from .config import ModelConfig, RopeScaling
from .generate import Sampling
from .transformer import HookedTransformer, TransformerBlock, lm_loss

__all__ = ["HookedModel", "HookedTransformer", "ModelConfig", "RopeScaling", "Sampling", "TransformerBlock", "lm_loss"]
