"""GPT-NeoX / Pythia (Black et al. 2022; Biderman et al. 2023): partial rotary, parallel residual,
per-head interleaved fused QKV ([head, (q, k, v), d_head] rows), untied unembedding."""

from __future__ import annotations

import torch

from ..config import ModelConfig
from .registry import Family, TensorGetter, register, reject, require, rotary_from_hf, t


def config(d: dict) -> ModelConfig:
    mt = "gpt_neox"
    reject(d, mt, attention_bias=lambda v: v is False)
    d_model, n_heads = require(d, "hidden_size", mt), require(d, "num_attention_heads", mt)
    n_ctx = d.get("max_position_embeddings", 2048)
    return ModelConfig(
        n_layers=require(d, "num_hidden_layers", mt),
        d_model=d_model,
        n_heads=n_heads,
        d_vocab=require(d, "vocab_size", mt),
        n_ctx=n_ctx,
        d_mlp=require(d, "intermediate_size", mt),
        act_fn=d.get("hidden_act", "gelu"),
        normalization="layernorm",
        norm_eps=d.get("layer_norm_eps", 1e-5),
        positional="rotary",
        **rotary_from_hf(d, d_model // n_heads, n_ctx),
        parallel_attn_mlp=d.get("use_parallel_residual", True),
        tie_embeddings=d.get("tie_word_embeddings", False),
        model_type=mt,
        prepend_bos=False,  # Pythia was trained without BOS; TransformerLens's NeoX adapter says so too
    )


def weights(cfg: ModelConfig, get: TensorGetter) -> dict:
    h, dh, d = cfg.n_heads, cfg.head_dim, cfg.d_model
    sd = {"embed.W_E": get("gpt_neox.embed_in.weight")}
    for l in range(cfg.n_layers):
        p, o = f"gpt_neox.layers.{l}.", f"blocks.{l}."
        w = get(p + "attention.query_key_value.weight").view(h, 3, dh, d)
        b = get(p + "attention.query_key_value.bias").view(h, 3, dh)
        sd |= {
            o + "ln1.w": get(p + "input_layernorm.weight"), o + "ln1.b": get(p + "input_layernorm.bias"),
            o + "attn.W_qkv": torch.cat([w[:, i].reshape(h * dh, d) for i in range(3)]).T.contiguous(),
            o + "attn.b_qkv": torch.cat([b[:, i].reshape(h * dh) for i in range(3)]),
            o + "attn.W_O_flat": t(get(p + "attention.dense.weight")), o + "attn.b_O": get(p + "attention.dense.bias"),
            o + "ln2.w": get(p + "post_attention_layernorm.weight"), o + "ln2.b": get(p + "post_attention_layernorm.bias"),
            o + "mlp.W_in": t(get(p + "mlp.dense_h_to_4h.weight")), o + "mlp.b_in": get(p + "mlp.dense_h_to_4h.bias"),
            o + "mlp.W_out": t(get(p + "mlp.dense_4h_to_h.weight")), o + "mlp.b_out": get(p + "mlp.dense_4h_to_h.bias"),
        }
    sd |= {"ln_final.w": get("gpt_neox.final_layer_norm.weight"), "ln_final.b": get("gpt_neox.final_layer_norm.bias")}
    if not cfg.tie_embeddings:
        sd["unembed.W_U"] = t(get("embed_out.weight", "lm_head.weight"))
    return sd


register(Family("gpt_neox", ("gpt_neox",), config, weights))
