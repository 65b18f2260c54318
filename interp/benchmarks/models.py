"""The models the benchmarks compare: one set of random weights, three implementations.

Every comparison starts from a `transformers` model built from a config (random init, seeded, never
downloaded), converted to ours with `interp.from_hf` and booted into a TransformerLens 4
`TransformerBridge` with `interp.interop.bridge_from_hf` (a deep copy: the bridge edits what it
wraps). So the three hold the same weights and see the same tokens; `max_logit_diff` checks it.

The ablation benchmark runs on the zoo's `rope-gqa-4l`; `zoo_or_random` loads it when it is shipped
and otherwise builds a random model of its recipe's config, and `hf_llama_from_ours` turns either
into a `LlamaForCausalLM` with the same weights for the bridge.
"""

from __future__ import annotations

from typing import Any

import torch

# name -> (transformers config class, model class, config kwargs). GPT-2 small and a Llama of the same
# width (GQA 12 query / 4 key-value heads, RoPE, RMSNorm, SwiGLU); the tiny ones are for --quick.
SHAPES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "gpt2-small": ("GPT2Config", "GPT2LMHeadModel", dict(n_layer=12, n_embd=768, n_head=12, n_positions=2048, vocab_size=50257)),
    "llama-small": ("LlamaConfig", "LlamaForCausalLM", dict(num_hidden_layers=12, hidden_size=768, num_attention_heads=12, num_key_value_heads=4, intermediate_size=2048, vocab_size=32000, max_position_embeddings=4096)),
    "gpt2-tiny": ("GPT2Config", "GPT2LMHeadModel", dict(n_layer=2, n_embd=64, n_head=4, n_positions=256, vocab_size=500)),
    "llama-tiny": ("LlamaConfig", "LlamaForCausalLM", dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128, vocab_size=500, max_position_embeddings=256)),
}
SHAPES["tiny"] = SHAPES["gpt2-tiny"]  # the name `python -m interp.benchmarks.forward` always took


def long_context_shape(n_ctx: int, n_layers: int = 2) -> tuple[str, str, dict[str, Any]]:
    """A small Llama (the zoo's rope-gqa-4l widths: d_model 128, 4 query / 2 key-value heads of 32,
    SwiGLU 256, byte vocabulary) with rotary positions good for `n_ctx` tokens."""
    return ("LlamaConfig", "LlamaForCausalLM", dict(
        num_hidden_layers=n_layers, hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        intermediate_size=256, vocab_size=257, max_position_embeddings=n_ctx, tie_word_embeddings=False,
    ))


def build_hf(shape, attn_implementation: str = "sdpa", dtype: torch.dtype = torch.float32, device="cpu", seed: int = 0):
    """A random-init `transformers` model of `shape` (a SHAPES name or a (config, model, kwargs) triple), eval mode."""
    import transformers

    cfg_cls, model_cls, kwargs = SHAPES[shape] if isinstance(shape, str) else shape
    torch.manual_seed(seed)
    config = getattr(transformers, cfg_cls)(**kwargs, bos_token_id=0, eos_token_id=0)
    config._attn_implementation = attn_implementation
    return getattr(transformers, model_cls)(config).to(device=device, dtype=dtype).eval()


def build_pair(shape, attn_implementation: str = "sdpa", **kwargs):
    """(hf_model, our_model) with identical weights, float32, eval mode."""
    import interp  # imported when the section runs: a section loads only what it measures

    hf = build_hf(shape, attn_implementation, **kwargs)
    return hf, interp.from_hf(hf)


def build_trio(shape, **kwargs):
    """(hf_model, ours, bridge): one set of weights."""
    from interp.interop import bridge_from_hf  # imported when the section runs: a section loads only what it measures

    hf, ours = build_pair(shape, **kwargs)
    return hf, ours, bridge_from_hf(hf)


def set_attention(hf, implementation: str) -> None:
    """Switch a transformers model between "sdpa" and "eager" attention (in place)."""
    if hasattr(hf, "set_attn_implementation"):
        hf.set_attn_implementation(implementation)
    else:  # older transformers: the attention modules read the shared config at call time
        hf.config._attn_implementation = implementation
    if hf.config._attn_implementation != implementation:
        raise RuntimeError(f"could not switch {type(hf).__name__} to {implementation!r} attention")


def release_bridge_state(bridge) -> int:
    """Drop what a TransformerBridge keeps from its last call (the attention bridges hold the last
    pattern and scores of every layer in `_pattern` / `_attn_scores`), so that a memory measurement
    starts from the same clean state as ours. Returns the bytes released."""
    freed = 0
    for module in bridge.modules():
        for attr in ("_pattern", "_attn_scores"):
            t = getattr(module, attr, None)
            if isinstance(t, torch.Tensor):
                freed += t.numel() * t.element_size()
                setattr(module, attr, None)
    return freed


