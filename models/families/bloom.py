"""BLOOM (BigScience 2022; Hugging Face `model_type` "bloom"): ALiBi instead of positions (Press et al.
2022; Bloom's slopes, for any head count, are `positions.alibi_slopes`); a LayerNorm on the token
embeddings before the first block (`word_embeddings_layernorm`: our `embed_ln`, TransformerLens's
post_embedding_ln); a fused query_key_value laid out per head ([head, (q, k, v), d_head] rows); biases
everywhere; GELU's tanh approximation (Bloom's own formula: our "gelu_fast"); a tied unembedding.

Bloom adds slope * (key position) to its scores where we add -slope * (query - key position): per query
the two differ by a constant, which the softmax removes, so patterns and logits are the same (the
scores handed to hook_attn_scores differ by that constant). Transformers' Bloom does not go through its
attention interface, so only a native family like this one reaches it with our attention backends.

Defaults for absent keys are Hugging Face's (`BloomConfig`). What this model cannot represent raises,
naming the key.
"""

from __future__ import annotations

import torch

from ..config import ModelConfig
from .registry import Family, TensorGetter, register, reject, require, t

MT = "bloom"


def config(d: dict) -> ModelConfig:
    reject(d, MT, apply_residual_connection_post_layernorm=bool, tie_word_embeddings=lambda v: v is False)
    d_model = require(d, "hidden_size", MT) if "hidden_size" in d else require(d, "n_embed", MT)
    return ModelConfig(
        n_layers=require(d, "n_layer", MT),
        d_model=d_model,
        n_heads=require(d, "n_head", MT),
        d_vocab=require(d, "vocab_size", MT),
        n_ctx=d.get("seq_length") or 2048,  # ALiBi has no table; BLOOM trained on 2048 tokens
        d_mlp=4 * d_model,
        act_fn="gelu_fast",
        normalization="layernorm",
        norm_eps=d.get("layer_norm_epsilon", 1e-5),
        positional="alibi",
        post_embedding_ln=True,
        tie_embeddings=True,
        model_type=MT,
    )


def weights(cfg: ModelConfig, get: TensorGetter) -> dict:
    h, dh, d = cfg.n_heads, cfg.head_dim, cfg.d_model
    sd = {"embed.W_E": get("transformer.word_embeddings.weight"),
          "embed_ln.w": get("transformer.word_embeddings_layernorm.weight"),
          "embed_ln.b": get("transformer.word_embeddings_layernorm.bias")}
    for l in range(cfg.n_layers):
        p, o = f"transformer.h.{l}.", f"blocks.{l}."
        a, m = p + "self_attention.", p + "mlp."
        w = get(a + "query_key_value.weight").view(h, 3, dh, d)
        b = get(a + "query_key_value.bias").view(h, 3, dh)
        sd |= {
            o + "ln1.w": get(p + "input_layernorm.weight"), o + "ln1.b": get(p + "input_layernorm.bias"),
            o + "attn.W_qkv": torch.cat([w[:, i].reshape(h * dh, d) for i in range(3)]).T.contiguous(),
            o + "attn.b_qkv": torch.cat([b[:, i].reshape(h * dh) for i in range(3)]),
            o + "attn.W_O_flat": t(get(a + "dense.weight")), o + "attn.b_O": get(a + "dense.bias"),
            o + "ln2.w": get(p + "post_attention_layernorm.weight"), o + "ln2.b": get(p + "post_attention_layernorm.bias"),
            o + "mlp.W_in": t(get(m + "dense_h_to_4h.weight")), o + "mlp.b_in": get(m + "dense_h_to_4h.bias"),
            o + "mlp.W_out": t(get(m + "dense_4h_to_h.weight")), o + "mlp.b_out": get(m + "dense_4h_to_h.bias"),
        }
    sd |= {"ln_final.w": get("transformer.ln_f.weight"), "ln_final.b": get("transformer.ln_f.bias")}
    return sd


register(Family("bloom", (MT,), config, weights))
