"""Our checkpoint format: `model.save(dir)` / `interp.load(dir)` round-trips exactly."""

from __future__ import annotations

import json

import pytest
import torch

import interp
from core_models import OWN_CONFIGS, hf_pair, left_mask, own, tokens

N = 9


@pytest.mark.parametrize("name", ["rotary-rms-swiglu-gqa", "rotary-partial-parallel", "alibi-window-untied-bias", "sinusoidal", "learned-tied-rms", "no-positions-attn-only"])
def test_round_trip_gives_identical_logits(name, tmp_path):
    model = own(name)
    model.save(tmp_path)
    assert {p.name for p in tmp_path.iterdir()} >= {"config.json", "model.safetensors"}
    assert json.loads((tmp_path / "config.json").read_text())["interp_format"] == 1
    loaded = interp.load(tmp_path)
    assert loaded.cfg == model.cfg
    assert not loaded.training
    toks, mask = tokens(2, N), left_mask(2, N)
    with torch.no_grad():
        assert torch.equal(loaded(toks, attention_mask=mask), model(toks, attention_mask=mask))
    for (k, a), (k2, b) in zip(model.state_dict().items(), loaded.state_dict().items()):
        assert k == k2 and torch.equal(a, b), k
    # Buffers that are not saved (rotary frequencies, sinusoidal table, ALiBi slopes) are rebuilt.
    for (k, a), (_, b) in zip(model.named_buffers(), loaded.named_buffers()):
        assert torch.equal(a, b), k
    if model.cfg.tie_embeddings:
        assert loaded.unembed.W_U.data_ptr() == loaded.embed.W_E.data_ptr()  # still shared, not copied


def test_fp16_storage_loads_back_as_float32(tmp_path):
    model = own("rotary-rms-swiglu-gqa")
    interp.save_model(model, tmp_path, dtype=torch.float16)
    from safetensors import safe_open

    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as f:
        assert all(f.get_tensor(k).dtype == torch.float16 for k in f.keys())
    size16 = (tmp_path / "model.safetensors").stat().st_size
    loaded = interp.load(tmp_path)
    assert loaded.dtype == torch.float32 and all(p.dtype == torch.float32 for p in loaded.parameters())
    for (k, a), (_, b) in zip(model.state_dict().items(), loaded.state_dict().items()):
        torch.testing.assert_close(b, a.half().float(), rtol=0, atol=0, msg=k)  # exactly the fp16 rounding
    toks = tokens(2, N)
    with torch.no_grad():
        ref, out = model(toks), loaded(toks)
    assert float((out - ref).abs().max()) < 1e-2 * float(ref.abs().max())
    interp.save_model(model, tmp_path / "f32")
    assert (tmp_path / "f32" / "model.safetensors").stat().st_size > 1.9 * size16


def test_load_in_another_dtype(tmp_path):
    model = own("learned-layernorm")
    model.save(tmp_path)
    loaded = interp.load(tmp_path, dtype=torch.bfloat16)
    assert loaded.dtype == torch.bfloat16
    toks = tokens(2, N)
    with torch.no_grad():
        assert float((loaded(toks).float() - model(toks)).abs().max()) < 0.1


def test_meta_is_written_and_load_accepts_the_weights_file(tmp_path):
    model = own("sinusoidal")
    interp.save_model(model, tmp_path, meta={"run": "test", "step": 3})
    assert json.loads((tmp_path / "meta.json").read_text()) == {"run": "test", "step": 3}
    loaded = interp.load(tmp_path / "model.safetensors")  # the file instead of its directory
    toks = tokens(1, N)
    with torch.no_grad():
        assert torch.equal(loaded(toks), model(toks))


def test_hf_conversion_saved_in_our_format(tmp_path):
    hf, model = hf_pair("qwen2-window-layers")
    model.save(tmp_path)
    loaded = interp.load(tmp_path)
    assert loaded.cfg.layer_types == ("full", "sliding", "sliding") and loaded.cfg.qkv_bias
    toks = tokens(2, 12, vocab=model.cfg.d_vocab)
    with torch.no_grad():
        assert float((loaded(toks) - hf(toks).logits).abs().max()) < 1e-4


def test_saving_overwrites_atomically(tmp_path):
    a, b = own("learned-layernorm"), own("learned-tied-rms")
    a.save(tmp_path)
    b.save(tmp_path)
    assert not list(tmp_path.glob("*.tmp"))
    assert interp.load(tmp_path).cfg == OWN_CONFIGS["learned-tied-rms"]