@torch.no_grad()
def max_logit_diff(tokens: torch.Tensor, ours, hf=None, bridge=None) -> float:
    """Largest |logit difference| of ours against HF and the bridge on `tokens` (same weights check)."""
    ref = ours(tokens).float()
    diffs = [0.0]
    if hf is not None:
        diffs.append(float((hf(tokens, use_cache=False).logits.float() - ref).abs().max()))
    if bridge is not None:
        diffs.append(float((bridge(tokens).float() - ref).abs().max()))
    return max(diffs)


# ---- the zoo's modern model, and the same weights as a transformers Llama ----------------------------


def zoo_or_random(name: str = "rope-gqa-4l"):
    """(model, note): the zoo checkpoint `name` when it is shipped, else a random-init model of its
    recipe's config (seed 0), and a note saying which."""
    import interp  # imported when the section runs: a section loads only what it measures
    from interp.models import HookedTransformer
    from interp.models.zoo import resolve
    from interp.models.zoo.recipes import get_recipe

    try:
        path = resolve(name)
    except FileNotFoundError:
        path = None
    if path is not None:
        return interp.load(path).eval(), f"zoo model `{name}` ({path.parent.name}/{path.name})"
    model = HookedTransformer(get_recipe(name).model, seed=0).eval()
    return model, f"`{name}` is not shipped yet: a random-init model of its config (seed 0)"


def hf_llama_from_ours(model):
    """A `LlamaForCausalLM` holding our Llama-like model's weights (RMSNorm, SwiGLU, rotary, no biases),
    checked to give our logits."""
    import transformers

    cfg = model.cfg
    if not (cfg.normalization == "rmsnorm" and cfg.positional == "rotary" and cfg.gated_mlp and cfg.act_fn == "silu"):
        raise ValueError(f"only Llama-like models convert to LlamaForCausalLM, not {cfg.model_type}")
    if cfg.qkv_bias or cfg.attn_out_bias or cfg.mlp_bias or cfg.rope_scaling is not None or cfg.rot_dim != cfg.head_dim:
        raise ValueError("biases, rope scaling and partial rotary are not mapped to LlamaForCausalLM here")
    config = transformers.LlamaConfig(
        num_hidden_layers=cfg.n_layers, hidden_size=cfg.d_model, num_attention_heads=cfg.n_heads,
        num_key_value_heads=cfg.kv_heads, head_dim=cfg.head_dim, intermediate_size=cfg.d_mlp,
        vocab_size=cfg.d_vocab, max_position_embeddings=cfg.n_ctx, rms_norm_eps=cfg.norm_eps,
        rope_theta=cfg.rotary_base, tie_word_embeddings=cfg.tie_embeddings, attention_bias=False, mlp_bias=False,
        bos_token_id=0, eos_token_id=0,
    )
    config._attn_implementation = "sdpa"
    with torch.device("meta"):
        hf = transformers.LlamaForCausalLM(config)
    h, kv, dh = cfg.n_heads, cfg.kv_heads, cfg.head_dim
    sd = {"model.embed_tokens.weight": model.embed.W_E, "model.norm.weight": model.ln_final.w}
    for l, block in enumerate(model.blocks):
        p, a = f"model.layers.{l}.", block.attn
        q, k, v = a.W_qkv.split([h * dh, kv * dh, kv * dh], dim=1)
        sd |= {
            p + "input_layernorm.weight": block.ln1.w, p + "post_attention_layernorm.weight": block.ln2.w,
            p + "self_attn.q_proj.weight": q.T, p + "self_attn.k_proj.weight": k.T, p + "self_attn.v_proj.weight": v.T,
            p + "self_attn.o_proj.weight": a.W_O_flat.T, p + "mlp.gate_proj.weight": block.mlp.W_gate.T,
            p + "mlp.up_proj.weight": block.mlp.W_in.T, p + "mlp.down_proj.weight": block.mlp.W_out.T,
        }
    if not cfg.tie_embeddings:
        sd["lm_head.weight"] = model.unembed.W_U.T
    sd = {k: v.detach().contiguous().clone() for k, v in sd.items()}
    hf.load_state_dict(sd, strict=False, assign=True)
    if cfg.tie_embeddings:
        hf.tie_weights()
    missing = [n for n, p in hf.named_parameters() if p.is_meta]
    if missing:
        raise RuntimeError(f"hf_llama_from_ours left {missing[:4]} unset")
    # Buffers (rotary inv_freq) were created on the meta device: rebuild them on the CPU.
    hf.model.rotary_emb = type(hf.model.rotary_emb)(config=config)
    hf = hf.to(device=model.device, dtype=model.dtype).eval()
    probe = (torch.arange(min(16, cfg.n_ctx), device=model.device) * 31 % cfg.d_vocab)[None]
    with torch.no_grad():
        ref = model(probe)
        err = float((hf(probe).logits - ref).abs().max())
    if not err <= 1e-4 * max(1.0, float(ref.abs().max())):
        raise RuntimeError(f"hf_llama_from_ours: logits differ from ours by {err:.3g}")
    return hf
