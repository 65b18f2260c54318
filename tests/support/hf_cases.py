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
    "qwen3-qknorm-window": ("Qwen3Config", "Qwen3ForCausalLM", dict(num_hidden_layers=3, hidden_size=48, num_attention_heads=6, num_key_value_heads=2, head_dim=10, intermediate_size=72, use_sliding_window=True, sliding_window=5, max_window_layers=1)),
    "phi3-partial-window": ("Phi3Config", "Phi3ForCausalLM", dict(num_hidden_layers=2, hidden_size=48, num_attention_heads=6, num_key_value_heads=2, intermediate_size=72, sliding_window=5, rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}, pad_token_id=0, bos_token_id=1, eos_token_id=2)),
    # original_max_position_embeddings=2 < every row's length (even the 3-token left-padded one alone): long factors throughout
    "phi3-longrope": ("Phi3Config", "Phi3ForCausalLM", dict(num_hidden_layers=2, hidden_size=48, num_attention_heads=6, num_key_value_heads=3, intermediate_size=72, max_position_embeddings=32, original_max_position_embeddings=2, rope_scaling={"rope_type": "longrope", "short_factor": [1.0, 1.3, 1.9, 2.6], "long_factor": [1.1, 2.3, 4.7, 9.5]}, pad_token_id=0, bos_token_id=1, eos_token_id=2)),
    "gpt-neo-local": ("GPTNeoConfig", "GPTNeoForCausalLM", dict(num_layers=3, hidden_size=40, num_heads=5, intermediate_size=72, attention_types=[[["local", "global"], 1], [["local"], 1]], window_size=5, max_position_embeddings=64, bos_token_id=0, eos_token_id=0)),
    "opt": ("OPTConfig", "OPTForCausalLM", dict(num_hidden_layers=2, hidden_size=40, num_attention_heads=5, ffn_dim=72, max_position_embeddings=64)),
    "opt-nobias-untied": ("OPTConfig", "OPTForCausalLM", dict(num_hidden_layers=2, hidden_size=40, num_attention_heads=5, ffn_dim=72, max_position_embeddings=64, enable_bias=False, tie_word_embeddings=False)),
    # Falcon's attention implementation cannot be switched after building (no attention interface), and its
    # sdpa-built model adds a boolean mask to the scores it returns: built eager, so output_attentions is right.
    "falcon-7b-style": ("FalconConfig", "FalconForCausalLM", dict(num_hidden_layers=2, hidden_size=48, num_attention_heads=6, ffn_hidden_size=72, multi_query=True, parallel_attn=True, bias=False, bos_token_id=0, eos_token_id=0, attn_implementation="eager")),
    "falcon-40b-style": ("FalconConfig", "FalconForCausalLM", dict(num_hidden_layers=2, hidden_size=48, num_attention_heads=6, num_kv_heads=2, ffn_hidden_size=72, new_decoder_architecture=True, multi_query=False, parallel_attn=True, bias=True, bos_token_id=0, eos_token_id=0, attn_implementation="eager")),
    "falcon-sequential": ("FalconConfig", "FalconForCausalLM", dict(num_hidden_layers=2, hidden_size=48, num_attention_heads=6, ffn_hidden_size=72, multi_query=False, parallel_attn=False, bias=True, rope_parameters={"rope_type": "default", "rope_theta": 500.0}, bos_token_id=0, eos_token_id=0, attn_implementation="eager")),
    "mpt": ("MptConfig", "MptForCausalLM", dict(n_layers=2, d_model=48, n_heads=6, max_seq_len=64, attn_config={"softmax_scale": 0.29})),
    "xglm": ("XGLMConfig", "XGLMForCausalLM", dict(num_layers=2, d_model=40, attention_heads=5, ffn_dim=72, max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2)),
    # --- cases B ---
    # Gemma 2: caps small enough (3 on scores, 4 on logits, weights of range 0.2) that tanh bends them
    # (tests/models/families/test_softcap_interleaved_and_norm_families.py checks that dropping either cap changes the logits); window 5 < 12.
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", dict(num_hidden_layers=3, hidden_size=48, num_attention_heads=4, num_key_value_heads=2, head_dim=20, intermediate_size=72, sliding_window=5, query_pre_attn_scalar=17, attn_logit_softcapping=3.0, final_logit_softcapping=4.0, max_position_embeddings=64, initializer_range=0.2, rope_parameters={"rope_type": "default", "rope_theta": 1000.0}, pad_token_id=0, bos_token_id=1, eos_token_id=2)),
    "gptj": ("GPTJConfig", "GPTJForCausalLM", dict(n_layer=2, n_embd=48, n_head=6, rotary_dim=4, n_inner=72, n_positions=64, initializer_range=0.2, bos_token_id=0, eos_token_id=0)),  # weights large enough that the rotary layout shows
    "bloom": ("BloomConfig", "BloomForCausalLM", dict(n_layer=2, hidden_size=40, n_head=5, bos_token_id=0, eos_token_id=0)),  # 5 heads: not a power of two
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", dict(num_hidden_layers=2, hidden_size=48, num_attention_heads=6, num_key_value_heads=2, intermediate_size=72, max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2)),
    # --- cases C ---
    # Mixtures of experts: 4-5 experts of width 24, 2-3 chosen per token; windows of 5 < 12.
    "mixtral-window": ("MixtralConfig", "MixtralForCausalLM", dict(num_hidden_layers=2, hidden_size=48, num_attention_heads=6, num_key_value_heads=2, intermediate_size=24, num_local_experts=4, num_experts_per_tok=2, sliding_window=5, max_position_embeddings=64)),
    "qwen2-moe-shared": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", dict(num_hidden_layers=2, hidden_size=48, num_attention_heads=6, num_key_value_heads=2, intermediate_size=72, moe_intermediate_size=24, shared_expert_intermediate_size=40, num_experts=5, num_experts_per_tok=2, use_sliding_window=True, sliding_window=5, max_position_embeddings=64)),
    "qwen3-moe-window": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(num_hidden_layers=2, hidden_size=48, num_attention_heads=6, num_key_value_heads=2, head_dim=10, intermediate_size=72, moe_intermediate_size=24, num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, use_sliding_window=True, sliding_window=5, max_position_embeddings=64)),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM", dict(num_hidden_layers=2, hidden_size=48, num_attention_heads=6, num_key_value_heads=2, intermediate_size=24, num_experts=4, num_experts_per_tok=3, max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2)),
    # gpt-oss: learned sinks, sliding (5) and full layers alternating, YaRN without truncation, router bias,
    # experts' clamped SwiGLU with a limit (0.1) small enough that the clamps bite at this init.
    "gpt-oss": ("GptOssConfig", "GptOssForCausalLM", dict(num_hidden_layers=3, hidden_size=48, num_attention_heads=6, num_key_value_heads=2, head_dim=8, intermediate_size=24, num_local_experts=4, num_experts_per_tok=2, sliding_window=5, swiglu_limit=0.1, max_position_embeddings=64, rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False, "rope_theta": 1000.0})),
}


def build_hf(name: str, seed: int = 0):
    """The case `name` of CASES, built by `build_hf_from`."""
    cfg_cls, model_cls, kwargs = CASES[name]
    return build_hf_from(cfg_cls, model_cls, seed, **kwargs)


def build_hf_from(cfg_cls: str, model_cls: str, seed: int = 0, **kwargs):
    """A tiny random transformers model (eval mode) from the names of its config and model classes and the
    config's kwargs (the vocabulary VOCAB), seeded by `seed`."""
    transformers = pytest.importorskip("transformers")
    import torch

    torch.manual_seed(seed)
    config = getattr(transformers, cfg_cls)(vocab_size=VOCAB, **kwargs)
    model = getattr(transformers, model_cls)(config).eval()
    # Random init leaves biases and norm weights at 0 / 1; perturb them so a dropped bias shows.
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("bias") or "norm" in n or "ln" in n:
                p.add_(torch.randn_like(p) * 0.1)
    return model
