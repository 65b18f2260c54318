"""Tiny random-init transformers models of the architectures interp runs wrapped (transformers runs them,
through interp's attention function), built from transformers' own config classes: no download.

Sizes are distinct (48 wide, 6 heads of 8, 2 KV heads, MLP 72, vocab 97) so a transposed axis cannot
pass; windows (5) are shorter than the 12-token test sequences, so they are exercised. Special token ids
sit inside the vocabulary."""

from __future__ import annotations

import pytest

VOCAB = 97
BASE = dict(vocab_size=VOCAB, hidden_size=48, num_attention_heads=6, num_key_value_heads=2, num_hidden_layers=2,
            intermediate_size=72, pad_token_id=0, bos_token_id=1, eos_token_id=2)

# model_type -> config overrides (transformers' own key names for that config class)
WRAPPED = {
    "gemma": {},
    "olmo": {"clip_qkv": 0.5},
    "phi": {"partial_rotary_factor": 0.5, "qk_layernorm": True},
    "stablelm": {"partial_rotary_factor": 0.25, "use_parallel_residual": True, "qk_layernorm": True},
    "starcoder2": {"sliding_window": 5, "use_bias": True},
    "cohere": {"logit_scale": 0.5, "use_qk_norm": True},
    "granite": {"embedding_multiplier": 2.0, "attention_multiplier": 0.2, "residual_multiplier": 0.5,
                "logits_scaling": 3.0},
    "qwen2_moe": {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 24,
                  "shared_expert_intermediate_size": 40},
    "olmoe": {"num_experts": 4, "num_experts_per_tok": 2},
    "codegen": dict(n_embd=48, n_head=6, n_layer=2, rotary_dim=4, n_positions=64, n_ctx=64, bos_token_id=1,
                    eos_token_id=2, vocab_size=VOCAB, _replace=True),
    "gpt_bigcode": dict(n_embd=48, n_head=6, n_layer=2, multi_query=True, n_positions=64, bos_token_id=1,
                        eos_token_id=2, vocab_size=VOCAB, _replace=True),
    "exaone": {},
    "glm": {"partial_rotary_factor": 0.5},
    "glm4": {"partial_rotary_factor": 0.5},
    "smollm3": {"no_rope_layer_interval": 2},
    "apertus": {},
    "arcee": {},
    "ministral": {"head_dim": 8, "sliding_window": 5, "layer_types": ["sliding_attention", "full_attention"]},
    "seed_oss": {"attention_bias": True},
    "nemotron": {"partial_rotary_factor": 0.5},
}


def build_wrapped_hf(model_type: str, seed: int = 0):
    """(transformers model, its config) for a WRAPPED case, with biases and norms perturbed so a dropped
    one shows."""
    transformers = pytest.importorskip("transformers")
    import torch
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    kwargs = dict(WRAPPED[model_type])
    kwargs = {k: v for k, v in kwargs.items() if k != "_replace"} if kwargs.get("_replace") else {**BASE, **kwargs}
    config = AutoConfig.for_model(model_type, **kwargs)
    torch.manual_seed(seed)
    model = getattr(transformers, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type])(config).eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("bias") or "norm" in n or "ln" in n:
                p.add_(torch.randn_like(p) * 0.1)
    return model
