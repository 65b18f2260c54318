"""XGLM (Lin et al. 2022; Hugging Face `model_type` "xglm"): fairseq's pre-LN decoder: LayerNorm, GELU,
biases everywhere, token embeddings scaled by sqrt(d_model) (`scale_embedding`), tied unembedding, and
fixed sinusoidal positions in fairseq's layout: row r is [sin(r w_0) .. sin(r w_{h-1}) | cos(r w_0) ..
cos(r w_{h-1})] with w_i = 10000^(-i / (h - 1)), h = d_model / 2 (a zero column when d_model is odd),
and position p reads row p + 2 (fairseq's padding offset), the row `pad_token_id` zeroed.

That table is not in the checkpoint (a buffer); the converter computes it and stores it as our
learned position table W_pos [n_ctx, d_model], so the forward, hooks and weight views are GPT-2's.
Refused, in one line: a `pad_token_id` >= 2 (whose zeroed row would be a real position) and
cross-attention. Hugging Face's XGLM does not use transformers' attention interface, so this family is
how it runs on our backends.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ..config import ModelConfig
from . import opt
from .builders import TensorGetter, decoder, layernorm_decoder, norms, reject, require
from .registry import Family, register

MT = "xglm"
OFFSET = 2  # fairseq's: position p is row p + 2; rows 0 and 1 are never a position
_ACTIVATIONS = {"gelu": "gelu", "gelu_new": "gelu_new", "relu": "relu", "silu": "silu", "gelu_pytorch_tanh": "gelu_new"}


def position_table(n_ctx: int, d_model: int) -> Tensor:
    """fairseq's sinusoidal rows for positions 0 .. n_ctx - 1 (rows OFFSET .. OFFSET + n_ctx - 1 of its
    table), [n_ctx, d_model], float32 as transformers computes it."""
    half = d_model // 2
    step = math.log(10000) / (half - 1)
    freqs = torch.exp(torch.arange(half, dtype=torch.int64).float() * -step)
    angles = torch.arange(OFFSET, OFFSET + n_ctx, dtype=torch.int64).float()[:, None] * freqs[None, :]
    table = torch.cat([torch.sin(angles), torch.cos(angles)], dim=1)
    if d_model % 2:
        table = torch.cat([table, torch.zeros(n_ctx, 1)], dim=1)
    return table


def config(d: dict) -> ModelConfig:
    reject(d, MT, add_cross_attention=bool, pad_token_id=lambda v: v >= OFFSET)
    d_model = require(d, "d_model", MT)
    act = d.get("activation_function", "gelu")
    if act not in _ACTIVATIONS:
        raise NotImplementedError(f"{MT} config sets activation_function={act!r}; interp supports {sorted(_ACTIVATIONS)}")
    sizes = dict(n_layers="num_layers", n_heads="attention_heads", d_vocab="vocab_size", d_mlp="ffn_dim")
    return layernorm_decoder(
        d, MT, sizes=sizes, d_model=d_model, n_ctx=d.get("max_position_embeddings", 2048), act_fn=_ACTIVATIONS[act],
        norm_eps=1e-5,  # nn.LayerNorm's default; XGLM's config has no eps
        positional="learned",  # the sinusoidal table, computed by `weights`
        embed_scale=math.sqrt(d_model) if d.get("scale_embedding", True) else None,
    )


def weights(cfg: ModelConfig, get: TensorGetter) -> dict:
    embed = {"embed.W_E": get("model.embed_tokens.weight"), "pos_embed.W_pos": position_table(cfg.n_ctx, cfg.d_model)}
    return decoder(cfg, get, embed=embed, layers="model.layers.", layer=opt.layer,  # biases everywhere
                   final=norms(get, "", "model.", {"ln_final": "layer_norm"}, bias=True))


register(Family("xglm", (MT,), config, weights))
