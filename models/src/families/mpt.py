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
from .builders import TensorGetter, decoder, layernorm_decoder, linears, norms, reject, require
from .registry import Family, register

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
    return layernorm_decoder(
        d, MT, sizes=dict(n_layers="n_layers", n_heads="n_heads", d_vocab="vocab_size"), d_model=d_model,
        n_ctx=d.get("max_seq_len", 2048), d_mlp=int(d.get("expansion_ratio", 4) * d_model), act_fn="gelu",
        norm_eps=d.get("layer_norm_epsilon", 1e-5), positional="alibi", qkv_bias=False, attn_out_bias=False,
        mlp_bias=False,
        attn_scale=attn.get("softmax_scale"),  # None: 1/sqrt(d_head)
        prepend_bos=False,  # TransformerLens's MPT adapter: no BOS
    )


def _layer(cfg: ModelConfig, get: TensorGetter, p: str, o: str) -> dict:
    zero = {o + "ln1.b": torch.zeros(cfg.d_model), o + "ln2.b": torch.zeros(cfg.d_model)}  # MPT's norms have no bias
    names = {"attn.qkv": "attn.Wqkv", "attn.O": "attn.out_proj", "mlp.in": "ffn.up_proj", "mlp.out": "ffn.down_proj"}
    return norms(get, o, p, {"ln1": "norm_1", "ln2": "norm_2"}) | zero | linears(get, o, p, names)


def weights(cfg: ModelConfig, get: TensorGetter) -> dict:
    final = norms(get, "", "transformer.", {"ln_final": "norm_f"}) | {"ln_final.b": torch.zeros(cfg.d_model)}
    return decoder(cfg, get, embed={"embed.W_E": get("transformer.wte.weight")}, layers="transformer.blocks.",
                   layer=_layer, final=final)


register(Family("mpt", (MT,), config, weights))
