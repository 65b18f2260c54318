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
from typing import TYPE_CHECKING

from interp.errors import CheckpointError
from ..config import ModelConfig
from .builders import TensorGetter, linears, llama_layer, llama_weights, reject, require, rms_decoder, rotary_from_hf, t
from .gguf_layout import RMS_KEYS, GGUFLayout
from .registry import Family, register

if TYPE_CHECKING:
    from ..formats.gguf_layouts import Metadata

MT = "phi3"


def _rope(d: dict) -> dict:
    """`d` with its rope parameters as Phi3Config standardises them: a legacy `rope_scaling` replaces
    `rope_parameters`, "su" / "yarn" mean longrope, and the top-level original_max_position_embeddings
    (default 4096) is the one longrope uses, whatever the name. transformers before 5.25 read "su" apart:
    it renamed "su" only after standardising, so an original_max_position_embeddings inside "su"'s own
    parameters won there; 5.25 renames first, and so does this (the name is a spelling, not a variant)."""
    params = dict(d.get("rope_scaling") or d.get("rope_parameters") or {})
    kind = params.get("rope_type", params.get("type"))
    top = d.get("original_max_position_embeddings", 4096)
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


# ---- GGUF: how llama.cpp writes Phi-3 ----
# Phi-3's fused projections, as Hugging Face fuses them: attn_qkv = qkv_proj ([q | k | v] rows) and
# ffn_up = gate_up_proj (gate rows, then up rows).
_GGUF_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_qkv.weight": "self_attn.qkv_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_up.weight": "mlp.gate_up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GGUF_KEYS = RMS_KEYS | {"attention.sliding_window", "rope.scaling.original_context_length",
                          "rope.scaling.attn_factor"}


def _gguf_config(meta: Metadata, base: dict, names: set[str]) -> dict:
    """Phi-3: llama's keys, partial rotary (rope.dimension_count < d_head: Phi-4-mini), and LongRoPE when
    the file holds rope_factors_long / rope_factors_short (one factor per rotated pair; the
    original context in rope.scaling.original_context_length, the attention factor in
    rope.scaling.attn_factor). attention.sliding_window is read and not applied: llama.cpp runs Phi-3
    without a window (its loader turns Phi's window off), and transformers' GGUF loading does too."""
    source = meta.source
    rope = {"rope_type": "default", "rope_theta": meta.real("rope.freq_base", 10000.0)}
    longrope = {"rope_factors_long.weight", "rope_factors_short.weight"} & names
    scaling = meta.get("rope.scaling.type")
    if scaling not in (None, "none", "longrope") or (scaling == "longrope" and not longrope):
        raise NotImplementedError(f"{source}: phi3.rope.scaling.type = {scaling!r} is not supported (LongRoPE is, "
                                  "with its rope_factors_long / rope_factors_short tensors)")
    config = {"hidden_act": "silu", "rope_scaling": None}
    if longrope:
        if len(longrope) == 1:
            raise CheckpointError(f"{source}: the file holds {sorted(longrope)[0]} but not its pair; it is corrupt")
        factors = {name: meta.small_tensor(name) for name in longrope}
        pairs = int(round(base["head_dim"] * base.get("partial_rotary_factor", 1.0))) // 2
        for name, values in factors.items():
            if len(values) != pairs:
                raise CheckpointError(f"{source}: {name} holds {len(values)} factors, not one per rotated pair "
                                      f"({pairs}); the file is corrupt")
        rope |= {"rope_type": "longrope", "long_factor": factors["rope_factors_long.weight"],
                 "short_factor": factors["rope_factors_short.weight"]}
        if meta.has("rope.scaling.attn_factor"):
            rope["attention_factor"] = meta.real("rope.scaling.attn_factor")
        config["original_max_position_embeddings"] = meta.count("rope.scaling.original_context_length")
    return config | {"rope_parameters": rope}


_GGUF = GGUFLayout(MT, _gguf_config, _GGUF_NAMES, permuted_qk=False, known_keys=_GGUF_KEYS,
                   ignored=("rope_factors_long.weight", "rope_factors_short.weight"), partial_rotary=True)


register(Family("phi3", (MT,), config, weights, gguf={"phi3": _GGUF}))
