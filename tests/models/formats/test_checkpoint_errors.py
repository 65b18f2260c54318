"""Bad input raises an error that says what is wrong and what to do."""

from __future__ import annotations

import json

import pytest
import torch

import interp
from core_models import hf_pair, own, tokens
from interp import CheckpointError

N = 6


@pytest.fixture(scope="module")
def model():
    return own("learned-layernorm")  # vocab 53, n_ctx 32


@pytest.mark.parametrize(
    "bad, error, message",
    [
        (torch.tensor([[1, 53]]), ValueError, r"token ids must lie in \[0, 53\).*\[53\]"),
        (torch.tensor([[-1, 2]]), ValueError, r"token ids must lie in \[0, 53\).*\[-1\]"),
        (torch.zeros(1, 33, dtype=torch.long), ValueError, r"sequence too long.*n_ctx=32.*truncate"),
        (torch.rand(1, 4), TypeError, r"integer tensor of token ids, got torch.float32.*start_at_layer"),
        (torch.ones(1, 4, dtype=torch.bool), TypeError, r"integer tensor of token ids, got torch.bool"),
        (torch.ones(1, 2, 3, dtype=torch.long), ValueError, r"tokens must be \[batch, pos\]"),
        (torch.ones(1, 0, dtype=torch.long), ValueError, r"at least one position"),
        ("some text", ValueError, r"no tokenizer.*model.tokenizer = tok"),
    ],
    ids=["too-large", "negative", "too-long", "float", "bool", "3d", "empty", "text"],
)
def test_bad_tokens(model, bad, error, message):
    with pytest.raises(error, match=message):
        model(bad)


def test_token_list_1d_and_small_int_tensors_are_accepted(model):
    with torch.no_grad():
        ref = model(torch.tensor([[1, 2, 3]]))
        torch.testing.assert_close(model([1, 2, 3]), ref)
        torch.testing.assert_close(model(torch.tensor([1, 2, 3])), ref)
        for dtype in (torch.int32, torch.int16, torch.uint8):
            torch.testing.assert_close(model(torch.tensor([[1, 2, 3]], dtype=dtype)), ref)


def test_left_padding_does_not_count_against_learned_positions(model):
    toks, mask = torch.ones(1, 40, dtype=torch.long), torch.zeros(1, 40, dtype=torch.long)
    mask[:, -32:] = 1  # 32 real tokens: positions 0..31
    with torch.no_grad():
        model(toks, attention_mask=mask)


def test_wrong_attention_mask_shape(model):
    with pytest.raises(ValueError, match=r"attention_mask must be \[batch, pos\] = \(2, 6\).*got \(2, 7\)"):
        model(tokens(2, N), attention_mask=torch.ones(2, 7))
    with pytest.raises(ValueError, match=r"got \(6,\)"):
        model(tokens(2, N), attention_mask=torch.ones(N))
    cache = model.new_kv_cache(2, 10)
    with torch.no_grad():
        model(tokens(2, N), kv_cache=cache)
        with pytest.raises(ValueError, match="new tokens only"):  # Hugging Face's cumulative mask
            model(tokens(2, 1), attention_mask=torch.ones(2, N + 1), kv_cache=cache)


def test_unknown_hook_name(model):
    with pytest.raises(KeyError, match=r"'blocks.0.hook_resid_pr' is not a hook point.*Did you mean 'blocks.0.hook_resid_pre'"):
        model.add_hook("blocks.0.hook_resid_pr", lambda t, hook: None)
    with pytest.raises(ValueError, match="'fwd' or 'bwd'"):
        model.blocks[0].hook_resid_pre.add_hook(lambda t, hook: None, dir="forward")
    with pytest.raises(TypeError, match="callable"):
        model.blocks[0].hook_resid_pre.add_hook("not a function")


def test_unknown_attention_backend(model):
    with pytest.raises(ValueError, match=r"unknown attention backend 'flash'.*'fused'.*'instrumented'"):
        model.attention_backend = "flash"
    with pytest.raises(ValueError, match="unknown attention backend"):
        with model.attention("flash"):
            pass
    assert model.attention_backend == "auto"
    from interp.kernels.attention import get_backend

    with pytest.raises(ValueError, match="unknown attention backend 'sdpa'"):
        get_backend("sdpa")


