"""Model families: each maps a Hugging Face `model_type` to our config and weights.

A family is registered once, in its own file, with the HF config keys it understands; anything
it cannot represent raises instead of loading a silently different model.
"""

from .registry import FAMILIES, Family, get_family, register

# Importing the family modules registers them.
from . import gemma3, gpt2, llamalike, neox  # noqa: E402,F401
# families A (data over existing components)
from . import falcon, gpt_neo, mpt, opt, phi3, qwen3, xglm  # noqa: E402,F401
# families B (soft-capping, interleaved rotary, embedding norm, OLMo 2 norms)
from . import bloom, gemma2, gptj, olmo2  # noqa: E402,F401
# families C (mixture of experts, learned sink logits)
from . import gpt_oss, llamalike_moe  # noqa: E402,F401

__all__ = ["FAMILIES", "Family", "get_family", "register"]
