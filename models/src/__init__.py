"""The model. At the top: its config (config.py), the hookable base every model shares (base.py), generation
(generate.py), what a model holds besides its weights (runtime.py), text in and out (text.py) and positions
(positions.py: rotary and ALiBi). In rooms: interp's own transformer (native/), the wrapped one (wrapped/:
transformers runs it), what is read out of a model (readouts/: the activation cache, weight views, head
statistics), where its weights live (placement/: device, device maps, offload, memory, mapped files), hook
points (hooks/), the KV caches (kv/), the families (one file each) and formats that load checkpoints, RoPE
chosen at load (rope/), runs and their checkpoints (runs/) and the zoo."""

from .base import HookedModel, lm_loss
from .config import ModelConfig, RopeScaling
from .generate import Sampling
from .native.transformer import HookedTransformer, TransformerBlock

__all__ = ["HookedModel", "HookedTransformer", "ModelConfig", "RopeScaling", "Sampling", "TransformerBlock", "lm_loss"]
