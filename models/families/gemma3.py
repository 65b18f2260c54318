"""Gemma 3, text only (Gemma Team 2025; Hugging Face `model_type` "gemma3_text"): five sliding-window
("local") layers for each full ("global") one, each kind with its own RoPE base; QK-norm over each
head; and what every Gemma has (`gemmalike.py`: sandwich norms, GeGLU (tanh), embeddings scaled by
sqrt(d_model), (1 + w) norm weights, a tied unembedding, queries scaled by query_pre_attn_scalar ** -0.5).

Defaults for absent keys are Hugging Face's (`Gemma3TextConfig`): a config.json that transformers
loads is read the same way here. What this model cannot represent raises, naming the key.
"""

from __future__ import annotations

from typing import Any

from ..config import ModelConfig
from . import gemmalike
from .gemmalike import LAYER_TYPES as _LAYER_TYPES
from .registry import Family, register, reject, require, rotary_from_hf

MT = "gemma3_text"
_DEFAULT_THETA = {"full_attention": 1_000_000.0, "sliding_attention": 10_000.0}  # Gemma3TextConfig.default_theta


def _rope(d: dict) -> tuple[dict[str, Any], dict[str, Any]]:
    """(full layers' rope parameters, sliding layers'), from transformers 5's per-layer-type
    `rope_parameters` or the older `rope_theta` / `rope_local_base_freq` / `rope_scaling`."""
    params = d.get("rope_parameters") or {}
    if params and set(params) <= set(_LAYER_TYPES):
        full, local = dict(params.get("full_attention") or {}), dict(params.get("sliding_attention") or {})
    else:
        full = {**(d.get("rope_scaling") or {}), **params}
        full.setdefault("rope_theta", d.get("rope_theta", _DEFAULT_THETA["full_attention"]))
        local = {"rope_type": "default", "rope_theta": d.get("rope_local_base_freq", _DEFAULT_THETA["sliding_attention"])}
    full.setdefault("rope_theta", _DEFAULT_THETA["full_attention"])
    local.setdefault("rope_theta", _DEFAULT_THETA["sliding_attention"])
    if local.get("rope_type", local.get("type", "default")) != "default" or set(local) - {"rope_type", "type", "rope_theta"}:
        raise NotImplementedError(f"{MT} config scales the sliding layers' RoPE ({local}); interp supports plain RoPE there")
    return full, local


def config(d: dict) -> ModelConfig:
    reject(
        d, MT,
        # Gemma 2's soft-capping: Gemma 3 checkpoints never set it (interp's Gemma 2 family caps)
        attn_logit_softcapping=lambda v: True,
        final_logit_softcapping=lambda v: True,
        use_bidirectional_attention=bool,
    )
    n_layers = require(d, "num_hidden_layers", MT)
    layer_types = gemmalike.layer_types(d, MT, n_layers, d.get("sliding_window_pattern", 6))
    full, local = _rope(d)
    n_ctx = d.get("max_position_embeddings", 131_072)
    rotary = rotary_from_hf({"rope_parameters": full}, d.get("head_dim") or gemmalike.HEAD_DIM, n_ctx)
    return gemmalike.config(
        d, MT, layer_types=layer_types, rotary=rotary, n_ctx=n_ctx, qk_norm=True, attn_softcap=None, final_softcap=None,
        rotary_base_local=float(local["rope_theta"]) if "sliding" in layer_types else None,
    )


register(Family("gemma3_text", (MT,), config, gemmalike.weights))
