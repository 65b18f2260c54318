"""Parity with Hugging Face: the same weights give the same logits.

Every case of `hf_cases.py` (GPT-2, GPT-NeoX/Pythia, Llama with GQA/MQA and the linear / dynamic /
yarn / llama3 rope scalings, Mistral with a sliding window, Qwen2 with qkv biases and per-layer
windows) is converted with `interp.from_hf` and run on both attention backends, without padding,
with left padding (+ attention mask) and with right padding. Sequences are longer than every
sliding window (5) and than llama-dynamic's max_position_embeddings (8), so windows and dynamic
NTK scaling are exercised. `interp.load` reads a directory written by `save_pretrained`.
"""

from __future__ import annotations

import functools

import pytest
import torch

import interp
from interp.kernels.attention import ATTENTION_BACKENDS
from core_models import hf_pair
from hf_cases import CASES, VOCAB, build_hf

N = 12  # > sliding_window (5) and > llama-dynamic's max_position_embeddings (8)
TOL = 1e-4
BACKENDS = list(ATTENTION_BACKENDS)  # every registered backend
WINDOWED = [n for n in CASES if n.startswith(("mistral", "qwen2"))]


@functools.lru_cache(maxsize=None)
def pair(name: str):
    """(hf model, our model) for a case. llama-dynamic gets its own: every test here runs sequences of
    length N, so Hugging Face's stateful dynamic-NTK frequencies are the same in every call."""
    if name != "llama-dynamic":
        return hf_pair(name)
    hf = build_hf(name)
    return hf, interp.from_hf(hf)


def tokens(batch: int = 3, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, VOCAB, (batch, N), generator=g)


def left_mask() -> torch.Tensor:
    mask = torch.ones(3, N, dtype=torch.long)
    mask[1, :4] = 0
    mask[2, : N - 3] = 0  # only 3 real tokens
    return mask


