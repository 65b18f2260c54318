"""Phi-3 (Abdin et al. 2024; Hugging Face `model_type` "phi3"): a Llama-like block (RMSNorm, SwiGLU,
rotary, GQA, no biases) whose projections are fused in the checkpoint: `qkv_proj` stacks the query,
key and value rows ([q | k | v], our own W_qkv layout) and `gate_up_proj` the gate then the up
projection; both are split on load. Partial rotary (`partial_rotary_factor`), one sliding window for
every layer when `sliding_window` is set, and LongRoPE scaling (`rope_type` "longrope"; Phi-3's older
names for it, "su" and "yarn", are read as Hugging Face's Phi3Config reads them: as longrope).

Defaults for absent keys are Hugging Face's (`Phi3Config`); what this model cannot represent raises,
naming the key.
"""

from __future__ import annotations

import functools

from ..config import ModelConfig
from .builders import TensorGetter, linears, llama_layer, llama_weights, reject, require, rms_decoder, rotary_from_hf, t
from .registry import Family, register

MT = "phi3"


def _rope(d: dict) -> dict:
    """`d` with its rope parameters as Phi3Config standardises them: a legacy `rope_scaling` replaces
    `rope_parameters`, "su" / "yarn" mean longrope, and the top-level original_max_position_embeddings
    (default 4096) is the one longrope uses (for "su", only where its own parameters name none)."""
    params = dict(d.get("rope_scaling") or d.get("rope_parameters") or {})
    kind = params.get("rope_type", params.get("type"))
    top = d.get("original_max_position_embeddings", 4096)
    if kind == "su":  # renamed only after Phi3Config standardises, so its own original_max_position_embeddings stays
        top = params.get("original_max_position_embeddings", top)
    if kind in ("su", "yarn"):
        params["rope_type"] = "longrope"
    return {**d, "rope_parameters": params, "rope_scaling": None, "original_max_position_embeddings": top}


def config(d: dict) -> ModelConfig:
    reject(d, MT, attention_bias=bool, mlp_bias=bool)  # Phi3's projections have no biases
    d_model, n_heads = require(d, "hidden_size", MT), require(d, "num_attention_heads", MT)
    head_dim = d.get("head_dim") or d_model // n_heads
    n_ctx = d.get("max_position_embeddings", 4096)
    window = d.get("sliding_window")
    act = d.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise NotImplementedError(f"{MT} config sets hidden_act={act!r}; interp supports 'silu'")
    return rms_decoder(d, MT, head_dim=head_dim, n_ctx=n_ctx,
        act_fn="silu",
        norm_eps=d.get("rms_norm_eps", 1e-5),
        **rotary_from_hf(_rope(d), head_dim, n_ctx),
        sliding_window=None if window is None else int(window),
        qkv_bias=False,
        attn_out_bias=False,
        mlp_bias=False,
    )


def _attention(cfg: ModelConfig, get: TensorGetter, p: str, o: str) -> dict:
    """The fused qkv_proj: rows [q | k | v], our column order."""
    return {o + "attn.W_qkv": t(get(p + "self_attn.qkv_proj.weight"))} | linears(get, o, p, {"attn.O": "self_attn.o_proj"})


def _mlp(cfg: ModelConfig, get: TensorGetter, p: str, o: str) -> dict:
    """The fused gate_up_proj: the gate's rows, then the up projection's."""
    gate, up = get(p + "mlp.gate_up_proj.weight").split(cfg.d_mlp)
    return {o + "mlp.W_gate": t(gate), o + "mlp.W_in": t(up)} | linears(get, o, p, {"mlp.out": "mlp.down_proj"})


weights = functools.partial(llama_weights, layer=functools.partial(llama_layer, attention=_attention, mlp=_mlp))


register(Family("phi3", (MT,), config, weights))
