"""A family is one file: this one defines StarCoder 2 (Lozhkov et al. 2024; Hugging Face `model_type`
"starcoder2", which interp otherwise wraps) here, outside the package, from the shared builders, registers
it, and loads a saved folder of it with `interp.load`: the logits equal transformers' own model on the same
weights. Nothing else is edited: no import line, no second list (the GGUF layout rides on the registration).
"""

from __future__ import annotations

import pytest
import torch

import interp
from interp.models.config import ModelConfig
from interp.models.families import FAMILIES, Family, get_family, register
from interp.models.families.builders import (LLAMA_NORMS, TensorGetter, decoder, layernorm_decoder, linears, norms,
                                             reject, rotary_from_hf, split_qkv)
from interp.models.families.gguf_layout import LLAMA_GLOBALS, GGUFLayout, weight_and_bias

transformers = pytest.importorskip("transformers")

MT = "starcoder2"


# ---- the family: what a new file in models/src/families/ would hold -------------------------------------
def config(d: dict) -> ModelConfig:
    """LayerNorm with biases, a GELU (tanh) MLP c_fc -> c_proj, rotary over the whole head, grouped KV heads,
    `use_bias` on every projection, an optional window on every layer."""
    reject(d, MT, hidden_act=lambda v: v not in ("gelu_pytorch_tanh", "gelu_new"))
    d_model, n_heads = d["hidden_size"], d["num_attention_heads"]
    n_ctx = d.get("max_position_embeddings", 4096)
    bias = bool(d.get("use_bias", True))
    sizes = dict(n_layers="num_hidden_layers", d_model="hidden_size", n_heads="num_attention_heads",
                 d_vocab="vocab_size", d_mlp="intermediate_size")
    return layernorm_decoder(d, MT, sizes=sizes, n_kv_heads=d.get("num_key_value_heads") or n_heads, n_ctx=n_ctx,
                             act_fn="gelu_new", norm_eps=d.get("norm_epsilon", 1e-5), positional="rotary",
                             **rotary_from_hf(d, d_model // n_heads, n_ctx), sliding_window=d.get("sliding_window"),
                             qkv_bias=bias, attn_out_bias=bias, mlp_bias=bias)


def _layer(cfg: ModelConfig, get: TensorGetter, p: str, o: str) -> dict:
    a = p + "self_attn."
    return (norms(get, o, p, LLAMA_NORMS, bias=True) | split_qkv(get, o, a, bias=cfg.qkv_bias)
            | linears(get, o, a, {"attn.O": "o_proj"}, bias=cfg.attn_out_bias)
            | linears(get, o, p, {"mlp.in": "mlp.c_fc", "mlp.out": "mlp.c_proj"}, bias=cfg.mlp_bias))


def weights(cfg: ModelConfig, get: TensorGetter) -> dict:
    return decoder(cfg, get, embed={"embed.W_E": get("model.embed_tokens.weight")}, layers="model.layers.",
                   layer=_layer, final=norms(get, "", "model.", {"ln_final": "norm"}, bias=True))


# How llama.cpp names its tensors (the metadata keys it writes would need a `config` of their own).
GGUF = GGUFLayout(MT, lambda meta, base, names: {}, weight_and_bias({
    "attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "ffn_norm": "post_attention_layernorm",
    "ffn_up": "mlp.c_fc", "ffn_down": "mlp.c_proj"}), permuted_qk=False,
    global_names=LLAMA_GLOBALS | weight_and_bias({"output_norm": "model.norm"}))
# ------------------------------------------------------------------------------------------------------


@pytest.fixture
def plugin():
    """The family registered for one test; the registry as it was afterwards (interp wraps starcoder2)."""
    before = dict(FAMILIES)
    assert MT not in FAMILIES
    family = register(Family(MT, (MT,), config, weights, gguf={"starcoder2": GGUF}))
    yield family
    FAMILIES.clear()
    FAMILIES.update(before)


def _saved(tmp_path, **changes):
    torch.manual_seed(0)
    hf_config = transformers.Starcoder2Config(
        vocab_size=97, hidden_size=48, intermediate_size=80, num_hidden_layers=2, num_attention_heads=6,
        num_key_value_heads=2, max_position_embeddings=64, rope_theta=1000.0, use_bias=True,
        **({"tie_word_embeddings": False} | changes))
    hf = transformers.Starcoder2ForCausalLM(hf_config).eval()
    with torch.no_grad():  # random norms and biases, so that a weight read in the wrong place shows
        for name, p in hf.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.normal_(0.0 if name.endswith("bias") else 1.0, 0.1)
    hf.save_pretrained(tmp_path / "starcoder2")
    return hf, tmp_path / "starcoder2"


@pytest.mark.parametrize("changes", [{}, {"tie_word_embeddings": True, "sliding_window": 5}])
def test_a_family_in_a_test_file_loads_a_saved_folder(plugin, tmp_path, changes):
    hf, folder = _saved(tmp_path, **changes)
    model = interp.load(folder)
    assert get_family(MT) is plugin and type(model).__name__ == "HookedTransformer"  # converted, not wrapped
    tokens = torch.randint(0, 97, (2, 17), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf(tokens).logits
        logits = model(tokens)
    torch.testing.assert_close(logits, expected, atol=2e-5, rtol=2e-5)


def test_its_gguf_layout_is_found_with_the_family(plugin):
    from interp.models.formats.gguf_layouts import ARCHITECTURES, layouts

    assert ARCHITECTURES["starcoder2"] == MT and layouts()["starcoder2"] is GGUF
    assert ARCHITECTURES["llama"] == "llama"  # the package's own families are still there


def test_without_the_family_starcoder2_is_wrapped(tmp_path):
    _, folder = _saved(tmp_path)
    assert MT not in FAMILIES
    assert type(interp.load(folder)).__name__ != "HookedTransformer"
