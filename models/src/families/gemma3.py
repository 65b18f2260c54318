"""Gemma 3, text only (Gemma Team 2025; Hugging Face `model_type` "gemma3_text"): five sliding-window
("local") layers for each full ("global") one, each kind with its own RoPE base; QK-norm over each
head; and what every Gemma has (`gemmalike.py`: sandwich norms, GeGLU (tanh), embeddings scaled by
sqrt(d_model), (1 + w) norm weights, a tied unembedding, queries scaled by query_pre_attn_scalar ** -0.5).

Defaults for absent keys are Hugging Face's (`Gemma3TextConfig`): a config.json that transformers
loads is read the same way here. What this model cannot represent raises, naming the key.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from interp.errors import CheckpointError
from ..config import ModelConfig
from . import gemmalike
from .gemmalike import LAYER_TYPES as _LAYER_TYPES
from .builders import reject, require, rotary_from_hf
from .gguf_layout import GGUFLayout
from .registry import Family, register

if TYPE_CHECKING:
    from ..formats.gguf_layouts import Metadata

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


# ---- GGUF: how llama.cpp writes Gemma 3 ----
_GGUF_KEYS = frozenset({
    "context_length", "embedding_length", "block_count", "feed_forward_length", "vocab_size",
    "attention.head_count", "attention.head_count_kv", "attention.key_length", "attention.value_length",
    "attention.layer_norm_rms_epsilon", "attention.sliding_window", "attention.sliding_window_pattern",
    "rope.freq_base", "rope.freq_base_swa", "rope.dimension_count", "rope.scaling.type", "rope.scaling.factor",
})


def _gguf_config(meta: Metadata, base: dict, names: set) -> dict:
    """Gemma 3's keys. llama.cpp fixes what the file leaves out, and so does transformers' Gemma3TextConfig:
    a global layer every 6th, local RoPE base 1e4 unscaled, query scale d_head ** -0.5 (d_model / n_heads
    for the 62-layer 27B, as llama.cpp has it), GELU (tanh), no soft-capping."""
    source, n_layers = meta.source, base["num_hidden_layers"]
    pattern = meta.get("attention.sliding_window_pattern", 6)
    if isinstance(pattern, list):  # per layer, True for a sliding-window layer (llama.cpp's newer files)
        if len(pattern) != n_layers or not all(isinstance(p, (bool, np.bool_)) for p in pattern):
            raise CheckpointError(f"{source}: gemma3.attention.sliding_window_pattern = {pattern!r} is not one flag "
                                  f"per layer ({n_layers}); the file is corrupt")
        sliding = [bool(p) for p in pattern]
    else:
        period = meta.count("attention.sliding_window_pattern", 6)
        sliding = [(l + 1) % period != 0 for l in range(n_layers)]
    full = {"rope_type": "default", "rope_theta": meta.real("rope.freq_base", 1_000_000.0)}
    scaling = meta.get("rope.scaling.type")
    if scaling == "linear":  # Gemma 3 4B-27B scale their global layers' RoPE by 8
        full |= {"rope_type": "linear", "factor": meta.real("rope.scaling.factor")}
    elif scaling not in (None, "none"):
        raise NotImplementedError(f"{source}: gemma3.rope.scaling.type = {scaling!r} is not supported (linear is)")
    window = meta.count("attention.sliding_window")
    d_model, n_heads = base["hidden_size"], base["num_attention_heads"]
    return {
        "layer_types": ["sliding_attention" if s else "full_attention" for s in sliding],
        "sliding_window": window,
        "rope_parameters": {
            "full_attention": full,
            "sliding_attention": {"rope_type": "default", "rope_theta": meta.real("rope.freq_base_swa", 10_000.0)},
        },
        "query_pre_attn_scalar": d_model // n_heads if n_layers == 62 else base["head_dim"],
        "hidden_activation": "gelu_pytorch_tanh",
    }


_GGUF = GGUFLayout(MT, _gguf_config, gemmalike.GGUF_NAMES | {"attn_q_norm.weight": "self_attn.q_norm.weight",
                                                               "attn_k_norm.weight": "self_attn.k_norm.weight"},
                   permuted_qk=False, norm_shift=1.0, known_keys=_GGUF_KEYS)


register(Family("gemma3_text", (MT,), config, gemmalike.weights, gguf={"gemma3": _GGUF}))
