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

from typing import Any

from ..config import ModelConfig
from .registry import TensorGetter, qkv, require, rms_decoder, t

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
            o + "attn.W_O_flat": t(get(a + "o_proj.weight")),
            o + "ln1_post.w": _norm(get, p + "post_attention_layernorm.weight"),
            o + "ln2.w": _norm(get, p + "pre_feedforward_layernorm.weight"),
            o + "mlp.W_gate": t(get(m + "gate_proj.weight")),
            o + "mlp.W_in": t(get(m + "up_proj.weight")),
            o + "mlp.W_out": t(get(m + "down_proj.weight")),
            o + "ln2_post.w": _norm(get, p + "post_feedforward_layernorm.weight"),
        }
        if cfg.qk_norm:
            sd[o + "attn.q_norm.w"] = _norm(get, a + "q_norm.weight")
            sd[o + "attn.k_norm.w"] = _norm(get, a + "k_norm.weight")
        if cfg.qkv_bias:
            sd[o + "attn.b_qkv"] = qkv(get(a + "q_proj.bias")[:, None], get(a + "k_proj.bias")[:, None],
                                       get(a + "v_proj.bias")[:, None])[0]
        if cfg.attn_out_bias:
            sd[o + "attn.b_O"] = get(a + "o_proj.bias")
    sd["ln_final.w"] = _norm(get, "model.norm.weight")
    if not cfg.tie_embeddings:
        sd["unembed.W_U"] = t(get("lm_head.weight"))
    return sd
