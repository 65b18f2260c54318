"""Small models of our own ModelConfig for the core tests: one per positional scheme and block variant.

Sizes are distinct (d_model 40, 5 heads of 8, d_mlp 56, vocab 53) so a transposed axis cannot pass.
`build` initialises with a large range and perturbs biases and norm weights, so attention patterns
are peaked and a dropped bias or a wrong mask shows in the logits.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

import interp
from interp import HookedTransformer, ModelConfig

VOCAB = 53


def small(**changes) -> ModelConfig:
    base = dict(n_layers=2, d_model=40, n_heads=5, d_vocab=VOCAB, n_ctx=32, d_mlp=56, init_range=0.2)
    return ModelConfig(**{**base, **changes})


# Every positional scheme, and the block variants (parallel, attn-only, no norm, RMSNorm, gated, GQA/MQA, windows).
OWN_CONFIGS: dict[str, ModelConfig] = {
    "learned-layernorm": small(),
    "sinusoidal": small(positional="sinusoidal", act_fn="relu"),
    "rotary-rms-swiglu-gqa": small(positional="rotary", normalization="rmsnorm", act_fn="silu", gated_mlp=True,
                                   d_model=48, n_heads=6, n_kv_heads=2, qkv_bias=False, mlp_bias=False),
    "rotary-partial-parallel": small(positional="rotary", rotary_dim=4, parallel_attn_mlp=True, act_fn="gelu"),
    "alibi-6heads": small(positional="alibi", d_model=48, n_heads=6),  # 6: not a power of two
    "no-positions-attn-only": small(positional=None, d_mlp=None),
    "no-norm-mqa-window": small(positional="rotary", normalization=None, n_kv_heads=1, sliding_window=4),
    "alibi-window-untied-bias": small(positional="alibi", sliding_window=3, unembed_bias=True, n_layers=3),
    "learned-tied-rms": small(normalization="rmsnorm", tie_embeddings=True, attn_out_bias=False),
}

# Gemma 3's block: two local layers (window 4, RoPE base 100) then a global one (base 10000), QK-norm,
# sandwich norms, GeGLU (tanh), scaled and tied embeddings, a query scale that is not 1/sqrt(d_head).
# In OWN_CONFIGS as "gemma3-like", so every test that iterates them runs on it; tests/models/families/test_gemma3.py
# holds its own checks.
GEMMA3_LIKE = small(positional="rotary", normalization="rmsnorm", act_fn="gelu_new", gated_mlp=True, n_layers=3,
                    n_kv_heads=1, sliding_window=4, layer_types=("sliding", "sliding", "full"), rotary_base_local=100.0,
                    qk_norm=True, sandwich_norms=True, embed_scale=40**0.5, tie_embeddings=True, attn_scale=0.3,
                    qkv_bias=False, attn_out_bias=False, mlp_bias=False)
OWN_CONFIGS["gemma3-like"] = GEMMA3_LIKE


def build(cfg: ModelConfig, seed: int = 0) -> HookedTransformer:
    model = HookedTransformer(cfg, seed=seed).eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            leaf = name.rsplit(".", 1)[-1]
            if leaf.startswith("b") or leaf == "w":
                p.add_(torch.randn(p.shape, generator=g) * 0.1)
    return model


@functools.lru_cache(maxsize=None)
def own(name: str) -> HookedTransformer:
    return build(OWN_CONFIGS[name])


def tokens(batch: int, n: int, seed: int = 0, vocab: int = VOCAB) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, vocab, (batch, n), generator=g)


def left_mask(batch: int, n: int) -> torch.Tensor:
    """Row 0 unpadded, row i > 0 left-padded by 2 * i + 1 (at least one real token)."""
    mask = torch.ones(batch, n, dtype=torch.long)
    for i in range(1, batch):
        mask[i, : min(2 * i + 1, n - 1)] = 0
    return mask


def fused_agreeing_with_instrumented(model: HookedTransformer, toks: torch.Tensor, mask: torch.Tensor,
                                     tol: float = 1e-5) -> torch.Tensor:
    """The model's logits on its fused attention path, checked within `tol` of the instrumented path's at every
    real (unmasked) position of `mask`."""
    with torch.no_grad():
        fused = model(toks, attention_mask=mask)
        with model.attention("instrumented"):
            instrumented = model(toks, attention_mask=mask)
    real = mask.bool()[..., None]
    assert float(((fused - instrumented).abs() * real).max()) < tol
    return fused


@functools.lru_cache(maxsize=None)
def hf_pair(name: str):
    """(Hugging Face model, our conversion) for a case of hf_cases.py, built once per test process.

    Shared: never mutate them. Hugging Face's dynamic-NTK rotary keeps state across calls (the
    longest length seen), so tests comparing llama-dynamic with Hugging Face build their own."""
    from hf_cases import build_hf

    hf = build_hf(name)
    return hf, interp.from_hf(hf)


def tiny_gguf(path, arch: str = "llama", edit=None, **metadata):
    """A one-layer llama GGUF file (F32, written with the gguf package). `metadata` overrides the
    numbers written (block_count, embedding_length, head_count, layer_norm_rms_eps, rope_freq_base, ...);
    `edit(name, array)` may change a tensor in place before it is written."""
    import gguf
    import numpy as np

    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(metadata.get("block_count", 1))
    w.add_embedding_length(metadata.get("embedding_length", 8))
    w.add_feed_forward_length(metadata.get("feed_forward_length", 16))
    w.add_head_count(metadata.get("head_count", 2))
    w.add_head_count_kv(metadata.get("head_count_kv", 1))
    w.add_context_length(metadata.get("context_length", 32))
    w.add_layer_norm_rms_eps(metadata.get("layer_norm_rms_eps", 1e-5))
    w.add_rope_freq_base(metadata.get("rope_freq_base", 10000.0))
    w.add_vocab_size(metadata.get("vocab_size", 11))
    rng = np.random.default_rng(0)
    shapes = {"token_embd.weight": (11, 8), "output_norm.weight": (8,), "blk.0.attn_norm.weight": (8,),
              "blk.0.attn_q.weight": (8, 8), "blk.0.attn_k.weight": (4, 8), "blk.0.attn_v.weight": (4, 8),
              "blk.0.attn_output.weight": (8, 8), "blk.0.ffn_norm.weight": (8,), "blk.0.ffn_gate.weight": (16, 8),
              "blk.0.ffn_up.weight": (16, 8), "blk.0.ffn_down.weight": (8, 16)}
    for name, shape in shapes.items():
        array = rng.standard_normal(shape).astype(np.float32)
        if edit is not None:
            edit(name, array)
        w.add_tensor(name, array)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Path(path)


GEOMETRY = ("scale", "window", "alibi_slopes", "softcap", "sink_logits", "causal")


def scored(**kw) -> dict:
    """Keyword arguments for the statistics' entry points with a layer's geometry keywords (written flat in the
    tests' cases: scale=, window=, ...) gathered into the one `scoring=Scoring(...)` those functions take."""
    from interp.kernels import Scoring

    geometry = {k: kw.pop(k) for k in GEOMETRY if k in kw}
    return {**kw, "scoring": Scoring(**geometry)}


def rope_by_hand(v: torch.Tensor, p: int, cfg) -> torch.Tensor:
    """A float64 vector `v` [d_head] rotated to position `p` as rotary models do (halves rotated, NeoX's layout),
    written out; unchanged on a model without rotary positions."""
    if cfg.positional != "rotary":
        return v
    d = v.shape[-1]
    inv = 1.0 / (cfg.rotary_base ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    ang = torch.cat([p * inv, p * inv])
    v1, v2 = v[: d // 2], v[d // 2:]
    return v * ang.cos() + torch.cat([-v2, v1]) * ang.sin()


def whole_and_offloaded(folder: Path, name: str = "rotary-rms-swiglu-gqa"):
    """(the model loaded whole, the same checkpoint offloaded to the CPU, 2 x 8 tokens): one of our configs saved
    into `folder` and read back both ways, for tests that an offloaded model gives the whole model's numbers."""
    build(OWN_CONFIGS[name]).save(folder)
    whole, offloaded = interp.load(folder), interp.load(folder, offload="cpu")
    assert offloaded.offload is not None
    return whole, offloaded, torch.randint(whole.cfg.d_vocab, (2, 8), generator=torch.Generator().manual_seed(0))
