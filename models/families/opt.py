"""OPT (Zhang et al. 2022; Hugging Face `model_type` "opt"): pre-LN blocks with LayerNorm, ReLU MLP,
biases everywhere (`enable_bias`), tied unembedding, and learned positions stored with an offset of 2
(fairseq's padding convention): position p reads row p + 2 of `embed_positions`, so our W_pos is that
table without its first two rows. Hugging Face derives the positions from the attention mask (real
tokens count 0, 1, 2, ...), as our forward does, so left-padded rows get the positions they would alone.

Refused, each in one line: opt-350m's post-LN blocks (`do_layer_norm_before=False`), the projections
between a narrower embedding and the residual stream (`word_embed_proj_dim != hidden_size`:
project_in / project_out), `_remove_final_layer_norm` and norms without weights
(`layer_norm_elementwise_affine=False`).
"""

from __future__ import annotations

import torch

from ..config import ModelConfig
from .registry import Family, TensorGetter, qkv, register, reject, require, t

MT = "opt"
OFFSET = 2  # OPTLearnedPositionalEmbedding's offset
_ACTIVATIONS = {"relu": "relu", "gelu": "gelu", "gelu_new": "gelu_new", "silu": "silu", "gelu_pytorch_tanh": "gelu_new"}


def config(d: dict) -> ModelConfig:
    d_model = require(d, "hidden_size", MT)
    reject(d, MT, do_layer_norm_before=lambda v: v is False, _remove_final_layer_norm=bool,
           word_embed_proj_dim=lambda v: v != d_model, layer_norm_elementwise_affine=lambda v: v is False)
    act = d.get("activation_function", "relu")
    if act not in _ACTIVATIONS:
        raise NotImplementedError(f"{MT} config sets activation_function={act!r}; interp supports {sorted(_ACTIVATIONS)}")
    bias = bool(d.get("enable_bias", True))
    return ModelConfig(
        n_layers=require(d, "num_hidden_layers", MT),
        d_model=d_model,
        n_heads=require(d, "num_attention_heads", MT),
        d_vocab=require(d, "vocab_size", MT),
        n_ctx=d.get("max_position_embeddings", 2048),
        d_mlp=require(d, "ffn_dim", MT),
        act_fn=_ACTIVATIONS[act],
        normalization="layernorm",
        norm_eps=1e-5,  # nn.LayerNorm's default; OPT's config has no eps
        positional="learned",
        qkv_bias=bias,
        attn_out_bias=bias,
        mlp_bias=bias,
        tie_embeddings=bool(d.get("tie_word_embeddings", True)),
        model_type=MT,
    )


def _norm(get: TensorGetter, ours: str, name: str) -> dict:
    return {ours + ".w": get(name + ".weight"), ours + ".b": get(name + ".bias")}


def weights(cfg: ModelConfig, get: TensorGetter) -> dict:
    sd = {"embed.W_E": get("model.decoder.embed_tokens.weight"),
          "pos_embed.W_pos": get("model.decoder.embed_positions.weight")[OFFSET:]}
    for l in range(cfg.n_layers):
        p, o = f"model.decoder.layers.{l}.", f"blocks.{l}."
        a = p + "self_attn."
        sd |= _norm(get, o + "ln1", p + "self_attn_layer_norm") | _norm(get, o + "ln2", p + "final_layer_norm")
        sd |= {
            o + "attn.W_qkv": qkv(get(a + "q_proj.weight"), get(a + "k_proj.weight"), get(a + "v_proj.weight")),
            o + "attn.W_O_flat": t(get(a + "out_proj.weight")),
            o + "mlp.W_in": t(get(p + "fc1.weight")),
            o + "mlp.W_out": t(get(p + "fc2.weight")),
        }
        if cfg.qkv_bias:
            sd[o + "attn.b_qkv"] = torch.cat([get(a + "q_proj.bias"), get(a + "k_proj.bias"), get(a + "v_proj.bias")])
            sd[o + "attn.b_O"] = get(a + "out_proj.bias")
            sd |= {o + "mlp.b_in": get(p + "fc1.bias"), o + "mlp.b_out": get(p + "fc2.bias")}
    sd |= _norm(get, "ln_final", "model.decoder.final_layer_norm")
    if not cfg.tie_embeddings:
        sd["unembed.W_U"] = t(get("lm_head.weight"))
    return sd


register(Family("opt", (MT,), config, weights))
