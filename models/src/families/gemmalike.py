"""What Gemma 2 and Gemma 3 share (Gemma Team 2024, 2025), built once: sliding-window ("local") layers
between full ("global") ones; sandwich norms (RMSNorm before and after attention and MLP); GeGLU with
GELU's tanh approximation; embeddings scaled by sqrt(d_model); queries scaled by
query_pre_attn_scalar ** -0.5; a tied unembedding. `gemma2.py` and `gemma3.py` give what differs as
data: which layers are local, the RoPE bases, QK-norm (Gemma 3), soft-capping (Gemma 2).

Hugging Face stores every Gemma norm weight as w with the norm multiplying by (1 + w); we store the
whole multiplier (1 + w, computed in float32 as Hugging Face computes it), as TransformerLens does, so
our norms, weight folding and views stay the plain RMSNorm ones.
"""

from __future__ import annotations

import functools
from typing import Any

from ..config import ModelConfig
from .builders import llama_attention, llama_layer, llama_weights, require, rms_decoder

ACTIVATIONS = {"gelu_pytorch_tanh": "gelu_new", "gelu_new": "gelu_new", "gelu": "gelu", "gelu_fast": "gelu_fast"}
LAYER_TYPES = {"sliding_attention": "sliding", "full_attention": "full"}
HEAD_DIM = 256  # Hugging Face's default head_dim for both


def layer_types(d: dict, mt: str, n_layers: int, every: Any) -> tuple[str, ...]:
    """From `layer_types`, else every `every`-th layer full, the others sliding (Gemma 2: every other
    layer; Gemma 3: `sliding_window_pattern`, Hugging Face's default 6)."""
    if d.get("layer_types") is not None:
        unknown = sorted(set(d["layer_types"]) - set(LAYER_TYPES))
        if unknown:
            raise NotImplementedError(f"{mt} config sets layer_types {unknown}; interp knows {sorted(LAYER_TYPES)}")
        return tuple(LAYER_TYPES[k] for k in d["layer_types"])
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise ValueError(f"{mt} config sets sliding_window_pattern={every!r}; it must be an integer >= 1")
    return tuple("full" if (l + 1) % every == 0 else "sliding" for l in range(n_layers))


def config(d: dict, mt: str, *, layer_types: tuple[str, ...], rotary: dict[str, Any], rotary_base_local: float | None,
           n_ctx: int, qk_norm: bool, attn_softcap: float | None, final_softcap: float | None) -> ModelConfig:
    """The ModelConfig of a Gemma config dict `d`, given what its family reads differently."""
    d_model = require(d, "hidden_size", mt)
    head_dim = d.get("head_dim") or HEAD_DIM
    act = d.get("hidden_activation", d.get("hidden_act")) or "gelu_pytorch_tanh"
    if act not in ACTIVATIONS:
        raise NotImplementedError(f"{mt} config sets hidden_activation={act!r}; interp supports {sorted(ACTIVATIONS)}")
    window = d.get("sliding_window", 4096)
    if window is None and "sliding" in layer_types:
        raise NotImplementedError(f"{mt} config has sliding_attention layers but sliding_window=None "
                                  "(full attention with the local RoPE base), which interp does not represent")
    if rotary["rotary_dim"] != head_dim:
        raise NotImplementedError(f"{mt} config asks for partial rotary; interp supports rotary over the whole head")
    bias = bool(d.get("attention_bias", False))
    return rms_decoder(d, mt, head_dim=head_dim, n_ctx=n_ctx,
        n_kv_heads=d.get("num_key_value_heads", 4),
        act_fn=ACTIVATIONS[act],
        norm_eps=d.get("rms_norm_eps", 1e-6),
        **rotary,
        rotary_base_local=rotary_base_local,
        sliding_window=None if window is None else int(window),
        layer_types=layer_types,
        qk_norm=qk_norm,
        sandwich_norms=True,
        attn_scores_soft_cap=None if attn_softcap is None else float(attn_softcap),
        output_logits_soft_cap=None if final_softcap is None else float(final_softcap),
        qkv_bias=bias,
        attn_out_bias=bias,
        mlp_bias=False,
        tie_embeddings=bool(d.get("tie_word_embeddings", True)),
        embed_scale=d_model**0.5,
        attn_scale=d.get("query_pre_attn_scalar", 256) ** -0.5,
    )


# Gemma's block norms, ours -> theirs: before and after attention, before and after the MLP.
NORMS = {"ln1": "input_layernorm", "ln1_post": "post_attention_layernorm", "ln2": "pre_feedforward_layernorm",
         "ln2_post": "post_feedforward_layernorm"}
# Every Gemma norm weight (the QK-norms' too) is stored as w for a multiplier 1 + w.
weights = functools.partial(llama_weights, shift=1.0, layer=functools.partial(
    llama_layer, block_norms=NORMS, shift=1.0, attention=functools.partial(llama_attention, shift=1.0)))


# ---- GGUF: the tensor names llama.cpp gives both Gemmas: a norm before and after attention and MLP
# (llama.cpp's ffn_norm is Gemma's pre_feedforward_layernorm here, not a llama post_attention_layernorm);
# Gemma 3 adds its QK-norm.
GGUF_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
}
