"""Small random-init Hugging Face models, one per family and variant, built from configs (no downloads)."""

from __future__ import annotations

import pytest

VOCAB = 97

# name -> (config class, model class, config kwargs). Sizes are distinct so a transposition cannot pass.
CASES = {
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", dict(n_layer=2, n_embd=40, n_head=5, n_positions=64, bos_token_id=0, eos_token_id=0)),
    "gpt2-untied": ("GPT2Config", "GPT2LMHeadModel", dict(n_layer=2, n_embd=40, n_head=5, n_positions=64, tie_word_embeddings=False, bos_token_id=0, eos_token_id=0)),
    "neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM", dict(num_hidden_layers=2, hidden_size=40, num_attention_heads=5, intermediate_size=72, bos_token_id=0, eos_token_id=0)),
    "neox-sequential": ("GPTNeoXConfig", "GPTNeoXForCausalLM", dict(num_hidden_layers=2, hidden_size=40, num_attention_heads=5, intermediate_size=72, use_parallel_residual=False, rope_parameters={"rope_type": "default", "rope_theta": 500.0, "partial_rotary_factor": 0.5}, bos_token_id=0, eos_token_id=0)),
    "llama-gqa": ("LlamaConfig", "LlamaForCausalLM", dict(num_hidden_layers=2, hidden_size=48, num_attention_heads=6, num_key_value_heads=2, intermediate_size=72)),
    "llama-mqa-yarn": ("LlamaConfig", "LlamaForCausalLM", dict(num_hidden_layers=2, hidden_size=48, num_attention_heads=6, num_key_value_heads=1, intermediate_size=72, max_position_embeddings=64, rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16})),
    "llama-linear-tied": ("LlamaConfig", "LlamaForCausalLM", dict(num_hidden_layers=2, hidden_size=48, num_attention_heads=6, num_key_value_heads=3, intermediate_size=72, tie_word_embeddings=True, rope_scaling={"rope_type": "linear", "factor": 2.0})),
    "llama-dynamic": ("LlamaConfig", "LlamaForCausalLM", dict(num_hidden_layers=2, hidden_size=48, num_attention_heads=6, num_key_value_heads=3, intermediate_size=72, max_position_embeddings=8, rope_scaling={"rope_type": "dynamic", "factor": 2.0})),
    "llama-llama3-bias": ("LlamaConfig", "LlamaForCausalLM", dict(num_hidden_layers=2, hidden_size=48, num_attention_heads=6, num_key_value_heads=3, intermediate_size=72, attention_bias=True, mlp_bias=True, rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 16})),
    "mistral-window": ("MistralConfig", "MistralForCausalLM", dict(num_hidden_layers=2, hidden_size=48, num_attention_heads=6, num_key_value_heads=2, intermediate_size=72, sliding_window=5)),
    "qwen2-window-layers": ("Qwen2Config", "Qwen2ForCausalLM", dict(num_hidden_layers=3, hidden_size=48, num_attention_heads=6, num_key_value_heads=2, intermediate_size=72, use_sliding_window=True, sliding_window=5, max_window_layers=1)),
    "gemma3-text": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(num_hidden_layers=3, hidden_size=48, num_attention_heads=6, num_key_value_heads=2, head_dim=8, intermediate_size=72, sliding_window=5, layer_types=["sliding_attention", "sliding_attention", "full_attention"], query_pre_attn_scalar=10, max_position_embeddings=64)),
    # --- cases A ---
    # --- cases B ---
    # --- cases C ---
}


def build_hf(name: str, seed: int = 0):
    transformers = pytest.importorskip("transformers")
    import torch

    cfg_cls, model_cls, kwargs = CASES[name]
    torch.manual_seed(seed)
    config = getattr(transformers, cfg_cls)(vocab_size=VOCAB, **kwargs)
    model = getattr(transformers, model_cls)(config).eval()
    # Random init leaves biases and norm weights at 0 / 1; perturb them so a dropped bias shows.
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("bias") or "norm" in n or "ln" in n:
                p.add_(torch.randn_like(p) * 0.1)
    return model
