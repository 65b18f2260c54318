"""The family registry and the helpers every converter shares."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import Tensor

from ..config import ModelConfig, RopeScaling

# get(name, *alternatives) returns the checkpoint tensor called `name` (or the first alternative
# present) or raises a CheckpointError naming the file and the tensor.
TensorGetter = Callable[..., Tensor]


@dataclass(frozen=True)
class Family:
    """config: HF config dict -> ModelConfig.  weights: (our config, getter) -> our state dict."""

    name: str
    model_types: tuple[str, ...]
    config: Callable[[dict[str, Any]], ModelConfig]
    weights: Callable[[ModelConfig, TensorGetter], dict[str, Tensor]]


FAMILIES: dict[str, Family] = {}


def register(family: Family) -> Family:
    for t in family.model_types:
        if t in FAMILIES:
            raise ValueError(f"model_type {t!r} is registered twice ({FAMILIES[t].name}, {family.name})")
        FAMILIES[t] = family
    return family


def get_family(model_type: str | None) -> Family:
    if model_type not in FAMILIES:
        raise NotImplementedError(
            f"unsupported architecture model_type={model_type!r}; interp converts {sorted(FAMILIES)}. "
            "A new family is one file in models/families/ that registers a config and a weight mapping."
        )
    return FAMILIES[model_type]


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
    """A Linear weight [out, in] in our input-major layout [in, out]."""
    return x.T.contiguous()


def qkv(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """Three Linear weights [out, in] -> our fused W_qkv [d_model, (head + 2 kv_head) * d_head]."""
    return torch.cat([q.T, k.T, v.T], dim=1).contiguous()
