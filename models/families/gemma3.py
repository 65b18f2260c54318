"""Gemma 3, text only (Gemma Team 2025; Hugging Face `model_type` "gemma3_text"): five sliding-window
("local") layers for each full ("global") one, each kind with its own RoPE base; QK-norm; sandwich
norms (RMSNorm before and after attention and MLP); GeGLU with GELU's tanh approximation; embeddings
scaled by sqrt(d_model); tied unembedding; queries scaled by query_pre_attn_scalar ** -0.5.

Hugging Face stores every Gemma norm weight as w with the norm multiplying by (1 + w); we store the
whole multiplier (1 + w, computed in float32 as Hugging Face computes it), as TransformerLens does, so
our norms, weight folding and views stay the plain RMSNorm ones.

Defaults for absent keys are Hugging Face's (`Gemma3TextConfig`): a config.json that transformers
loads is read the same way here. What this model cannot represent raises, naming the key.
"""

from __future__ import annotations

from typing import Any

from ..config import ModelConfig
from .registry import Family, TensorGetter, qkv, register, reject, require, rotary_from_hf, t

MT = "gemma3_text"
_ACTIVATIONS = {"gelu_pytorch_tanh": "gelu_new", "gelu_new": "gelu_new", "gelu": "gelu", "gelu_fast": "gelu_fast"}
_LAYER_TYPES = {"sliding_attention": "sliding", "full_attention": "full"}
_DEFAULT_THETA = {"full_attention": 1_000_000.0, "sliding_attention": 10_000.0}  # Gemma3TextConfig.default_theta


def _layer_types(d: dict, n_layers: int) -> tuple[str, ...]:
    """From `layer_types`, else from `sliding_window_pattern` (every n-th layer full; Hugging Face's default 6)."""
    if d.get("layer_types") is not None:
        unknown = sorted(set(d["layer_types"]) - set(_LAYER_TYPES))
        if unknown:
            raise NotImplementedError(f"{MT} config sets layer_types {unknown}; interp knows {sorted(_LAYER_TYPES)}")
        return tuple(_LAYER_TYPES[k] for k in d["layer_types"])
    pattern = d.get("sliding_window_pattern", 6)
    if isinstance(pattern, bool) or not isinstance(pattern, int) or pattern < 1:
        raise ValueError(f"{MT} config sets sliding_window_pattern={pattern!r}; it must be an integer >= 1")
    return tuple("full" if (l + 1) % pattern == 0 else "sliding" for l in range(n_layers))


def _rope(d: dict) -> tuple[dict[str, Any], dict[str, Any]]:
    """(full layers' rope parameters, sliding layers'), from transformers 5's per-layer-type
    `rope_parameters` or the older `rope_theta` / `rope_local_base_freq` / `rope_scaling`."""
    params = d.get("rope_parameters") or {}
    if params and set(params) <= set(_LAYER_TYPES):
        full, local = dict(params.get("full_attention") or {}), dict(params.get("sliding_attention") or {})
    else:
        full = {**(d.get("rope_scaling") or {}), **params}
        full.setdefault("rope_theta", d.get("rope_theta", _DEFAULT_THETA["full_attention"]))
        local = {"rope_type": "default", "rope_theta": d.get("rope_local_base_freq", _DEFAULT_THETA["sliding_attention"])}
    full.setdefault("rope_theta", _DEFAULT_THETA["full_attention"])
    local.setdefault("rope_theta", _DEFAULT_THETA["sliding_attention"])
    if local.get("rope_type", local.get("type", "default")) != "default" or set(local) - {"rope_type", "type", "rope_theta"}:
        raise NotImplementedError(f"{MT} config scales the sliding layers' RoPE ({local}); interp supports plain RoPE there")
    return full, local


