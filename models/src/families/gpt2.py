"""GPT-2 (Radford et al. 2019): learned positions, LayerNorm, GELU (tanh), Conv1D weights [in, out]."""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import Tensor

from ..config import ModelConfig
from .builders import TensorGetter, decoder, linears, norms, reject, require
from .gguf_layout import LAYERNORM_KEYS, GGUFLayout, same_heads_and_width, weight_and_bias
from .registry import Family, register

if TYPE_CHECKING:
    from ..formats.gguf_layouts import Metadata


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


# ---- GGUF: how llama.cpp writes GPT-2 (LayerNorms and projections with biases, under `transformer.h.{l}.`) ----
_GGUF_NAMES = weight_and_bias({
    "attn_norm": "ln_1", "attn_qkv": "attn.c_attn", "attn_output": "attn.c_proj",
    "ffn_norm": "ln_2", "ffn_up": "mlp.c_fc", "ffn_down": "mlp.c_proj",
})
_GGUF_GLOBALS = {"token_embd.weight": "transformer.wte.weight", "position_embd.weight": "transformer.wpe.weight",
                      "output.weight": "lm_head.weight", **weight_and_bias({"output_norm": "transformer.ln_f"})}


def _gguf_config(meta: Metadata, base: dict, names: set) -> dict:
    """GPT-2: learned positions (one row per context_length position), the MLP width as written."""
    d_model, n_heads = meta.count("embedding_length"), meta.count("attention.head_count")
    same_heads_and_width(meta, d_model, n_heads, None)
    return {
        "n_layer": meta.count("block_count"),
        "n_embd": d_model,
        "n_head": n_heads,
        "n_inner": meta.count("feed_forward_length", 4 * d_model),
        "n_positions": meta.count("context_length"),
        "vocab_size": meta.vocab_size(),
        "layer_norm_epsilon": meta.real("attention.layer_norm_epsilon"),
        "tie_word_embeddings": "output.weight" not in names,
    }


def _gguf_conv1d(x: Tensor, config: dict) -> Tensor:
    """llama.cpp stores GPT-2's Conv1D weights [in, out] transposed, as Linear weights [out, in]."""
    return x.T


_GGUF = GGUFLayout("gpt2", _gguf_config, _GGUF_NAMES, permuted_qk=False, known_keys=LAYERNORM_KEYS,
                   prefix="transformer.h.", global_names=_GGUF_GLOBALS, ignored=(), common=False,
                   transforms={f"{n}.weight": _gguf_conv1d for n in ("attn_qkv", "attn_output", "ffn_up", "ffn_down")})


register(Family("gpt2", ("gpt2",), config, weights, gguf={"gpt2": _GGUF}))