def test_start_at_layer_needs_a_residual_stream(model):
    with pytest.raises(TypeError, match=r"residual stream \[batch, pos, d_model\]"):
        model(tokens(1, N), start_at_layer=1)
    with pytest.raises(ValueError, match="pass tokens="):
        model(torch.randn(1, N, 40), start_at_layer=1, return_type="loss")


def test_incl_bwd_needs_a_scalar(model):
    with pytest.raises(ValueError, match="return_type='loss'"):
        model.run_with_cache(tokens(1, N), incl_bwd=True, names_filter="hook_embed")
    assert not any(hp.active for hp in model.hook_points())


def test_generate_needs_left_padding(model):
    with pytest.raises(ValueError, match="left padding"):
        model.generate(tokens(2, 3), attention_mask=torch.tensor([[1, 1, 1], [1, 1, 0]]))


# ---- checkpoints -------------------------------------------------------------------------------

BERT = {"model_type": "bert", "architectures": ["BertForMaskedLM"], "hidden_size": 32, "num_hidden_layers": 2,
        "num_attention_heads": 2, "intermediate_size": 64, "vocab_size": 100}


def test_unknown_architecture(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(BERT))
    with pytest.raises(NotImplementedError, match=r"unsupported architecture model_type='bert'.*'gpt2'.*'llama'"):
        interp.load(tmp_path)
    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig(**{k: v for k, v in BERT.items() if k not in ("model_type", "architectures")})
    with pytest.raises(NotImplementedError, match="model_type='bert'"):
        interp.from_hf(transformers.BertForMaskedLM(config))


def test_unsupported_config_values_are_rejected():
    from interp.models.families import get_family

    base = dict(model_type="gpt2", n_layer=2, n_embd=40, n_head=5, vocab_size=50, n_positions=64)
    with pytest.raises(NotImplementedError, match="scale_attn_by_inverse_layer_idx"):
        get_family("gpt2").config({**base, "scale_attn_by_inverse_layer_idx": True})
    with pytest.raises(ValueError, match="no 'n_embd'"):
        get_family("gpt2").config({k: v for k, v in base.items() if k != "n_embd"})
    llama = dict(model_type="llama", hidden_size=48, num_attention_heads=6, num_hidden_layers=2, intermediate_size=64, vocab_size=50)
    with pytest.raises(NotImplementedError, match="rope type 'longrope'"):
        get_family("llama").config({**llama, "rope_scaling": {"rope_type": "longrope", "factor": 2.0}})
    # YaRN's truncate=False and mscale / mscale_all_dim are supported since gpt-oss (tests/models/families/test_moe_and_sink_families.py);
    # a rope type interp does not know is still refused in one line
    with pytest.raises(NotImplementedError, match="rope type 'made_up'"):
        get_family("llama").config({**llama, "rope_scaling": {"rope_type": "made_up", "factor": 2.0}})
    with pytest.raises(ValueError, match="act_fn='gelu_pytorch_tanh' is not one of"):
        get_family("gpt2").config({**base, "activation_function": "gelu_pytorch_tanh"})


@pytest.fixture
def hf_dir(tmp_path):
    hf, _ = hf_pair("llama-gqa")
    hf.save_pretrained(tmp_path)
    return tmp_path


def _rewrite(path, change):
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(path / "model.safetensors"))
    change(tensors)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})


def _drop_rows(path, name: str, rows: int):
    """The checkpoint in `path` with the last `rows` rows of its tensor `name` cut off."""
    _rewrite(path, lambda t: t.update({name: t[name][:-rows].clone()}))


