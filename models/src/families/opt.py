"""OPT (Zhang et al. 2022; Hugging Face `model_type` "opt"): pre-LN blocks with LayerNorm, ReLU MLP,
biases everywhere (`enable_bias`), tied unembedding, and learned positions stored with an offset of 2
(fairseq's padding convention): position p reads row p + 2 of `embed_positions`, so our W_pos is that
table without its first two rows. Hugging Face derives the positions from the attention mask (real
tokens count 0, 1, 2, ...), as our forward does, so left-padded rows get the positions they would alone.

Refused, each in one line: opt-350m's post-LN blocks (`do_layer_norm_before=False`), the projections
between a narrower embedding and the residual stream (`word_embed_proj_dim != hidden_size`:
project_in / project_out), `_remove_final_layer_norm` and norms without weights
(`layer_norm_elementwise_affine=False`).
"""

from __future__ import annotations

from ..config import ModelConfig
from .builders import TensorGetter, decoder, layernorm_decoder, linears, norms, reject, require, split_qkv
from .registry import Family, register

MT = "opt"
OFFSET = 2  # OPTLearnedPositionalEmbedding's offset
_ACTIVATIONS = {"relu": "relu", "gelu": "gelu", "gelu_new": "gelu_new", "silu": "silu", "gelu_pytorch_tanh": "gelu_new"}


def config(d: dict) -> ModelConfig:
    d_model = require(d, "hidden_size", MT)
    reject(d, MT, do_layer_norm_before=lambda v: v is False, _remove_final_layer_norm=bool,
           word_embed_proj_dim=lambda v: v != d_model, layer_norm_elementwise_affine=lambda v: v is False)
    act = d.get("activation_function", "relu")
    if act not in _ACTIVATIONS:
        raise NotImplementedError(f"{MT} config sets activation_function={act!r}; interp supports {sorted(_ACTIVATIONS)}")
    bias = bool(d.get("enable_bias", True))
    sizes = dict(n_layers="num_hidden_layers", n_heads="num_attention_heads", d_vocab="vocab_size", d_mlp="ffn_dim")
    return layernorm_decoder(d, MT, sizes=sizes, d_model=d_model, n_ctx=d.get("max_position_embeddings", 2048),
                             act_fn=_ACTIVATIONS[act], positional="learned", qkv_bias=bias, attn_out_bias=bias,
                             mlp_bias=bias, norm_eps=1e-5)  # nn.LayerNorm's default; OPT's config has no eps


def layer(cfg: ModelConfig, get: TensorGetter, p: str, o: str) -> dict:
    """fairseq's pre-LN block (OPT's, XGLM's): LayerNorms with biases; projections with biases where `cfg` has them."""
    names = {"attn.O": "self_attn.out_proj", "mlp.in": "fc1", "mlp.out": "fc2"}
    return (norms(get, o, p, {"ln1": "self_attn_layer_norm", "ln2": "final_layer_norm"}, bias=True)
            | split_qkv(get, o, p + "self_attn.", bias=cfg.qkv_bias) | linears(get, o, p, names, bias=cfg.qkv_bias))


def weights(cfg: ModelConfig, get: TensorGetter) -> dict:
    embed = {"embed.W_E": get("model.decoder.embed_tokens.weight"),
             "pos_embed.W_pos": get("model.decoder.embed_positions.weight")[OFFSET:]}
    return decoder(cfg, get, embed=embed, layers="model.decoder.layers.", layer=layer,
                   final=norms(get, "", "model.decoder.", {"ln_final": "final_layer_norm"}, bias=True))


register(Family("opt", (MT,), config, weights))
