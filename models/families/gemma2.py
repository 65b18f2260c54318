"""Gemma 2 (Gemma Team 2024; Hugging Face `model_type` "gemma2"): sliding-window ("local") and full
("global") layers alternating, one RoPE base for both; soft-capping of the attention scores
(cap * tanh(scores / cap), after the query scale, before the mask) and of the final logits; and what
every Gemma has (`gemmalike.py`: sandwich norms, GeGLU (tanh), embeddings scaled by sqrt(d_model),
(1 + w) norm weights, a tied unembedding, queries scaled by query_pre_attn_scalar ** -0.5). No QK-norm
(Gemma 3 added it).

Defaults for absent keys are Hugging Face's (`Gemma2Config`: caps 50 on scores and 30 on logits, layer 0
local, then every other); a key set to null turns its cap off. What this model cannot represent raises,
naming the key.
"""

from __future__ import annotations

from ..config import ModelConfig
from . import gemmalike
from .registry import Family, register, reject, require, rotary_from_hf

MT = "gemma2"


def config(d: dict) -> ModelConfig:
    reject(d, MT, use_bidirectional_attention=bool)
    n_layers = require(d, "num_hidden_layers", MT)
    n_ctx = d.get("max_position_embeddings", 8192)
    return gemmalike.config(
        d, MT,
        layer_types=gemmalike.layer_types(d, MT, n_layers, 2),  # Gemma2Config: local, global, local, ...
        rotary=rotary_from_hf(d, d.get("head_dim") or gemmalike.HEAD_DIM, n_ctx),
        rotary_base_local=None,
        n_ctx=n_ctx,
        qk_norm=False,
        attn_softcap=d.get("attn_logit_softcapping", 50.0),
        final_softcap=d.get("final_logit_softcapping", 30.0),
    )


register(Family("gemma2", (MT,), config, gemmalike.weights))
