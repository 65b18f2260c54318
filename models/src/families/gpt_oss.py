"""gpt-oss (OpenAI 2025; Hugging Face `model_type` "gpt_oss"): a Llama-like block (RMSNorm, rotary, GQA)
with attention biases, learned attention-sink logits (one per head in every softmax denominator:
`learned_sinks`), sliding-window (128) and full layers alternating (`layer_types`), YaRN rotary with an
unrounded correction range (`truncate=False`), and a mixture of experts whose router has a bias and
whose experts are a clamped SwiGLU with biases: gate clamped to <= swiglu_limit, linear branch to
[-limit, limit], out = gate * sigmoid(swiglu_alpha * gate) * (linear + 1) (`interp.models.native.moe`).

Hugging Face stores the experts input-major and fused: `mlp.experts.gate_up_proj` [experts, d_model,
2 d_mlp] with gate and linear columns interleaved (gate at even columns), its bias likewise, and
`mlp.experts.down_proj` [experts, d_mlp, d_model]. Checkpoints quantized to MXFP4 (the released ones:
`quantization_config`, `*_blocks` / `*_scales`) are refused: dequantize them first (transformers'
`Mxfp4Config(dequantize=True)`, then `save_pretrained`).

Its RMSNorm multiplies the weight in float32 before casting back; ours casts first (Llama's order):
the same in float32, one rounding apart in half precision. Defaults for absent keys are Hugging Face's
(`GptOssConfig`).
"""

from __future__ import annotations

import functools

from ..config import ModelConfig
from .builders import TensorGetter, linears, llama_attention, llama_layer, llama_weights, require, rms_decoder, rotary_from_hf
from .registry import Family, register

MT = "gpt_oss"
_LAYER_TYPES = {"sliding_attention": "sliding", "full_attention": "full"}
_ROPE = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
         "original_max_position_embeddings": 4096, "rope_theta": 150000.0}  # GptOssConfig's default


def config(d: dict) -> ModelConfig:
    if d.get("quantization_config") is not None:
        method = (d["quantization_config"] or {}).get("quant_method", "quantized")
        raise NotImplementedError(f"{MT} config sets quantization_config ({method} experts), which interp does "
                                  "not load: dequantize first (transformers' Mxfp4Config(dequantize=True), "
                                  "save_pretrained)")
    n_layers = require(d, "num_hidden_layers", MT)
    head_dim = d.get("head_dim") or 64
    n_ctx = d.get("max_position_embeddings", 131072)
    default_types = ["sliding_attention" if l % 2 == 0 else "full_attention" for l in range(n_layers)]
    layer_types = d.get("layer_types") or default_types  # GptOssConfig's: sliding first, then alternating
    unknown = sorted(set(layer_types) - set(_LAYER_TYPES))
    if unknown:
        raise NotImplementedError(f"{MT} config sets layer_types {unknown}; interp knows {sorted(_LAYER_TYPES)}")
    given = d.get("rope_parameters") or d.get("rope_scaling") or d.get("rope_theta")
    rope = d if given else {**d, "rope_parameters": _ROPE}
    bias = bool(d.get("attention_bias", True))
    return rms_decoder(d, MT, head_dim=head_dim, n_ctx=n_ctx,
        n_kv_heads=d.get("num_key_value_heads", 8),
        act_fn="silu",  # unused: the experts are the clamped SwiGLU below
        norm_eps=d.get("rms_norm_eps", 1e-5),
        **rotary_from_hf(rope, head_dim, n_ctx),
        sliding_window=None if d.get("sliding_window", 128) is None else int(d.get("sliding_window", 128)),
        layer_types=tuple(_LAYER_TYPES[k] for k in layer_types),
        qkv_bias=bias,
        attn_out_bias=bias,
        mlp_bias=True,
        num_experts=require(d, "num_local_experts", MT),
        experts_per_token=require(d, "num_experts_per_tok", MT),
        norm_topk_prob=True,  # a softmax over the chosen experts' logits
        router_bias=True,
        swiglu_limit=float(d.get("swiglu_limit", 7.0)),
        swiglu_alpha=float(d.get("swiglu_alpha", 1.702)),
        learned_sinks=True,
    )


def _attention(cfg: ModelConfig, get: TensorGetter, p: str, o: str) -> dict:
    """Llama's attention with biases, and the learned sink logits."""
    return llama_attention(cfg, get, p, o) | {o + "attn.sinks": get(p + "self_attn.sinks")}


def _experts(cfg: ModelConfig, get: TensorGetter, p: str, o: str) -> dict:
    """The router (with its bias) and every expert, input-major already: gate and linear columns interleaved."""
    m = p + "mlp."
    sd = linears(get, o, m, {"mlp.gate": "router"}, bias=True)
    gate_up, gate_up_bias = get(m + "experts.gate_up_proj"), get(m + "experts.gate_up_proj_bias")
    down, down_bias = get(m + "experts.down_proj"), get(m + "experts.down_proj_bias")
    for e in range(cfg.num_experts):
        x = f"{o}mlp.experts.{e}."
        sd |= {
            x + "W_gate": gate_up[e][:, 0::2].contiguous(), x + "b_gate": gate_up_bias[e][0::2].contiguous(),
            x + "W_in": gate_up[e][:, 1::2].contiguous(), x + "b_in": gate_up_bias[e][1::2].contiguous(),
            x + "W_out": down[e].contiguous(), x + "b_out": down_bias[e].contiguous(),
        }
    return sd


weights = functools.partial(llama_weights, layer=functools.partial(llama_layer, attention=_attention, mlp=_experts))


register(Family(MT, (MT,), config, weights))
