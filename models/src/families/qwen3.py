"""Qwen3 (Qwen Team 2025; Hugging Face `model_type` "qwen3"): Qwen2's Llama-like block (RMSNorm, SwiGLU,
rotary, GQA) without q/k/v biases and with QK-norm: an RMSNorm over d_head of every query and key head,
before RoPE, whose weight multiplies as stored (unlike Gemma's 1 + w). The head width is explicit
(`head_dim`, Hugging Face's default 128, not d_model / n_heads). Sliding windows as Qwen2's:
`use_sliding_window`, `sliding_window`, and per layer `layer_types`, else the layers from
`max_window_layers` on. A thin file over the Llama-like builder (`llamalike.py`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..config import ModelConfig
from . import llamalike
from .llamalike import _config as llamalike_config
from .llamalike import weights as llamalike_weights
from .gguf_layout import RMS_KEYS, GGUFLayout, stated_rope
from .registry import Family, register, require

if TYPE_CHECKING:
    from ..formats.gguf_layouts import Metadata

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


# ---- GGUF: how llama.cpp writes Qwen 3 ----
# llama's tensor names with a QK-norm per head.
GGUF_NAMES = llamalike.GGUF_NAMES | {"attn_q_norm.weight": "self_attn.q_norm.weight",
                                     "attn_k_norm.weight": "self_attn.k_norm.weight"}
GGUF_KEYS = RMS_KEYS | {"rope.scaling.factor", "rope.scaling.original_context_length", "rope.scaling.attn_factor"}


def gguf_config(meta: Metadata, base: dict, names: set[str]) -> dict:
    """Qwen 3: llama's keys, the head width as attention.key_length (128 where d_model / n_heads is not),
    QK-norm from the tensors, YaRN or linear scaling as stated (`stated_rope`: the long-context releases'
    YaRN x4 from 32k); llama.cpp runs no sliding window for it, nor does Qwen3Config by default."""
    theta = meta.real("rope.freq_base", 10000.0)
    config = {"rope_theta": theta, "hidden_act": "silu", "use_sliding_window": False}
    rope = stated_rope(meta)
    return config if rope is None else config | {"rope_parameters": {"rope_theta": theta, **rope}}


# NEOX-style RoPE in llama.cpp: Hugging Face's row order
GGUF = GGUFLayout(MT, gguf_config, GGUF_NAMES, known_keys=GGUF_KEYS, permuted_qk=False, ignored=())
# QK-norm over each head (`cfg.qk_norm`), read by the Llama-style block
register(Family("qwen3", (MT,), config, llamalike_weights, gguf={"qwen3": GGUF}))
