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

from typing import TYPE_CHECKING

from ..config import ModelConfig
from . import gemmalike
from .builders import reject, require, rotary_from_hf
from .gguf_layout import RMS_KEYS, GGUFLayout
from .registry import Family, register

if TYPE_CHECKING:
    from ..formats.gguf_layouts import Metadata

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


# ---- GGUF: how llama.cpp writes Gemma 2 ----
_GGUF_KEYS = RMS_KEYS - {"rope.scaling.type"} | {"attention.sliding_window", "attn_logit_softcapping",
                                                     "final_logit_softcapping"}


def _gguf_config(meta: Metadata, base: dict, names: set) -> dict:
    """Gemma 2's keys. llama.cpp fixes what the file leaves out: even layers local (sliding), odd ones
    global; one RoPE base (1e4 unless rope.freq_base says); query scale d_head ** -0.5 (d_model / n_heads
    for the 46-layer 27B); GELU (tanh); soft caps 50 on scores and 30 on logits unless the file says."""
    n_layers, d_model, n_heads = base["num_hidden_layers"], base["hidden_size"], base["num_attention_heads"]
    return {
        "layer_types": ["sliding_attention" if l % 2 == 0 else "full_attention" for l in range(n_layers)],
        "sliding_window": meta.count("attention.sliding_window", 4096),
        "rope_parameters": {"rope_type": "default", "rope_theta": meta.real("rope.freq_base", 10_000.0)},
        "attn_logit_softcapping": meta.real("attn_logit_softcapping", 50.0),
        "final_logit_softcapping": meta.real("final_logit_softcapping", 30.0),
        "query_pre_attn_scalar": d_model // n_heads if n_layers == 46 else base["head_dim"],
        "hidden_activation": "gelu_pytorch_tanh",
    }


_GGUF = GGUFLayout(MT, _gguf_config, gemmalike.GGUF_NAMES, permuted_qk=False, norm_shift=1.0, known_keys=_GGUF_KEYS,
                   ignored=())


register(Family("gemma2", (MT,), config, gemmalike.weights, gguf={"gemma2": _GGUF}))
