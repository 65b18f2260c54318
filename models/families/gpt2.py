"""GPT-2 (Radford et al. 2019): learned positions, LayerNorm, GELU (tanh), Conv1D weights [in, out]."""

from __future__ import annotations

from ..config import ModelConfig
from .builders import TensorGetter, decoder, linears, norms, reject, require
from .registry import Family, register


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


def _layer(cfg: ModelConfig, get: TensorGetter, p: str, o: str) -> dict:
    conv1d = {"attn.qkv": "attn.c_attn", "attn.O": "attn.c_proj", "mlp.in": "mlp.c_fc", "mlp.out": "mlp.c_proj"}
    return norms(get, o, p, {"ln1": "ln_1", "ln2": "ln_2"}, bias=True) | linears(get, o, p, conv1d, bias=True, transpose=False)


def weights(cfg: ModelConfig, get: TensorGetter) -> dict:
    embed = {"embed.W_E": get("transformer.wte.weight"), "pos_embed.W_pos": get("transformer.wpe.weight")}
    return decoder(cfg, get, embed=embed, layers="transformer.h.", layer=_layer,
                   final=norms(get, "", "transformer.", {"ln_final": "ln_f"}, bias=True))


register(Family("gpt2", ("gpt2",), config, weights))