def max_diff_on_real(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> float:
    return float(((a - b).abs() * mask[..., None]).max())


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", list(CASES))
def test_logits_match_hf(name, backend):
    hf, model = pair(name)
    toks = tokens()
    with torch.no_grad():
        ref = hf(toks).logits
        with model.attention(backend):
            out = model(toks)
    assert out.shape == ref.shape
    assert float((out - ref).abs().max()) < TOL
    assert ref.abs().max() > 1e-2  # a meaningful comparison, not two zero tensors


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", list(CASES))
def test_left_padding_matches_hf(name, backend):
    hf, model = pair(name)
    toks, mask = tokens(), left_mask()
    # Hugging Face does not derive positions from the mask in forward(); give them explicitly.
    position_ids = (mask.cumsum(1) - 1).clamp(min=0)
    with torch.no_grad():
        ref = hf(toks, attention_mask=mask, position_ids=position_ids).logits
        with model.attention(backend):
            out = model(toks, attention_mask=mask)
    assert max_diff_on_real(out, ref, mask) < TOL
    # Each left-padded row equals that row run alone, unpadded.
    with torch.no_grad(), model.attention(backend):
        for row in (1, 2):
            alone = model(toks[row, mask[row].bool()][None])
            assert float((alone[0] - out[row, mask[row].bool()]).abs().max()) < TOL


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", list(CASES))
def test_right_padding_matches_hf(name, backend):
    hf, model = pair(name)
    toks, mask = tokens(), left_mask().flip(1)
    with torch.no_grad():
        ref = hf(toks, attention_mask=mask).logits
        with model.attention(backend):
            out = model(toks, attention_mask=mask)
    assert max_diff_on_real(out, ref, mask) < TOL


@pytest.mark.parametrize("name", WINDOWED)
def test_sliding_window_is_exercised(name):
    """Guard for the tests above: dropping the window changes the logits, so they do check it."""
    hf, model = pair(name)
    assert model.cfg.sliding_window is not None and model.cfg.sliding_window < N
    toks = tokens()
    saved = [b.attn.window for b in model.blocks]
    try:
        for b in model.blocks:
            b.attn.window = None
        with torch.no_grad():
            out = model(toks)
    finally:
        for b, w in zip(model.blocks, saved):
            b.attn.window = w
    with torch.no_grad():
        assert float((out - hf(toks).logits).abs().max()) > 1e-3


def test_qwen2_per_layer_windows():
    hf, model = pair("qwen2-window-layers")
    assert [b.attn.window for b in model.blocks] == [None, 5, 5]  # max_window_layers=1


# One case per family: a checkpoint directory written by Hugging Face loads without transformers' help.
FAMILY_CASES = ["gpt2", "neox", "llama-gqa", "mistral-window", "qwen2-window-layers",
                "gemma2", "gptj", "bloom", "olmo2"]  # families B
FAMILY_CASES += ["qwen3-qknorm-window", "phi3-longrope", "gpt-neo-local", "opt", "falcon-40b-style", "mpt", "xglm"]  # families A
FAMILY_CASES += ["mixtral-window", "qwen2-moe-shared", "qwen3-moe-window", "olmoe", "gpt-oss"]  # families C


@pytest.mark.parametrize("name", FAMILY_CASES)
def test_load_hf_directory(name, tmp_path):
    hf, _ = pair(name)
    hf.save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors").exists()
    model = interp.load(tmp_path)
    toks = tokens()
    with torch.no_grad():
        assert float((model(toks) - hf(toks).logits).abs().max()) < TOL


def test_load_sharded_hf_directory(tmp_path):
    hf, _ = pair("llama-gqa")
    hf.save_pretrained(tmp_path, max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    assert not (tmp_path / "model.safetensors").exists()
    model = interp.load(tmp_path)
    toks = tokens()
    with torch.no_grad():
        assert float((model(toks) - hf(toks).logits).abs().max()) < TOL


@pytest.mark.parametrize("name", list(CASES))
def test_patterns_match_hf_attention_weights_per_head(name):
    """Cached patterns equal Hugging Face's eager attention weights head by head, so head indices mean
    the same thing in both (a consistent permutation of heads would leave the logits unchanged)."""
    hf, model = pair(name)
    toks, mask = tokens(), left_mask()
    position_ids = (mask.cumsum(1) - 1).clamp(min=0)
    saved = hf.config._attn_implementation
    hf.set_attn_implementation("eager")  # the only implementation that returns the weights
    try:
        with torch.no_grad():
            ref = hf(toks, attention_mask=mask, position_ids=position_ids, output_attentions=True).attentions
    finally:
        hf.set_attn_implementation(saved)
    _, cache = model.run_with_cache(toks, attention_mask=mask, names_filter=lambda n: n.endswith("hook_pattern"))
    real_queries = mask.bool()[:, None, :, None]
    for layer in range(model.cfg.n_layers):
        assert float(((cache["pattern", layer] - ref[layer]).abs() * real_queries).max()) < 1e-5


def test_load_pytorch_model_bin_directory(tmp_path):
    """Older checkpoints: config.json + pytorch_model.bin (read with weights_only=True)."""
    hf, _ = pair("neox")
    hf.config.save_pretrained(tmp_path)
    torch.save(hf.state_dict(), tmp_path / "pytorch_model.bin")
    model = interp.load(tmp_path)
    toks = tokens()
    with torch.no_grad():
        assert float((model(toks) - hf(toks).logits).abs().max()) < TOL


ROPE_SCALINGS = [
    {"rope_type": "linear", "factor": 3.0},
    {"rope_type": "dynamic", "factor": 2.0},
    {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 512},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256, "beta_fast": 16.0, "beta_slow": 2.0, "attention_factor": 1.25},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 512},
    {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 2.0, "high_freq_factor": 8.0, "original_max_position_embeddings": 64},
]


@pytest.mark.parametrize("scaling", ROPE_SCALINGS, ids=lambda s: "-".join(str(v) for v in s.values()))
def test_rope_frequencies_match_hf(scaling):
    """Inverse frequencies and the cos/sin scale for a realistic head (64 dims, base 500000), against
    transformers' own ROPE_INIT_FUNCTIONS: every regime of every scaling is hit (the tiny models of
    hf_cases.py have 4 frequencies, too few to reach, e.g., llama3's unscaled high frequencies)."""
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from interp.models.families import get_family
    from interp.models.positions import rope_frequencies

    kwargs = dict(hidden_size=256, num_attention_heads=4, num_hidden_layers=1, intermediate_size=64, vocab_size=10,
                  max_position_embeddings=1024, rope_theta=500000.0, rope_scaling=dict(scaling))
    hf_cfg = transformers.LlamaConfig(**kwargs)
    ours = get_family("llama").config(hf_cfg.to_dict())
    for seq_len in ([None, 2048, 4096] if scaling["rope_type"] == "dynamic" else [None]):
        ref_inv, ref_scale = ROPE_INIT_FUNCTIONS[scaling["rope_type"]](hf_cfg, "cpu", seq_len=seq_len)
        inv, scale = rope_frequencies(ours, seq_len)
        torch.testing.assert_close(inv, ref_inv.float(), rtol=1e-6, atol=0)
        assert scale == pytest.approx(ref_scale)
