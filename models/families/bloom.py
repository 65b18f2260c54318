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

from ..config import ModelConfig
from .builders import TensorGetter, decoder, grouped_qkv_weights, layernorm_decoder, linears, norms, reject, require
from .registry import Family, register

MT = "bloom"


def config(d: dict) -> ModelConfig:
    reject(d, MT, apply_residual_connection_post_layernorm=bool, tie_word_embeddings=lambda v: v is False)
    d_model = require(d, "hidden_size", MT) if "hidden_size" in d else require(d, "n_embed", MT)
    return layernorm_decoder(
        d, MT, sizes=dict(n_layers="n_layer", n_heads="n_head", d_vocab="vocab_size"), d_model=d_model,
        n_ctx=d.get("seq_length") or 2048,  # ALiBi has no table; BLOOM trained on 2048 tokens
        d_mlp=4 * d_model, act_fn="gelu_fast", norm_eps=d.get("layer_norm_epsilon", 1e-5), positional="alibi",
        post_embedding_ln=True, tie_embeddings=True,
    )


def _layer(cfg: ModelConfig, get: TensorGetter, p: str, o: str) -> dict:
    a = p + "self_attention."
    ln = norms(get, o, p, {"ln1": "input_layernorm", "ln2": "post_attention_layernorm"}, bias=True)
    mlp = linears(get, o, p + "mlp.", {"mlp.in": "dense_h_to_4h", "mlp.out": "dense_4h_to_h"}, bias=True)
    return ln | grouped_qkv_weights(cfg, get, o, a + "query_key_value", bias=True) | linears(get, o, a, {"attn.O": "dense"}, bias=True) | mlp


def weights(cfg: ModelConfig, get: TensorGetter) -> dict:
    embed = {"embed.W_E": get("transformer.word_embeddings.weight")}
    embed |= norms(get, "", "transformer.", {"embed_ln": "word_embeddings_layernorm"}, bias=True)
    return decoder(cfg, get, embed=embed, layers="transformer.h.", layer=_layer,
                   final=norms(get, "", "transformer.", {"ln_final": "ln_f"}, bias=True))


register(Family("bloom", (MT,), config, weights))
