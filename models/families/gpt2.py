"""GPT-2 (Radford et al. 2019): learned positions, LayerNorm, GELU (tanh), Conv1D weights [in, out]."""

from __future__ import annotations

from ..config import ModelConfig
from .registry import Family, TensorGetter, register, reject, require


def config(d: dict) -> ModelConfig:
    reject(
        d, "gpt2",
        scale_attn_by_inverse_layer_idx=bool,
        add_cross_attention=bool,
    )
    n_embd, n_head = require(d, "n_embd", "gpt2"), require(d, "n_head", "gpt2")
    return ModelConfig(
        n_layers=require(d, "n_layer", "gpt2"),
        d_model=n_embd,
        n_heads=n_head,
        d_vocab=require(d, "vocab_size", "gpt2"),
        n_ctx=require(d, "n_positions", "gpt2"),
        d_mlp=d.get("n_inner") or 4 * n_embd,
        act_fn=d.get("activation_function", "gelu_new"),
        normalization="layernorm",
        norm_eps=d.get("layer_norm_epsilon", 1e-5),
        positional="learned",
        tie_embeddings=d.get("tie_word_embeddings", True),
        attn_scale=None if d.get("scale_attn_weights", True) else 1.0,
        model_type="gpt2",
    )


def weights(cfg: ModelConfig, get: TensorGetter) -> dict:
    sd = {"embed.W_E": get("transformer.wte.weight"), "pos_embed.W_pos": get("transformer.wpe.weight")}
    for l in range(cfg.n_layers):
        p, o = f"transformer.h.{l}.", f"blocks.{l}."
        sd |= {
            o + "ln1.w": get(p + "ln_1.weight"), o + "ln1.b": get(p + "ln_1.bias"),
            o + "attn.W_qkv": get(p + "attn.c_attn.weight"), o + "attn.b_qkv": get(p + "attn.c_attn.bias"),
            o + "attn.W_O_flat": get(p + "attn.c_proj.weight"), o + "attn.b_O": get(p + "attn.c_proj.bias"),
            o + "ln2.w": get(p + "ln_2.weight"), o + "ln2.b": get(p + "ln_2.bias"),
            o + "mlp.W_in": get(p + "mlp.c_fc.weight"), o + "mlp.b_in": get(p + "mlp.c_fc.bias"),
            o + "mlp.W_out": get(p + "mlp.c_proj.weight"), o + "mlp.b_out": get(p + "mlp.c_proj.bias"),
        }
    sd |= {"ln_final.w": get("transformer.ln_f.weight"), "ln_final.b": get("transformer.ln_f.bias")}
    if not cfg.tie_embeddings:
        sd["unembed.W_U"] = get("lm_head.weight").T.contiguous()
    return sd


register(Family("gpt2", ("gpt2",), config, weights))
