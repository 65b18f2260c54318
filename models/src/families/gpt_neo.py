"""GPT-Neo (Black et al. 2021; Hugging Face `model_type` "gpt_neo"): GPT-2's block (learned positions,
LayerNorm, GELU) with global and local layers alternating (`attention_types`, e.g. [[["global",
"local"], 12]]): a local layer sees the last `window_size` keys (our "sliding" layers, `layer_types`).
Attention scores are NOT scaled by 1 / sqrt(d_head) (attn_scale = 1). Separate q / k / v projections
without bias; the output projection and the MLP have biases; tied unembedding.

Hugging Face's GPT-Neo does not use transformers' attention interface, so a registered attention
function never reaches it there: this family is how it runs on our backends.
"""

from __future__ import annotations

from ..config import ModelConfig
from .builders import TensorGetter, decoder, linears, norms, require, split_qkv
from .registry import Family, register

MT = "gpt_neo"
_KINDS = {"global": "full", "local": "sliding"}
_ACTIVATIONS = {"gelu_new": "gelu_new", "gelu": "gelu", "gelu_fast": "gelu_fast", "relu": "relu", "silu": "silu",
                "gelu_pytorch_tanh": "gelu_new"}


def _layer_kinds(d: dict) -> list[str]:
    """`attention_types` expanded as Hugging Face does: [[kinds, n], ...] -> kinds repeated n times, in order."""
    types = d.get("attention_types") or [[["global", "local"], 12]]
    kinds = [k for group, n in types for _ in range(n) for k in group]
    unknown = sorted(set(kinds) - set(_KINDS))
    if unknown:
        raise NotImplementedError(f"{MT} config sets attention_types with {unknown}; interp knows {sorted(_KINDS)}")
    return kinds


def config(d: dict) -> ModelConfig:
    n_layers, d_model = require(d, "num_layers", MT), require(d, "hidden_size", MT)
    kinds = _layer_kinds(d)
    if len(kinds) != n_layers:
        raise ValueError(f"{MT} config's attention_types give {len(kinds)} layers for num_layers={n_layers}")
    act = d.get("activation_function", "gelu_new")
    if act not in _ACTIVATIONS:
        raise NotImplementedError(f"{MT} config sets activation_function={act!r}; interp supports {sorted(_ACTIVATIONS)}")
    local = "local" in kinds
    return ModelConfig(
        n_layers=n_layers,
        d_model=d_model,
        n_heads=require(d, "num_heads", MT),
        d_vocab=require(d, "vocab_size", MT),
        n_ctx=d.get("max_position_embeddings", 2048),
        d_mlp=d.get("intermediate_size") or 4 * d_model,
        act_fn=_ACTIVATIONS[act],
        normalization="layernorm",
        norm_eps=d.get("layer_norm_epsilon", 1e-5),
        positional="learned",
        sliding_window=int(d.get("window_size", 256)) if local else None,
        layer_types=tuple(_KINDS[k] for k in kinds) if local else None,
        qkv_bias=False,
        attn_out_bias=True,
        mlp_bias=True,
        tie_embeddings=bool(d.get("tie_word_embeddings", True)),
        attn_scale=1.0,  # GPT-Neo never divides its scores by sqrt(d_head)
        model_type=MT,
    )


def _layer(cfg: ModelConfig, get: TensorGetter, p: str, o: str) -> dict:
    a = p + "attn.attention."
    mlp = linears(get, o, p, {"attn.O": "attn.attention.out_proj", "mlp.in": "mlp.c_fc", "mlp.out": "mlp.c_proj"}, bias=True)
    return norms(get, o, p, {"ln1": "ln_1", "ln2": "ln_2"}, bias=True) | split_qkv(get, o, a, bias=False) | mlp


def weights(cfg: ModelConfig, get: TensorGetter) -> dict:
    embed = {"embed.W_E": get("transformer.wte.weight"), "pos_embed.W_pos": get("transformer.wpe.weight")}
    return decoder(cfg, get, embed=embed, layers="transformer.h.", layer=_layer,
                   final=norms(get, "", "transformer.", {"ln_final": "ln_f"}, bias=True))


register(Family("gpt_neo", (MT,), config, weights))
