"""The Llama-like families share one builder: RMSNorm, SwiGLU, rotary, GQA, separate q/k/v
projections. Llama (Touvron et al. 2023), Mistral (sliding window; Jiang et al. 2023) and Qwen2
(q/k/v biases, per-layer sliding window) differ only in their defaults, given as data below, with how
llama.cpp writes each of them (`GGUF_NAMES`, `_gguf_config`: their GGUF layouts)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import numpy as np

from interp.errors import CheckpointError
from ..config import ModelConfig, RopeScaling
from ..placement.device import to_numpy
from ..positions import llama3_divisors
from .builders import llama_weights, reject, require, rms_decoder, rotary_from_hf
from .gguf_layout import GGUFLayout, stated_rope
from .registry import Family, register

if TYPE_CHECKING:
    from ..formats.gguf_layouts import Metadata


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


# ---- GGUF: how llama.cpp writes Llama, Mistral and Qwen 2 ----
# llama.cpp tensor names -> Hugging Face llama names ({l} is the layer).
GGUF_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}


def _gguf_config(meta: Metadata, base: dict, names: set[str]) -> dict:
    """Llama, Mistral, Qwen 2: llama's keys. RoPE scaling as llama.cpp's converters write it: linear or YaRN
    in rope.scaling.* (`stated_rope`), or a `rope_freqs.weight` tensor (Llama 3.1 and later: Llama 3's
    frequency scaling, `_llama3_rope`)."""
    config = {
        "rope_theta": meta.real("rope.freq_base", 10000.0),
        "hidden_act": "silu",
        "attention_bias": "blk.0.attn_q.bias" in names,
        "mlp_bias": False,
    }
    rope = stated_rope(meta)
    if "rope_freqs.weight" in names:
        if rope is not None:
            raise NotImplementedError(f"{meta.source}: both {meta.arch}.rope.scaling.type = "
                                      f"{meta.get('rope.scaling.type')!r} and a rope_freqs.weight tensor; interp reads one")
        rope = _llama3_rope(meta, config["rope_theta"], base["head_dim"])
    if rope is not None:
        config["rope_parameters"] = {"rope_theta": config["rope_theta"], **rope}
    if base["model_type"] == "qwen2":  # q/k/v biases, no output bias: the family's defaults
        config.pop("attention_bias")
    if meta.get("attention.sliding_window"):
        config["sliding_window"] = meta.count("attention.sliding_window")
    return config


def _llama3_rope(meta: Metadata, theta: float, rot_dim: int) -> dict | None:
    """transformers' `rope_parameters` for the per-frequency divisors llama.cpp stores as `rope_freqs.weight`
    (None when every divisor is 1). llama.cpp's converter writes Llama 3's scaling only as those divisors:
    f_i = 1 for wavelengths (2 pi / theta_i) under original / high_freq_factor, `factor` over original /
    low_freq_factor, and 1 / ((1 - s) / factor + s) between, s = (original / wavelength - low) / (high - low).
    The divisors fix `factor` (the largest) and s as a line in 1 / wavelength (two numbers), not the three
    parameters: every (original, low, high) on that line gives the same frequencies, and this reads the one
    with low_freq_factor 1 (Llama 3's). Divisors that follow no such line are refused, naming the tensor."""
    source = meta.source
    f = np.asarray(meta.small_tensor("rope_freqs.weight"), np.float64)
    if len(f) != rot_dim // 2:
        raise CheckpointError(f"{source}: tensor 'rope_freqs.weight' holds {len(f)} values; the rotary pairs are "
                              f"{rot_dim // 2}")
    if not np.isfinite(f).all() or (f < 1 - 1e-6).any():
        raise CheckpointError(f"{source}: tensor 'rope_freqs.weight' holds divisors below 1 or not finite; the file "
                              "is corrupt or not Llama 3's")
    factor = float(f.max())
    if factor <= 1 + 1e-6:
        return None
    x = (theta ** (-np.arange(0, rot_dim, 2, dtype=np.float64) / rot_dim)) / (2 * math.pi)  # 1 / wavelength
    band = (f > 1 + 1e-4) & (f < factor * (1 - 1e-4))
    refused = CheckpointError(f"{source}: tensor 'rope_freqs.weight' does not follow Llama 3's frequency scaling "
                              "(plateaus at 1 and at the factor, a smooth band between); interp reads only that")
    if band.sum() < 2:
        raise refused
    s = (1 / f[band] - 1 / factor) / (1 - 1 / factor)
    slope, intercept = np.polyfit(x[band], s, 1)
    if slope <= 0 or intercept >= 0:
        raise refused
    original, high = int(round(-slope / intercept)), float(1 - 1 / intercept)  # low_freq_factor 1
    scaling = RopeScaling("llama3", factor, original, low_freq_factor=1.0, high_freq_factor=high)
    if not np.allclose(to_numpy(llama3_divisors(theta, rot_dim, scaling), np.float64), f, rtol=1e-4, atol=0):
        raise refused
    return {"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0, "high_freq_factor": high,
            "original_max_position_embeddings": original}


def _family(mt: str, *, qkv_bias: bool, window: bool, permuted_qk: bool) -> Family:
    """One of the three: its config's defaults, and its GGUF layout (llama.cpp permutes Llama's and Mistral's
    Q / K rows for its RoPE layout; Qwen 2's it writes in Hugging Face's order)."""
    gguf = {mt: GGUFLayout(mt, _gguf_config, GGUF_NAMES, permuted_qk=permuted_qk)}
    config = lambda d: _config(d, mt, qkv_bias=qkv_bias, out_bias=False, window=window)  # noqa: E731
    return Family(mt, (mt,), config, weights, gguf=gguf)


register(_family("llama", qkv_bias=False, window=False, permuted_qk=True))
register(_family("mistral", qkv_bias=False, window=True, permuted_qk=True))
register(_family("qwen2", qkv_bias=True, window=True, permuted_qk=False))
