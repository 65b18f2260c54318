"""Qwen3 (Qwen Team 2025; Hugging Face `model_type` "qwen3"): Qwen2's Llama-like block (RMSNorm, SwiGLU,
rotary, GQA) without q/k/v biases and with QK-norm: an RMSNorm over d_head of every query and key head,
before RoPE, whose weight multiplies as stored (unlike Gemma's 1 + w). The head width is explicit
(`head_dim`, Hugging Face's default 128, not d_model / n_heads). Sliding windows as Qwen2's:
`use_sliding_window`, `sliding_window`, and per layer `layer_types`, else the layers from
`max_window_layers` on. A thin file over the Llama-like builder (`llamalike.py`).
"""

from __future__ import annotations

from ..config import ModelConfig
from .llamalike import _config as llamalike_config
from .llamalike import weights as llamalike_weights
from .registry import Family, register, require

MT = "qwen3"


def config(d: dict) -> ModelConfig:
    d = {**d, "head_dim": d.get("head_dim") or 128}  # Qwen3Config's default, not d_model // n_heads
    sliding = d.get("use_sliding_window", False) and d.get("sliding_window") is not None
    if not sliding:
        d["sliding_window"] = None  # Qwen3Config drops the window unless use_sliding_window
    elif d.get("layer_types") is None:  # as Qwen3Config fills them in: sliding from max_window_layers on
        first = d.get("max_window_layers", 28)
        n_layers = require(d, "num_hidden_layers", MT)
        d["layer_types"] = ["sliding_attention" if l >= first else "full_attention" for l in range(n_layers)]
    cfg = llamalike_config(d, MT, qkv_bias=False, out_bias=False, window=True)
    # TransformerLens's Qwen3 adapter: no BOS
    return cfg.replace(qk_norm=True, prepend_bos=False)


# QK-norm over each head (`cfg.qk_norm`), read by the Llama-style block
register(Family("qwen3", (MT,), config, llamalike_weights))
