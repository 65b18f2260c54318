"""The Llama-like families share one builder: RMSNorm, SwiGLU, rotary, GQA, separate q/k/v
projections. Llama (Touvron et al. 2023), Mistral (sliding window; Jiang et al. 2023) and Qwen2
(q/k/v biases, per-layer sliding window) differ only in their defaults, given as data below."""

from __future__ import annotations

from typing import Any

from ..config import ModelConfig
from .builders import llama_weights, reject, require, rms_decoder, rotary_from_hf
from .registry import Family, register


def _config(d: dict, mt: str, *, qkv_bias: bool, out_bias: bool, window: bool) -> ModelConfig:
    reject(d, mt, attn_logit_softcapping=bool, final_logit_softcapping=bool)
    d_model, n_heads = require(d, "hidden_size", mt), require(d, "num_attention_heads", mt)
    head_dim = d.get("head_dim") or d_model // n_heads
    n_ctx = d.get("max_position_embeddings", 2048)
    attention_bias = d.get("attention_bias")
    sliding: Any = None
    layer_types = None
    if window and d.get("sliding_window") is not None and d.get("use_sliding_window", True):
        sliding = int(d["sliding_window"])
        if d.get("layer_types"):
            kinds = {"full_attention": "full", "sliding_attention": "sliding"}
            unknown = set(d["layer_types"]) - set(kinds)
            if unknown:
                raise NotImplementedError(f"{mt} layer_types {sorted(unknown)} are not supported")
            layer_types = tuple(kinds[k] for k in d["layer_types"])
    return rms_decoder(d, mt, head_dim=head_dim, n_ctx=n_ctx,
        act_fn=d.get("hidden_act", "silu"),
        norm_eps=d.get("rms_norm_eps", 1e-6),
        **rotary_from_hf(d, head_dim, n_ctx),
        sliding_window=sliding,
        layer_types=layer_types,
        qkv_bias=qkv_bias if attention_bias is None else bool(attention_bias),
        attn_out_bias=out_bias if attention_bias is None else bool(attention_bias),
        mlp_bias=bool(d.get("mlp_bias", False)),
        prepend_bos=False if mt == "qwen2" else None,  # TransformerLens's Qwen2 adapter: no BOS
    )


weights = llama_weights  # the Llama-style block (`builders.llama_layer`): two RMSNorms, q/k/v, SwiGLU


register(Family("llama", ("llama",), lambda d: _config(d, "llama", qkv_bias=False, out_bias=False, window=False), weights))
register(Family("mistral", ("mistral",), lambda d: _config(d, "mistral", qkv_bias=False, out_bias=False, window=True), weights))
register(Family("qwen2", ("qwen2",), lambda d: _config(d, "qwen2", qkv_bias=True, out_bias=False, window=True), weights))
