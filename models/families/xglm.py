"""XGLM (Lin et al. 2022; Hugging Face `model_type` "xglm"): fairseq's pre-LN decoder: LayerNorm, GELU,
biases everywhere, token embeddings scaled by sqrt(d_model) (`scale_embedding`), tied unembedding, and
fixed sinusoidal positions in fairseq's layout: row r is [sin(r w_0) .. sin(r w_{h-1}) | cos(r w_0) ..
cos(r w_{h-1})] with w_i = 10000^(-i / (h - 1)), h = d_model / 2 (a zero column when d_model is odd),
and position p reads row p + 2 (fairseq's padding offset), the row `pad_token_id` zeroed.

That table is not in the checkpoint (a buffer); the converter computes it and stores it as our
learned position table W_pos [n_ctx, d_model], so the forward, hooks and weight views are GPT-2's.
Refused, in one line: a `pad_token_id` >= 2 (whose zeroed row would be a real position) and
cross-attention. Hugging Face's XGLM does not use transformers' attention interface, so this family is
how it runs on our backends.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ..config import ModelConfig
from .registry import Family, TensorGetter, qkv, register, reject, require, t

MT = "xglm"
OFFSET = 2  # fairseq's: position p is row p + 2; rows 0 and 1 are never a position
_ACTIVATIONS = {"gelu": "gelu", "gelu_new": "gelu_new", "relu": "relu", "silu": "silu", "gelu_pytorch_tanh": "gelu_new"}


def position_table(n_ctx: int, d_model: int) -> Tensor:
    """fairseq's sinusoidal rows for positions 0 .. n_ctx - 1 (rows OFFSET .. OFFSET + n_ctx - 1 of its
    table), [n_ctx, d_model], float32 as transformers computes it."""
    half = d_model // 2
    step = math.log(10000) / (half - 1)
    freqs = torch.exp(torch.arange(half, dtype=torch.int64).float() * -step)
    angles = torch.arange(OFFSET, OFFSET + n_ctx, dtype=torch.int64).float()[:, None] * freqs[None, :]
    table = torch.cat([torch.sin(angles), torch.cos(angles)], dim=1)
    if d_model % 2:
        table = torch.cat([table, torch.zeros(n_ctx, 1)], dim=1)
    return table


def config(d: dict) -> ModelConfig:
    reject(d, MT, add_cross_attention=bool, pad_token_id=lambda v: v >= OFFSET)
    d_model = require(d, "d_model", MT)
    act = d.get("activation_function", "gelu")
    if act not in _ACTIVATIONS:
        raise NotImplementedError(f"{MT} config sets activation_function={act!r}; interp supports {sorted(_ACTIVATIONS)}")
    return ModelConfig(
        n_layers=require(d, "num_layers", MT),
        d_model=d_model,
        n_heads=require(d, "attention_heads", MT),
        d_vocab=require(d, "vocab_size", MT),
        n_ctx=d.get("max_position_embeddings", 2048),
        d_mlp=require(d, "ffn_dim", MT),
        act_fn=_ACTIVATIONS[act],
        normalization="layernorm",
        norm_eps=1e-5,  # nn.LayerNorm's default; XGLM's config has no eps
        positional="learned",  # the sinusoidal table, computed by `weights`
        tie_embeddings=bool(d.get("tie_word_embeddings", True)),
        embed_scale=math.sqrt(d_model) if d.get("scale_embedding", True) else None,
        model_type=MT,
    )


def weights(cfg: ModelConfig, get: TensorGetter) -> dict:
    sd = {"embed.W_E": get("model.embed_tokens.weight"), "pos_embed.W_pos": position_table(cfg.n_ctx, cfg.d_model)}
    for l in range(cfg.n_layers):
        p, o = f"model.layers.{l}.", f"blocks.{l}."
        a = p + "self_attn."
        sd |= {
            o + "ln1.w": get(p + "self_attn_layer_norm.weight"), o + "ln1.b": get(p + "self_attn_layer_norm.bias"),
            o + "attn.W_qkv": qkv(get(a + "q_proj.weight"), get(a + "k_proj.weight"), get(a + "v_proj.weight")),
            o + "attn.b_qkv": torch.cat([get(a + "q_proj.bias"), get(a + "k_proj.bias"), get(a + "v_proj.bias")]),
            o + "attn.W_O_flat": t(get(a + "out_proj.weight")), o + "attn.b_O": get(a + "out_proj.bias"),
            o + "ln2.w": get(p + "final_layer_norm.weight"), o + "ln2.b": get(p + "final_layer_norm.bias"),
            o + "mlp.W_in": t(get(p + "fc1.weight")), o + "mlp.b_in": get(p + "fc1.bias"),
            o + "mlp.W_out": t(get(p + "fc2.weight")), o + "mlp.b_out": get(p + "fc2.bias"),
        }
    sd |= {"ln_final.w": get("model.layer_norm.weight"), "ln_final.b": get("model.layer_norm.bias")}
    if not cfg.tie_embeddings:
        sd["unembed.W_U"] = t(get("lm_head.weight"))
    return sd


register(Family("xglm", (MT,), config, weights))
