"""OLMo 2 (OLMo Team 2024; Hugging Face `model_type` "olmo2"): a Llama-like model (RMSNorm, SwiGLU,
rotary, GQA, no biases) whose norms sit only AFTER attention and MLP (x + ln1_post(attn(x)), then
x + ln2_post(mlp(x)): `pre_norms=False` with sandwich norms; TransformerLens's names), and whose
QK-norm is one RMSNorm over the whole query projection (n_heads * d_head) and one over the whole key
projection (kv_heads * d_head), before RoPE (`qk_norm_over="projection"`), not one per head.

Defaults for absent keys are Hugging Face's (`Olmo2Config`). What this model cannot represent raises,
naming the key.
"""

from __future__ import annotations

import functools

from ..config import ModelConfig
from .builders import llama_layer, llama_weights, reject, require, rms_decoder, rotary_from_hf
from .registry import Family, register

MT = "olmo2"


def config(d: dict) -> ModelConfig:
    reject(d, MT, attention_bias=bool)
    d_model, n_heads = require(d, "hidden_size", MT), require(d, "num_attention_heads", MT)
    head_dim = d_model // n_heads  # Olmo2Attention: the config's head_dim, which Olmo2Config does not have
    if d.get("head_dim") not in (None, head_dim):
        raise NotImplementedError(f"{MT} config sets head_dim={d['head_dim']!r}; interp supports hidden_size // "
                                  "num_attention_heads")
    n_ctx = d.get("max_position_embeddings", 2048)
    rotary = rotary_from_hf(d, head_dim, n_ctx)
    if rotary["rotary_dim"] != head_dim:
        raise NotImplementedError(f"{MT} config asks for partial rotary; interp supports rotary over the whole head")
    return rms_decoder(d, MT, head_dim=head_dim, n_ctx=n_ctx,
        act_fn=d.get("hidden_act", "silu"),
        norm_eps=d.get("rms_norm_eps", 1e-5),
        **rotary,
        qk_norm=True,
        qk_norm_over="projection",
        sandwich_norms=True,
        pre_norms=False,
        qkv_bias=False,
        attn_out_bias=False,
        mlp_bias=False,
    )


# Norms only after attention and the MLP; QK-norm (`cfg.qk_norm`) read by the Llama-style attention.
weights = functools.partial(llama_weights, layer=functools.partial(
    llama_layer, block_norms={"ln1_post": "post_attention_layernorm", "ln2_post": "post_feedforward_layernorm"}))


register(Family("olmo2", (MT,), config, weights))
