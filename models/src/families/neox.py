"""GPT-NeoX / Pythia (Black et al. 2022; Biderman et al. 2023): partial rotary, parallel residual,
per-head interleaved fused QKV ([head, (q, k, v), d_head] rows), untied unembedding."""

from __future__ import annotations

from ..config import ModelConfig
from .builders import TensorGetter, decoder, grouped_qkv_weights, linears, norms, reject, require, rotary_from_hf
from .registry import Family, register


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


def _layer(cfg: ModelConfig, get: TensorGetter, p: str, o: str) -> dict:
    dense = {"attn.O": "attention.dense", "mlp.in": "mlp.dense_h_to_4h", "mlp.out": "mlp.dense_4h_to_h"}
    return (norms(get, o, p, {"ln1": "input_layernorm", "ln2": "post_attention_layernorm"}, bias=True)
            | grouped_qkv_weights(cfg, get, o, p + "attention.query_key_value", bias=True)
            | linears(get, o, p, dense, bias=True))


def weights(cfg: ModelConfig, get: TensorGetter) -> dict:
    return decoder(cfg, get, embed={"embed.W_E": get("gpt_neox.embed_in.weight")}, layers="gpt_neox.layers.",
                   layer=_layer, final=norms(get, "", "gpt_neox.", {"ln_final": "final_layer_norm"}, bias=True),
                   head=("embed_out.weight", "lm_head.weight"))


register(Family("gpt_neox", ("gpt_neox",), config, weights))
