"""Falcon (Almazrouei et al. 2023; Hugging Face `model_type` "falcon"): rotary, LayerNorm, GELU, one
fused `query_key_value` projection, `bias` on every projection or none, tied unembedding. Three
layouts of the fused projection and the norms:

- Falcon-7B style (`multi_query`): one KV head; rows [q_1 .. q_h, k, v]; attention and MLP in
  parallel off ONE shared `input_layernorm` (our ln1 and ln2 hold the same weights).
- Falcon-40B style (`new_decoder_architecture`): `num_kv_heads` grouped KV heads; rows laid out per
  KV group [q_1 .. q_g, k, v] (g = n_heads / num_kv_heads), always parallel, with two input norms
  `ln_attn` / `ln_mlp` (`num_ln_in_parallel_attn` 2, the default) or one shared (1).
- neither: multi-head, rows per head [q, k, v] (as GPT-NeoX); `parallel_attn=False` runs attention
  then the MLP, each after its own norm (`input_layernorm`, `post_attention_layernorm`).

Refused, in one line: `alibi=True` (Falcon scales its ALiBi bias by 1/sqrt(d_head) with the scores,
unlike ours). Hugging Face's Falcon does not use transformers' attention interface, so this family is
how it runs on our backends.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from ..config import ModelConfig
from .builders import TensorGetter, decoder, grouped_qkv_weights, linears, norms, reject, require, rotary_from_hf
from .gguf_layout import LAYERNORM_KEYS, GGUFLayout, weight_and_bias
from .registry import Family, register

if TYPE_CHECKING:
    from ..formats.gguf_layouts import Metadata

MT = "falcon"
_ACTIVATIONS = {"gelu": "gelu", "gelu_new": "gelu_new", "gelu_pytorch_tanh": "gelu_new", "relu": "relu", "silu": "silu"}


def _get(d: dict, key: str, legacy: str):
    """A size under its name or its older Falcon name (n_head, n_layer)."""
    return d[key] if d.get(key) is not None else require(d, legacy, MT)


def _norms(d: dict) -> str:
    """How a block normalises: "two" (ln_attn, ln_mlp), "shared" (input_layernorm for both, parallel) or
    "sequential" (input_layernorm, then post_attention_layernorm), as FalconDecoderLayer builds them."""
    new, parallel = bool(d.get("new_decoder_architecture")), d.get("parallel_attn", True) is not False
    n_ln = d.get("num_ln_in_parallel_attn") or (2 if new else 1)
    if not parallel:
        if new:  # transformers' FalconDecoderLayer cannot run this either (it always adds the MLP in parallel)
            raise NotImplementedError(f"{MT} config sets new_decoder_architecture with parallel_attn=False, which "
                                      "interp does not support")
        return "sequential"
    if n_ln == 2 and not new:
        raise NotImplementedError(f"{MT} config sets num_ln_in_parallel_attn=2 without new_decoder_architecture, "
                                  "which interp does not support")
    return "two" if n_ln == 2 else "shared"


def config(d: dict) -> ModelConfig:
    reject(d, MT, alibi=bool)  # Falcon's ALiBi is scaled by 1/sqrt(d_head) along with the scores; ours is not
    d_model = d["hidden_size"] if d.get("hidden_size") is not None else require(d, "n_embed", MT)
    n_heads = _get(d, "num_attention_heads", "n_head")
    if d.get("new_decoder_architecture"):
        n_kv = d.get("num_kv_heads") or n_heads
    elif d.get("multi_query", True):
        n_kv = 1
    else:
        n_kv = n_heads
        if d.get("num_kv_heads") not in (None, n_heads):
            raise NotImplementedError(f"{MT} config sets num_kv_heads={d['num_kv_heads']} without new_decoder_architecture "
                                      "or multi_query, which interp does not support")
    act = d.get("activation", "gelu")
    if act not in _ACTIVATIONS:
        raise NotImplementedError(f"{MT} config sets activation={act!r}; interp supports {sorted(_ACTIVATIONS)}")
    n_ctx = d.get("max_position_embeddings", 2048)
    rotary = rotary_from_hf(d, d_model // n_heads, n_ctx)
    if rotary["rotary_dim"] != d_model // n_heads:
        raise NotImplementedError(f"{MT} config asks for partial rotary; Falcon rotates the whole head")
    bias = bool(d.get("bias", False))
    return ModelConfig(
        n_layers=_get(d, "num_hidden_layers", "n_layer"),
        d_model=d_model,
        n_heads=n_heads,
        n_kv_heads=n_kv,
        d_vocab=require(d, "vocab_size", MT),
        n_ctx=n_ctx,
        d_mlp=d.get("ffn_hidden_size") or 4 * d_model,
        act_fn=_ACTIVATIONS[act],
        normalization="layernorm",
        norm_eps=d.get("layer_norm_epsilon", 1e-5),
        positional="rotary",
        **rotary,
        parallel_attn_mlp=_norms(d) != "sequential",
        qkv_bias=bias,
        attn_out_bias=bias,
        mlp_bias=bias,
        tie_embeddings=bool(d.get("tie_word_embeddings", True)),
        model_type=MT,
    )


def _layer(cfg: ModelConfig, get: TensorGetter, p: str, o: str, *, block_norms: tuple[tuple[str, ...], ...]) -> dict:
    """One block: our ln1 and ln2 from `block_norms` (each the first of its names the checkpoint has), the fused
    projection laid out per KV group (per head when multi-head), `bias` on every projection or none."""
    sd = {}
    for ours, theirs in zip(("ln1", "ln2"), block_norms):
        for leaf, their_leaf in (("w", "weight"), ("b", "bias")):
            sd[f"{o}{ours}.{leaf}"] = get(*(f"{p}{n}.{their_leaf}" for n in theirs)).clone()
    dense = {"attn.O": "self_attention.dense", "mlp.in": "mlp.dense_h_to_4h", "mlp.out": "mlp.dense_4h_to_h"}
    return (sd | grouped_qkv_weights(cfg, get, o, p + "self_attention.query_key_value", bias=cfg.qkv_bias)
            | linears(get, o, p, dense, bias=cfg.qkv_bias))


def weights(cfg: ModelConfig, get: TensorGetter) -> dict:
    # Parallel blocks read `ln_attn` / `ln_mlp` where the checkpoint has two norms, else the one shared
    # `input_layernorm` as both our ln1 and ln2 (copies: each can be edited or folded on its own).
    if cfg.parallel_attn_mlp:
        block_norms = (("ln_attn", "input_layernorm"), ("ln_mlp", "input_layernorm"))
    else:
        block_norms = (("input_layernorm",), ("post_attention_layernorm",))
    return decoder(cfg, get, embed={"embed.W_E": get("transformer.word_embeddings.weight")}, layers="transformer.h.",
                   layer=functools.partial(_layer, block_norms=block_norms),
                   final=norms(get, "", "transformer.", {"ln_final": "ln_f"}, bias=True))


# ---- GGUF: how llama.cpp writes Falcon ----
def _gguf_names(config: dict) -> dict[str, str]:
    """Falcon's: attn_norm is the one shared input_layernorm (7B, 11B); with two norms (40B, 180B) llama.cpp
    runs attention off attn_norm_2 (ln_attn) and the MLP off attn_norm (ln_mlp)."""
    two = config.get("num_ln_in_parallel_attn") == 2
    return weight_and_bias({
        "attn_norm": "ln_mlp" if two else "input_layernorm", "attn_norm_2": "ln_attn",
        "attn_qkv": "self_attention.query_key_value", "attn_output": "self_attention.dense",
        "ffn_up": "mlp.dense_h_to_4h", "ffn_down": "mlp.dense_4h_to_h",
    })


_GGUF_GLOBALS = {"token_embd.weight": "transformer.word_embeddings.weight", "output.weight": "lm_head.weight",
                        **weight_and_bias({"output_norm": "transformer.ln_f"})}
_GGUF_KEYS = LAYERNORM_KEYS | {"tensor_data_layout", "rope.freq_base"}


def _gguf_config(meta: Metadata, base: dict, names: set) -> dict:
    """Falcon as llama.cpp's converter writes it (tensor_data_layout "jploski": the fused QKV's rows as
    [q | k | v], which the tensor transform puts back in Falcon's groups). Always the parallel block;
    head_count_kv 1 with one norm is Falcon-7B (multi_query); otherwise grouped KV heads
    (new_decoder_architecture) with one shared norm (Falcon-11B) or two (attn_norm_2: 40B, 180B)."""
    data_layout = meta.get("tensor_data_layout")
    if data_layout not in (None, "jploski"):
        raise NotImplementedError(f"{meta.source}: falcon.tensor_data_layout = {data_layout!r} is not supported "
                                  "(llama.cpp's 'jploski' is)")
    d_model, n_heads = meta.count("embedding_length"), meta.count("attention.head_count")
    n_kv = meta.count("attention.head_count_kv", 1)
    two_norms = "blk.0.attn_norm_2.weight" in names
    config = {
        "hidden_size": d_model,
        "num_attention_heads": n_heads,
        "num_hidden_layers": meta.count("block_count"),
        "vocab_size": meta.vocab_size(),
        "max_position_embeddings": meta.count("context_length", 2048),
        "layer_norm_epsilon": meta.real("attention.layer_norm_epsilon"),
        "ffn_hidden_size": meta.count("feed_forward_length", 4 * d_model),
        "rope_theta": meta.real("rope.freq_base", 10000.0),
        "alibi": False,
        "bias": "blk.0.attn_qkv.bias" in names,
        "parallel_attn": True,
        "tie_word_embeddings": "output.weight" not in names,
    }
    if n_kv == 1 and not two_norms:
        return config | {"multi_query": True, "new_decoder_architecture": False}
    return config | {"multi_query": False, "new_decoder_architecture": True, "num_kv_heads": n_kv,
                     "num_ln_in_parallel_attn": 2 if two_norms else 1}


def _gguf_qkv(x: Tensor, config: dict) -> Tensor:
    """[q | k | v] rows (llama.cpp's "jploski" layout) back to Falcon's groups: per KV head, its
    n_heads / n_kv query heads, then its key, then its value."""
    h = config["num_attention_heads"]
    kv = 1 if config["multi_query"] else config["num_kv_heads"]
    dh = config["hidden_size"] // h
    rest = x.shape[1:]
    q, k, v = x.split([h * dh, kv * dh, kv * dh])
    parts = (q.reshape(kv, h // kv * dh, *rest), k.reshape(kv, dh, *rest), v.reshape(kv, dh, *rest))
    return torch.cat(parts, dim=1).reshape(x.shape)


_GGUF = GGUFLayout(MT, _gguf_config, _gguf_names, permuted_qk=False, known_keys=_GGUF_KEYS, prefix="transformer.h.",
                   global_names=_GGUF_GLOBALS, ignored=(), common=False,
                   transforms={"attn_qkv.weight": _gguf_qkv, "attn_qkv.bias": _gguf_qkv})


register(Family("falcon", (MT,), config, weights, gguf={"falcon": _GGUF}))
