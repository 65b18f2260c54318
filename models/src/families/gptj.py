"""GPT-J (Wang & Komatsuzaki 2021; Hugging Face `model_type` "gptj"): a parallel block with ONE LayerNorm
(x + attn(ln_1(x)) + mlp(ln_1(x)); our ln1 and ln2 both hold ln_1's weights, so TransformerLens's views
and weight folding see the usual two); partial rotary over the first `rotary_dim` dimensions of each
head in adjacent pairs ("rotate every two"); q, k, v and out projections without bias, an MLP with
bias; an untied unembedding with a bias.

Defaults for absent keys are Hugging Face's (`GPTJConfig`). What this model cannot represent raises,
naming the key.
"""

from __future__ import annotations

from ..config import ModelConfig
from .builders import TensorGetter, decoder, linears, norms, reject, require, split_qkv
from .registry import Family, register

MT = "gptj"


def config(d: dict) -> ModelConfig:
    reject(d, MT, tie_word_embeddings=bool, add_cross_attention=bool)
    n_embd, n_head = require(d, "n_embd", MT), require(d, "n_head", MT)
    rotary_dim = d.get("rotary_dim", 64)
    if rotary_dim is None:  # Hugging Face would rotate the whole hidden size per head (it cannot run)
        raise NotImplementedError(f"{MT} config sets rotary_dim=None, which interp does not support; set rotary_dim")
    return ModelConfig(
        n_layers=require(d, "n_layer", MT),
        d_model=n_embd,
        n_heads=n_head,
        d_vocab=require(d, "vocab_size", MT),
        n_ctx=d.get("n_positions", 2048),
        d_mlp=d.get("n_inner") or 4 * n_embd,
        act_fn=d.get("activation_function", "gelu_new"),
        normalization="layernorm",
        norm_eps=d.get("layer_norm_epsilon", 1e-5),
        positional="rotary",
        rotary_dim=int(rotary_dim),
        rotary_adjacent_pairs=True,
        parallel_attn_mlp=True,
        qkv_bias=False,
        attn_out_bias=False,
        mlp_bias=True,
        unembed_bias=True,
        tie_embeddings=False,
        model_type=MT,
    )


def _layer(cfg: ModelConfig, get: TensorGetter, p: str, o: str) -> dict:
    ln = norms(get, o, p, {"ln1": "ln_1"}, bias=True)
    ln |= {o + "ln2.w": ln[o + "ln1.w"].clone(), o + "ln2.b": ln[o + "ln1.b"].clone()}  # the one ln_1, twice
    mlp = linears(get, o, p, {"mlp.in": "mlp.fc_in", "mlp.out": "mlp.fc_out"}, bias=True)
    return ln | split_qkv(get, o, p + "attn.", bias=False) | linears(get, o, p, {"attn.O": "attn.out_proj"}) | mlp


def weights(cfg: ModelConfig, get: TensorGetter) -> dict:
    final = norms(get, "", "transformer.", {"ln_final": "ln_f"}, bias=True) | {"unembed.b_U": get("lm_head.bias")}
    return decoder(cfg, get, embed={"embed.W_E": get("transformer.wte.weight")}, layers="transformer.h.",
                   layer=_layer, final=final)


register(Family("gptj", (MT,), config, weights))
