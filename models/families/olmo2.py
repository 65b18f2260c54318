"""OLMo 2 (OLMo Team 2024; Hugging Face `model_type` "olmo2"): a Llama-like model (RMSNorm, SwiGLU,
rotary, GQA, no biases) whose norms sit only AFTER attention and MLP (x + ln1_post(attn(x)), then
x + ln2_post(mlp(x)): `pre_norms=False` with sandwich norms; TransformerLens's names), and whose
QK-norm is one RMSNorm over the whole query projection (n_heads * d_head) and one over the whole key
projection (kv_heads * d_head), before RoPE (`qk_norm_over="projection"`), not one per head.

Defaults for absent keys are Hugging Face's (`Olmo2Config`). What this model cannot represent raises,
naming the key.
"""

from __future__ import annotations

from ..config import ModelConfig
from .registry import Family, TensorGetter, qkv, register, reject, require, rms_decoder, rotary_from_hf, t

MT = "olmo2"


def config(d: dict) -> ModelConfig:
    reject(d, MT, attention_bias=bool)
    d_model, n_heads = require(d, "hidden_size", MT), require(d, "num_attention_heads", MT)
    head_dim = d_model // n_heads  # Olmo2Attention: the config's head_dim, which Olmo2Config does not have
    if d.get("head_dim") not in (None, head_dim):
        raise NotImplementedError(f"{MT} config sets head_dim={d['head_dim']!r}; interp supports hidden_size // "
                                  "num_attention_heads")
    n_ctx = d.get("max_position_embeddings", 2048)
    rotary = rotary_from_hf(d, head_dim, n_ctx)
    if rotary["rotary_dim"] != head_dim:
        raise NotImplementedError(f"{MT} config asks for partial rotary; interp supports rotary over the whole head")
    return rms_decoder(d, MT, head_dim=head_dim, n_ctx=n_ctx,
        act_fn=d.get("hidden_act", "silu"),
        norm_eps=d.get("rms_norm_eps", 1e-5),
        **rotary,
        qk_norm=True,
        qk_norm_over="projection",
        sandwich_norms=True,
        pre_norms=False,
        qkv_bias=False,
        attn_out_bias=False,
        mlp_bias=False,
    )


def weights(cfg: ModelConfig, get: TensorGetter) -> dict:
    sd = {"embed.W_E": get("model.embed_tokens.weight")}
    for l in range(cfg.n_layers):
        p, o = f"model.layers.{l}.", f"blocks.{l}."
        a, m = p + "self_attn.", p + "mlp."
        sd |= {
            o + "attn.W_qkv": qkv(get(a + "q_proj.weight"), get(a + "k_proj.weight"), get(a + "v_proj.weight")),
            o + "attn.q_norm.w": get(a + "q_norm.weight"),
            o + "attn.k_norm.w": get(a + "k_norm.weight"),
            o + "attn.W_O_flat": t(get(a + "o_proj.weight")),
            o + "ln1_post.w": get(p + "post_attention_layernorm.weight"),
            o + "mlp.W_gate": t(get(m + "gate_proj.weight")),
            o + "mlp.W_in": t(get(m + "up_proj.weight")),
            o + "mlp.W_out": t(get(m + "down_proj.weight")),
            o + "ln2_post.w": get(p + "post_feedforward_layernorm.weight"),
        }
    sd["ln_final.w"] = get("model.norm.weight")
    if not cfg.tie_embeddings:
        sd["unembed.W_U"] = t(get("lm_head.weight"))
    return sd


register(Family("olmo2", (MT,), config, weights))
