"""MPT (MosaicML 2023; Hugging Face `model_type` "mpt"): ALiBi instead of position embeddings, LayerNorm
without biases, GELU (exact) MLP of `expansion_ratio` * d_model, no biases anywhere (`no_bias`), one
fused `Wqkv` projection (rows [q | k | v], our layout), scores scaled by `softmax_scale` (default
1/sqrt(d_head)), tied unembedding.

MPT's ALiBi slopes are 2^(-alibi_bias_max * i / n') for n' the head count rounded up to a power of two
(interleaved when n is not one); with alibi_bias_max = 8 these are exactly our slopes (Press et al.'s,
`positions.alibi_slopes`) for every head count; another alibi_bias_max is refused. MPT adds its bias
by key alone (j - last key), which differs from ours (-(p - j)) by a constant per query: the same
softmax. Refused, each in one line: `clip_qkv` (a clamp of the fused projection's output, which
transformers applies and interp does not), and what transformers' MPT ignores, so that its weights
would mean something else there: `qk_ln`, `prefix_lm`, `attn_uses_sequence_id`, `alibi=False`
(learned positions), multi-query attention, `logit_scale` and biases (`no_bias=False`). Hugging Face's MPT does not use transformers' attention interface,
so this family is how it runs on our backends.
"""

from __future__ import annotations

import torch

from ..config import ModelConfig
from .registry import Family, TensorGetter, register, reject, require, t

MT = "mpt"
_NORMS = ("layernorm", "low_precision_layernorm")  # the same LayerNorm in float32


def config(d: dict) -> ModelConfig:
    attn = dict(d.get("attn_config") or {})
    reject(d, MT, no_bias=lambda v: v is False, logit_scale=lambda v: True,
           norm_type=lambda v: v not in _NORMS)
    reject(attn, MT, clip_qkv=lambda v: True, qk_ln=bool, prefix_lm=bool, attn_uses_sequence_id=bool,
           alibi=lambda v: v is False, alibi_bias_max=lambda v: v != 8,
           attn_type=lambda v: v != "multihead_attention")
    d_model = require(d, "d_model", MT)
    return ModelConfig(
        n_layers=require(d, "n_layers", MT),
        d_model=d_model,
        n_heads=require(d, "n_heads", MT),
        d_vocab=require(d, "vocab_size", MT),
        n_ctx=d.get("max_seq_len", 2048),
        d_mlp=int(d.get("expansion_ratio", 4) * d_model),
        act_fn="gelu",
        normalization="layernorm",
        norm_eps=d.get("layer_norm_epsilon", 1e-5),
        positional="alibi",
        qkv_bias=False,
        attn_out_bias=False,
        mlp_bias=False,
        tie_embeddings=bool(d.get("tie_word_embeddings", True)),
        attn_scale=attn.get("softmax_scale"),  # None: 1/sqrt(d_head)
        model_type=MT,
        prepend_bos=False,  # TransformerLens's MPT adapter: no BOS
    )


def weights(cfg: ModelConfig, get: TensorGetter) -> dict:
    zeros = torch.zeros(cfg.d_model)  # MPT's norms have no bias
    sd = {"embed.W_E": get("transformer.wte.weight")}
    for l in range(cfg.n_layers):
        p, o = f"transformer.blocks.{l}.", f"blocks.{l}."
        sd |= {
            o + "ln1.w": get(p + "norm_1.weight"), o + "ln1.b": zeros.clone(),
            o + "attn.W_qkv": t(get(p + "attn.Wqkv.weight")),
            o + "attn.W_O_flat": t(get(p + "attn.out_proj.weight")),
            o + "ln2.w": get(p + "norm_2.weight"), o + "ln2.b": zeros.clone(),
            o + "mlp.W_in": t(get(p + "ffn.up_proj.weight")),
            o + "mlp.W_out": t(get(p + "ffn.down_proj.weight")),
        }
    sd |= {"ln_final.w": get("transformer.norm_f.weight"), "ln_final.b": zeros.clone()}
    if not cfg.tie_embeddings:
        sd["unembed.W_U"] = t(get("lm_head.weight"))
    return sd


register(Family("mpt", (MT,), config, weights))