def test_truncated_safetensors(hf_dir):
    file = hf_dir / "model.safetensors"
    raw = file.read_bytes()
    for cut in (len(raw) // 2, 5):
        file.write_bytes(raw[:cut])
        with pytest.raises(CheckpointError, match=r"could not read .*model\.safetensors.*truncated or corrupt"):
            interp.load(hf_dir)


def test_missing_tensor(hf_dir):
    _rewrite(hf_dir, lambda t: t.pop("model.layers.1.self_attn.k_proj.weight"))
    with pytest.raises(CheckpointError, match=r"has no tensor 'model.layers.1.self_attn.k_proj.weight'"):
        interp.load(hf_dir)


def test_mismatched_shape(hf_dir):
    _drop_rows(hf_dir, "model.layers.0.mlp.down_proj.weight", 1)
    with pytest.raises(CheckpointError, match=r"tensor 'blocks.0.mlp.W_out' .* has shape \(72, 47\), the config implies \(72, 48\)"):
        interp.load(hf_dir)


def test_mismatched_fused_qkv_names_the_tensor(tmp_path):
    hf, _ = hf_pair("neox")
    hf.save_pretrained(tmp_path)
    _drop_rows(tmp_path, "gpt_neox.layers.1.attention.query_key_value.weight", 3)
    with pytest.raises(CheckpointError, match=r"gpt_neox.layers.1.attention.query_key_value.weight"):
        interp.load(tmp_path)


def test_weights_the_config_does_not_describe(hf_dir):
    """A bias the config turns off would be silently dropped; the loader refuses instead."""
    _rewrite(hf_dir, lambda t: t.update({"model.layers.0.self_attn.q_proj.bias": torch.zeros(48)}))
    with pytest.raises(CheckpointError, match=r"does not use: \['model.layers.0.self_attn.q_proj.bias'\]"):
        interp.load(hf_dir)


def test_buffers_that_are_not_weights_are_ignored(hf_dir):
    _rewrite(hf_dir, lambda t: t.update({"model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(4)}))
    interp.load(hf_dir)


def test_corrupt_config_json(hf_dir):
    text = (hf_dir / "config.json").read_text()
    (hf_dir / "config.json").write_text(text[: len(text) // 2])
    with pytest.raises(CheckpointError, match=r"config\.json is not valid JSON.*truncated or corrupt"):
        interp.load(hf_dir)


def test_missing_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="no checkpoint at"):
        interp.load(tmp_path / "nowhere")
    with pytest.raises(CheckpointError, match="has no config.json"):
        interp.load(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"interp_format": 1, "config": own("learned-layernorm").cfg.to_dict()}))
    with pytest.raises(CheckpointError, match="has no model.safetensors"):
        interp.load(tmp_path)


def test_our_format_missing_and_mismatched_tensors(tmp_path):
    model = own("rotary-rms-swiglu-gqa")
    model.save(tmp_path)
    _rewrite(tmp_path, lambda t: t.pop("blocks.1.attn.W_qkv"))
    with pytest.raises(CheckpointError, match=r"missing tensors \['blocks.1.attn.W_qkv'\]"):
        interp.load(tmp_path)
    model.save(tmp_path)
    _rewrite(tmp_path, lambda t: t.update({"blocks.0.mlp.W_in": torch.zeros(48, 55)}))
    with pytest.raises(CheckpointError, match=r"tensor 'blocks.0.mlp.W_in' .* has shape \(48, 55\), the config implies \(48, 56\)"):
        interp.load(tmp_path)
    model.save(tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    raw["config"]["n_layer"] = 2
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match=r"unknown ModelConfig fields \['n_layer'\]"):
        interp.load(tmp_path)


def test_corrupt_pytorch_model_bin(tmp_path):
    hf, _ = hf_pair("gpt2")
    hf.config.save_pretrained(tmp_path)
    (tmp_path / "pytorch_model.bin").write_bytes(b"not a torch file")
    with pytest.raises(CheckpointError, match=r"could not read .*pytorch_model\.bin"):
        interp.load(tmp_path)


def test_missing_weight_views_say_why():
    """A TransformerLens weight view the model does not have says why, not just "no attribute"."""
    attn_only = interp.HookedTransformer(interp.ModelConfig(n_layers=1, d_model=16, n_heads=2, d_vocab=11, n_ctx=8, d_mlp=None))
    for name in ("W_in", "b_in", "W_out", "b_out", "W_gate"):
        with pytest.raises(AttributeError, match="attention-only, it has no MLPs"):
            getattr(attn_only, name)
        assert not hasattr(attn_only, name)
    rotary = own("rotary-rms-swiglu-gqa")
    for name in ("W_pos", "W_E_pos"):
        with pytest.raises(AttributeError, match="'rotary' positions, so no W_pos"):
            getattr(rotary, name)
    with pytest.raises(AttributeError, match="W_gate: this model's MLPs are not gated"):
        own("learned-layernorm").W_gate
    with pytest.raises(AttributeError, match="has no attribute 'W_nonsense'"):
        rotary.W_nonsense
    with pytest.raises(ValueError, match="mode must be 'Q', 'K' or 'V'"):
        rotary.all_composition_scores("q")
