"""The transformer, its components, model families and their weight converters."""

from .config import ModelConfig, RopeScaling
from .transformer import HookedTransformer, TransformerBlock, lm_loss

__all__ = ["HookedTransformer", "ModelConfig", "RopeScaling", "TransformerBlock", "lm_loss"]