def config(d: dict) -> ModelConfig:
    reject(
        d, MT,
        attn_logit_softcapping=lambda v: True,  # Gemma 2's; not implemented (one line naming the key)
        final_logit_softcapping=lambda v: True,
        use_bidirectional_attention=bool,
    )
    n_layers = require(d, "num_hidden_layers", MT)
    d_model, n_heads = require(d, "hidden_size", MT), require(d, "num_attention_heads", MT)
    head_dim = d.get("head_dim") or 256
    act = d.get("hidden_activation", "gelu_pytorch_tanh")
    if act not in _ACTIVATIONS:
        raise NotImplementedError(f"{MT} config sets hidden_activation={act!r}; interp supports {sorted(_ACTIVATIONS)}")
    layer_types = _layer_types(d, n_layers)
    window = d.get("sliding_window", 4096)
    if window is None and "sliding" in layer_types:
        raise NotImplementedError(f"{MT} config has sliding_attention layers but sliding_window=None "
                                  "(full attention with the local RoPE base), which interp does not represent")
    full, local = _rope(d)
    n_ctx = d.get("max_position_embeddings", 131_072)
    rotary = rotary_from_hf({"rope_parameters": full}, head_dim, n_ctx)
    if rotary["rotary_dim"] != head_dim:
        raise NotImplementedError(f"{MT} config asks for partial rotary; interp supports rotary over the whole head")
    bias = bool(d.get("attention_bias", False))
    return ModelConfig(
        n_layers=n_layers,
        d_model=d_model,
        n_heads=n_heads,
        d_head=head_dim,
        n_kv_heads=d.get("num_key_value_heads", 4),
        d_vocab=require(d, "vocab_size", MT),
        n_ctx=n_ctx,
        d_mlp=require(d, "intermediate_size", MT),
        act_fn=_ACTIVATIONS[act],
        gated_mlp=True,
        normalization="rmsnorm",
        norm_eps=d.get("rms_norm_eps", 1e-6),
        positional="rotary",
        **rotary,
        rotary_base_local=float(local["rope_theta"]) if "sliding" in layer_types else None,
        sliding_window=None if window is None else int(window),
        layer_types=layer_types,
        qk_norm=True,
        sandwich_norms=True,
        qkv_bias=bias,
        attn_out_bias=bias,
        mlp_bias=False,
        tie_embeddings=bool(d.get("tie_word_embeddings", True)),
        embed_scale=d_model**0.5,
        attn_scale=d.get("query_pre_attn_scalar", 256) ** -0.5,
        model_type=MT,
    )


def _norm(get: TensorGetter, name: str):
    """A Gemma norm's multiplier: 1 + the stored weight, in float32 as Hugging Face's forward adds it."""
    return get(name).float() + 1.0


def weights(cfg: ModelConfig, get: TensorGetter) -> dict:
    sd = {"embed.W_E": get("model.embed_tokens.weight")}
    for l in range(cfg.n_layers):
        p, o = f"model.layers.{l}.", f"blocks.{l}."
        a, m = p + "self_attn.", p + "mlp."
        sd |= {
            o + "ln1.w": _norm(get, p + "input_layernorm.weight"),
            o + "attn.W_qkv": qkv(get(a + "q_proj.weight"), get(a + "k_proj.weight"), get(a + "v_proj.weight")),
            o + "attn.q_norm.w": _norm(get, a + "q_norm.weight"),
            o + "attn.k_norm.w": _norm(get, a + "k_norm.weight"),
            o + "attn.W_O_flat": t(get(a + "o_proj.weight")),
            o + "ln1_post.w": _norm(get, p + "post_attention_layernorm.weight"),
            o + "ln2.w": _norm(get, p + "pre_feedforward_layernorm.weight"),
            o + "mlp.W_gate": t(get(m + "gate_proj.weight")),
            o + "mlp.W_in": t(get(m + "up_proj.weight")),
            o + "mlp.W_out": t(get(m + "down_proj.weight")),
            o + "ln2_post.w": _norm(get, p + "post_feedforward_layernorm.weight"),
        }
        if cfg.qkv_bias:
            sd[o + "attn.b_qkv"] = qkv(get(a + "q_proj.bias")[:, None], get(a + "k_proj.bias")[:, None],
                                       get(a + "v_proj.bias")[:, None])[0]
        if cfg.attn_out_bias:
            sd[o + "attn.b_O"] = get(a + "o_proj.bias")
    sd["ln_final.w"] = _norm(get, "model.norm.weight")
    if not cfg.tie_embeddings:
        sd["unembed.W_U"] = t(get("lm_head.weight"))
    return sd


register(Family("gemma3_text", (MT,), config, weights))
