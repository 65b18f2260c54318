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

from typing import TYPE_CHECKING

from torch import Tensor

from ..config import ModelConfig
from .builders import TensorGetter, decoder, grouped_qkv_weights, layernorm_decoder, linears, norms, reject, require
from .gguf_layout import LAYERNORM_KEYS, GGUFLayout, same_heads_and_width, weight_and_bias
from .registry import Family, register

if TYPE_CHECKING:
    from ..formats.gguf_layouts import Metadata

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


# ---- GGUF: how llama.cpp writes BLOOM (LayerNorms and projections with biases, under `transformer.h.{l}.`) ----
_GGUF_NAMES = weight_and_bias({
    "attn_norm": "input_layernorm", "attn_qkv": "self_attention.query_key_value",
    "attn_output": "self_attention.dense", "ffn_norm": "post_attention_layernorm",
    "ffn_up": "mlp.dense_h_to_4h", "ffn_down": "mlp.dense_4h_to_h",
})
_GGUF_GLOBALS = {"token_embd.weight": "transformer.word_embeddings.weight",
                       **weight_and_bias({"token_embd_norm": "transformer.word_embeddings_layernorm",
                                           "output_norm": "transformer.ln_f"})}


def _gguf_config(meta: Metadata, base: dict, names: set) -> dict:
    """BLOOM: ALiBi, so no RoPE keys; the MLP is 4 d_model and every head has its own key and value."""
    d_model, n_heads = meta.count("embedding_length"), meta.count("attention.head_count")
    same_heads_and_width(meta, d_model, n_heads, 4 * d_model)
    return {
        "n_layer": meta.count("block_count"),
        "hidden_size": d_model,
        "n_head": n_heads,
        "vocab_size": meta.vocab_size(),
        "layer_norm_epsilon": meta.real("attention.layer_norm_epsilon"),
        "seq_length": meta.count("context_length", 2048),
        "tie_word_embeddings": True,
    }


def _gguf_qkv(x: Tensor, config: dict) -> Tensor:
    """[q | k | v] rows (llama.cpp's converter) back to BLOOM's per-head [q, k, v] rows."""
    h = config["n_head"]
    return x.reshape(3, h, -1, *x.shape[1:]).transpose(0, 1).reshape(x.shape)


# BLOOM ties its unembedding; llama.cpp's converter writes a copy of the embedding as output.weight,
# which is not read (as transformers' GGUF loading does not): the tied embedding is the unembedding.
_GGUF = GGUFLayout(MT, _gguf_config, _GGUF_NAMES, permuted_qk=False, known_keys=LAYERNORM_KEYS, prefix="transformer.h.",
                   global_names=_GGUF_GLOBALS, ignored=("output.weight",), common=False,
                   transforms={"attn_qkv.weight": _gguf_qkv, "attn_qkv.bias": _gguf_qkv})


register(Family("bloom", (MT,), config, weights, gguf={"bloom": _GGUF}))
