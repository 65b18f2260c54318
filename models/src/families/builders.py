"""What the families build with: the checks of a Hugging Face config (`require`, `reject`), the
config of a Llama-descended decoder (`rms_decoder`) and its rotary positions (`rotary_from_hf`), and the
weights' pieces: norms and Linears by our name -> theirs (`norms`, `linears`), q / k / v from separate
projections (`split_qkv`) or fused per group (`grouped_qkv`), the Llama-style layer (`llama_layer`: its
attention, `llama_attention`, and its SwiGLU MLP) and the decoder around any layer (`decoder`,
`llama_weights`: embeddings, every block, the final norm, an untied unembedding).

A family file gives what differs as data (tensor names, which norms a block has, what a norm weight
stores) and calls these; none of them branches on a family's name.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Mapping

import torch
from torch import Tensor

from ..config import ModelConfig, RopeScaling
from ..placement.tensor_files import Joined

# get(name, *alternatives) returns the checkpoint tensor called `name` (or the first alternative
# present) or raises a CheckpointError naming the file and the tensor.
TensorGetter = Callable[..., Tensor]
# A block's weights: (our config, getter, its Hugging Face prefix "model.layers.3.", ours "blocks.3.").
Layer = Callable[[ModelConfig, TensorGetter, str, str], dict]


def require(d: dict[str, Any], key: str, model_type: str):
    if d.get(key) is None:
        raise ValueError(f"{model_type} config has no {key!r}; is this a complete config.json?")
    return d[key]


def reject(d: dict[str, Any], model_type: str, **unsupported: Callable[[Any], bool]) -> None:
    """Raise if a config key holds a value we cannot represent (predicate True = unsupported)."""
    for key, bad in unsupported.items():
        if key in d and d[key] is not None and bad(d[key]):
            raise NotImplementedError(f"{model_type} config sets {key}={d[key]!r}, which interp does not support")


def rms_decoder(d: dict[str, Any], model_type: str, *, head_dim: int, n_ctx: int, **fields: Any) -> ModelConfig:
    """The ModelConfig of a Llama-descended decoder (RMSNorm, gated MLP, rotary positions): the sizes every such
    Hugging Face config names alike (layers, widths, heads, vocabulary, MLP; num_key_value_heads defaulting to
    the query heads, untied embeddings), and `fields` for the rest (activation, eps, rotary, biases, windows,
    ...), any of which may replace those defaults."""
    n_heads = require(d, "num_attention_heads", model_type)
    sizes = dict(
        n_layers=require(d, "num_hidden_layers", model_type),
        d_model=require(d, "hidden_size", model_type),
        n_heads=n_heads,
        d_head=head_dim,
        n_kv_heads=d.get("num_key_value_heads") or n_heads,
        d_vocab=require(d, "vocab_size", model_type),
        n_ctx=n_ctx,
        d_mlp=require(d, "intermediate_size", model_type),
        gated_mlp=True,
        normalization="rmsnorm",
        positional="rotary",
        tie_embeddings=bool(d.get("tie_word_embeddings", False)),
        model_type=model_type,
    )
    return ModelConfig(**(sizes | fields))


def rotary_from_hf(d: dict[str, Any], head_dim: int, n_ctx: int) -> dict[str, Any]:
    """rotary_base, rotary_dim and rope_scaling from either HF layout: `rope_parameters`
    (transformers 5) or `rope_theta` + `rope_scaling` (+ `partial_rotary_factor` / `rotary_pct`)."""
    params = dict(d.get("rope_parameters") or {})
    legacy = d.get("rope_scaling") or {}
    params = {**legacy, **params}
    base = params.get("rope_theta", d.get("rope_theta", d.get("rotary_emb_base", 10000.0)))
    partial = params.get("partial_rotary_factor", d.get("partial_rotary_factor", d.get("rotary_pct", 1.0)))
    kind = params.get("rope_type", params.get("type", "default"))
    out: dict[str, Any] = {"rotary_base": float(base), "rotary_dim": int(head_dim * partial)}
    if kind == "default":
        return out
    kinds = {"linear": "linear", "dynamic": "dynamic", "yarn": "yarn", "llama3": "llama3", "longrope": "longrope"}
    if kind not in kinds:
        raise NotImplementedError(f"rope type {kind!r} is not supported; interp supports {sorted(kinds)}")
    orig = params.get("original_max_position_embeddings")
    if kind == "dynamic":
        orig = n_ctx  # Hugging Face's dynamic NTK scales relative to max_position_embeddings
    factor = params.get("factor", 1.0)
    short = long = None
    if kind == "longrope":
        if params.get("short_factor") is None or params.get("long_factor") is None:
            raise NotImplementedError("rope type 'longrope' needs both short_factor and long_factor")
        # As Hugging Face: a top-level original_max_position_embeddings (Phi-3's) wins over the rope
        # parameters' one, and a missing factor is max_position_embeddings / original_max_position_embeddings.
        orig = d.get("original_max_position_embeddings") or orig or n_ctx
        factor = params.get("factor") or n_ctx / orig
        short, long = tuple(map(float, params["short_factor"])), tuple(map(float, params["long_factor"]))
    out["rope_scaling"] = RopeScaling(
        kind=kinds[kind],
        factor=float(factor),
        original_max_position=orig,
        beta_fast=float(params.get("beta_fast") or 32.0),
        beta_slow=float(params.get("beta_slow") or 1.0),
        attention_factor=params.get("attention_factor"),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        short_factor=short,
        long_factor=long,
    )
    if kind == "yarn":
        attention = params.get("attention_factor")
        mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
        if attention is None and mscale and mscale_all_dim:  # DeepSeek's form, as Hugging Face computes it
            ratio = lambda m: 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0  # noqa: E731
            attention = ratio(mscale) / ratio(mscale_all_dim)
        out["rope_scaling"] = dataclasses.replace(out["rope_scaling"], attention_factor=attention,
                                                  truncate=bool(params.get("truncate", True)))
    return out


def t(x: Tensor) -> Tensor:
    """A Linear weight [out, in] in our input-major layout [in, out]: a transposed view (no copy here: the
    loader lays it out as the parameter is, one tensor at a time, or an offloaded block when it runs)."""
    return x.T


def qkv(q: Tensor, k: Tensor, v: Tensor) -> Joined:
    """Three Linear weights [out, in] -> our fused W_qkv [d_model, (head + 2 kv_head) * d_head], joined when
    the loader adopts it (`tensor_files.Joined`: no copy of the three here)."""
    return Joined([q.T, k.T, v.T], dim=1)


def layernorm_decoder(d: dict[str, Any], model_type: str, *, sizes: Mapping[str, str], **fields: Any) -> ModelConfig:
    """The ModelConfig of a LayerNorm decoder: `sizes`, our field -> the Hugging Face key that holds it (each
    required), a tied unembedding unless `tie_word_embeddings` says otherwise, and `fields` for the rest, any
    of which may replace those defaults."""
    base = dict(normalization="layernorm", tie_embeddings=bool(d.get("tie_word_embeddings", True)), model_type=model_type)
    return ModelConfig(**(base | {ours: require(d, theirs, model_type) for ours, theirs in sizes.items()} | fields))


def norms(get: TensorGetter, o: str, p: str, names: Mapping[str, str], *, bias: bool = False,
          shift: float = 0.0) -> dict:
    """Norm weights by our name -> theirs: `{o}{ours}.w` <- `{p}{theirs}.weight` (and `.b` <- `.bias` with
    `bias`). `shift`: what the stored weight lacks of the multiplier (Gemma's 1: w + 1, in float32 as its
    forward adds it)."""
    sd = {}
    for ours, theirs in names.items():
        w = get(f"{p}{theirs}.weight")
        sd[f"{o}{ours}.w"] = w.float() + shift if shift else w
        if bias:
            sd[f"{o}{ours}.b"] = get(f"{p}{theirs}.bias")
    return sd


def linears(get: TensorGetter, o: str, p: str, names: Mapping[str, str], *, bias: bool = False,
            transpose: bool = True) -> dict:
    """Linear layers by our name -> theirs: ours are `attn.qkv`, `attn.O` (W_O_flat), `mlp.in`, `mlp.out`,
    `mlp.gate`; `{o}{module}.W_{leaf}` <- `{p}{theirs}.weight` ([out, in], transposed to our input-major
    [in, out] unless `transpose` is False: Conv1D weights are input-major already), `b_{leaf}` <- `.bias`
    with `bias`."""
    sd = {}
    for ours, theirs in names.items():
        module, leaf = ours.rsplit(".", 1)
        w = get(f"{p}{theirs}.weight")
        if transpose and module == "mlp" and leaf in ("in", "gate"):
            w = w.T  # a view: our W_in / W_gate are stored out-major ([out, in], as the file), so no copy
        elif transpose:
            w = t(w)
        sd[f"{o}{module}.W_{'O_flat' if leaf == 'O' else leaf}"] = w
        if bias:
            sd[f"{o}{module}.b_{leaf}"] = get(f"{p}{theirs}.bias")
    return sd


def split_qkv(get: TensorGetter, o: str, a: str, *, bias: bool, names=("q_proj", "k_proj", "v_proj")) -> dict:
    """Our fused W_qkv (and b_qkv with `bias`) from separate q, k, v Linears under `a` ("...self_attn.")."""
    sd = {f"{o}attn.W_qkv": qkv(*(get(f"{a}{n}.weight") for n in names))}
    if bias:
        sd[f"{o}attn.b_qkv"] = torch.cat([get(f"{a}{n}.bias") for n in names])
    return sd


def grouped_qkv(x: Tensor, n_heads: int, n_kv: int, d_head: int) -> Tensor:
    """A fused projection's rows laid out per KV group ([q_1 .. q_g, k, v], g = n_heads / n_kv; per head
    [q, k, v] when every head has its own key and value: GPT-NeoX, BLOOM, Falcon) in our order [q | k | v]:
    a weight [rows, d_model] or a bias [rows]."""
    g = n_heads // n_kv
    w = x.reshape(n_kv, g + 2, d_head, *x.shape[1:])  # a tensor of any other row count fails here, named
    w = w if x.dim() > 1 else w[..., None]
    rows = torch.cat([w[:, :g].reshape(n_heads * d_head, -1), w[:, g].reshape(n_kv * d_head, -1),
                      w[:, g + 1].reshape(n_kv * d_head, -1)])
    return rows.reshape(-1) if x.dim() == 1 else rows


def grouped_qkv_weights(cfg: ModelConfig, get: TensorGetter, o: str, name: str, *, bias: bool) -> dict:
    """W_qkv (and b_qkv with `bias`) from one fused projection `name` laid out per KV group (`grouped_qkv`)."""
    regroup = lambda x: grouped_qkv(x, cfg.n_heads, cfg.kv_heads, cfg.head_dim)  # noqa: E731
    sd = {f"{o}attn.W_qkv": t(regroup(get(name + ".weight")))}
    if bias:
        sd[f"{o}attn.b_qkv"] = regroup(get(name + ".bias"))
    return sd


def llama_attention(cfg: ModelConfig, get: TensorGetter, p: str, o: str, *, shift: float = 0.0) -> dict:
    """A Llama-style attention under `{p}self_attn.`: separate q, k, v and o projections, their biases where
    `cfg` has them, and QK-norm (`q_norm`, `k_norm`; `shift` as `norms`) where it has that."""
    a = p + "self_attn."
    sd = split_qkv(get, o, a, bias=cfg.qkv_bias) | linears(get, o, a, {"attn.O": "o_proj"}, bias=cfg.attn_out_bias)
    if cfg.qk_norm:
        sd |= norms(get, o + "attn.", a, {"q_norm": "q_norm", "k_norm": "k_norm"}, shift=shift)
    return sd


def swiglu_mlp(cfg: ModelConfig, get: TensorGetter, p: str, o: str) -> dict:
    """A Llama-style gated MLP under `{p}mlp.` (gate_proj, up_proj, down_proj; biases where `cfg` has them)."""
    return linears(get, o, p + "mlp.", {"mlp.gate": "gate_proj", "mlp.in": "up_proj", "mlp.out": "down_proj"},
                   bias=cfg.mlp_bias)


LLAMA_NORMS = {"ln1": "input_layernorm", "ln2": "post_attention_layernorm"}


def llama_layer(cfg: ModelConfig, get: TensorGetter, p: str, o: str, *, block_norms: Mapping[str, str] = LLAMA_NORMS,
                shift: float = 0.0, attention: Layer = llama_attention, mlp: Layer = swiglu_mlp) -> dict:
    """One Llama-style block: its norms (our name -> theirs: Llama's two by default, Gemma's four, OLMo 2's
    two after; `shift` as `norms`), `attention` and `mlp` (Llama's by default; a family's own where its
    checkpoint differs)."""
    return norms(get, o, p, block_norms, shift=shift) | attention(cfg, get, p, o) | mlp(cfg, get, p, o)


def decoder(cfg: ModelConfig, get: TensorGetter, *, embed: Mapping[str, Tensor], layers: str, layer: Layer,
            final: Mapping[str, Tensor], head: tuple[str, ...] = ("lm_head.weight",)) -> dict:
    """Our state dict: `embed` (the embeddings), every block (`layer` on `{layers}{l}.`), `final` (the final
    norm and anything else after the blocks), and the unembedding when untied (`head`, or its first present
    alternative, transposed)."""
    sd = dict(embed)
    for l in range(cfg.n_layers):
        sd |= layer(cfg, get, f"{layers}{l}.", f"blocks.{l}.")
    sd |= final
    if not cfg.tie_embeddings:
        sd["unembed.W_U"] = t(get(*head))
    return sd


def llama_weights(cfg: ModelConfig, get: TensorGetter, *, layer: Layer = llama_layer, shift: float = 0.0) -> dict:
    """A Llama-descended checkpoint (`model.embed_tokens`, `model.layers.N.`, `model.norm`, `lm_head`), each
    block read by `layer`; `shift` as `norms`, for the final norm."""
    return decoder(cfg, get, embed={"embed.W_E": get("model.embed_tokens.weight")}, layers="model.layers.",
                   layer=layer, final=norms(get, "", "model.", {"ln_final": "norm"}, shift=shift))
