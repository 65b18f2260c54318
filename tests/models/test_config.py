"""ModelConfig: parameter and FLOP accounting against torch, serialisation, validation."""

from __future__ import annotations

import json

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from core_models import OWN_CONFIGS, build, small
from hf_cases import CASES
from interp import HookedTransformer, ModelConfig, RopeScaling

PARAM_CONFIGS = {
    **OWN_CONFIGS,
    "tied-gated-biases": small(tie_embeddings=True, gated_mlp=True, act_fn="silu", unembed_bias=True),
    "untied-gated-nobias": small(gated_mlp=True, qkv_bias=False, attn_out_bias=False, mlp_bias=False),
    "gqa-rms-d_head": small(d_model=36, n_heads=6, d_head=10, n_kv_heads=3, normalization="rmsnorm", positional="rotary"),
    "mqa-attn-only-nonorm": small(n_kv_heads=1, d_mlp=None, normalization=None),
    "sinusoidal-attn-only-tied": small(positional="sinusoidal", d_mlp=None, tie_embeddings=True),
    "alibi-parallel-layernorm": small(positional="alibi", parallel_attn_mlp=True),
}


@pytest.mark.parametrize("name", list(PARAM_CONFIGS))
def test_n_params_counts_the_parameters(name):
    cfg = PARAM_CONFIGS[name]
    with torch.device("meta"):
        model = HookedTransformer(cfg, seed=None)
    assert cfg.n_params() == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("name", ["gpt2", "gpt2-untied", "neox", "llama-gqa", "llama-linear-tied", "llama-llama3-bias", "qwen2-window-layers"])
def test_n_params_equals_hugging_face(name):
    from core_models import hf_pair

    hf, model = hf_pair(name)
    assert model.cfg.n_params() == sum(p.numel() for p in hf.parameters())


FLOP_CONFIGS = ["rotary-rms-swiglu-gqa", "learned-layernorm", "no-positions-attn-only", "alibi-6heads", "learned-tied-rms"]


def _count_one_token(model, context: int, backend: str) -> FlopCounterMode:
    """FLOPs of one new token attending to `context` keys: context - 1 cached tokens plus itself."""
    cache = model.new_kv_cache(1, context)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        if context > 1:
            model(torch.randint(0, model.cfg.d_vocab, (1, context - 1), generator=g), kv_cache=cache)
        with model.attention(backend), FlopCounterMode(display=False) as counter:
            model(torch.randint(0, model.cfg.d_vocab, (1, 1), generator=g), kv_cache=cache)
    return counter


@pytest.mark.parametrize("context", [1, 9, 20])
@pytest.mark.parametrize("name", FLOP_CONFIGS)
def test_flops_per_token_match_flop_counter(name, context):
    """Checked on the instrumented path: FlopCounterMode has formulas for the CUDA SDPA kernels but
    not for the CPU one (aten._scaled_dot_product_flash_attention_for_cpu), which it counts as 0."""
    model = build(OWN_CONFIGS[name])
    expected = model.cfg.flops_per_token(context)
    counter = _count_one_token(model, context, "instrumented")
    assert counter.get_total_flops() == expected["total"]
    per_module = {k: sum(v.values()) for k, v in counter.get_flop_counts().items()}
    L = model.cfg.n_layers
    assert sum(per_module.get(f"HookedTransformer.blocks.{l}.attn", 0) for l in range(L)) == expected["attention"]
    assert sum(per_module.get(f"HookedTransformer.blocks.{l}.mlp", 0) for l in range(L)) == expected["mlp"]
    assert per_module["HookedTransformer.unembed"] == expected["unembed"]
    # The fused path does the same projections; its attention kernel is counted in full or (CPU) not at all.
    fused = _count_one_token(model, context, "fused").get_total_flops()
    score_flops = L * 4 * model.cfg.n_heads * model.cfg.head_dim * context
    assert fused in (expected["total"], expected["total"] - score_flops)


def test_flops_formula_by_hand():
    cfg = small(n_layers=1, d_model=8, n_heads=2, d_mlp=16, d_vocab=10, n_kv_heads=1, gated_mlp=True)
    f = cfg.flops_per_token(3)
    # q: 8x8, k and v: 8x4 each, out: 8x8 -> (64 + 32 + 32 + 64) * 2; scores and mixing: 2 heads * 4 dims * 3 keys * 2 * 2
    assert f["attention"] == 2 * (64 + 32 + 32 + 64) + 2 * 2 * 2 * 4 * 3
    assert f["mlp"] == 2 * 3 * 8 * 16 and f["unembed"] == 2 * 8 * 10
    assert f["total"] == f["attention"] + f["mlp"] + f["unembed"]


def test_kv_cache_bytes_per_token():
    cfg = small(n_layers=3, d_model=48, n_heads=6, n_kv_heads=2)
    assert cfg.kv_cache_bytes_per_token() == 2 * 3 * 2 * 8 * 4
    assert cfg.kv_cache_bytes_per_token(dtype_bytes=2) == 2 * 3 * 2 * 8 * 2


def _hf_configs():
    from core_models import hf_pair

    return {n: hf_pair(n)[1].cfg for n in ("llama-mqa-yarn", "llama-llama3-bias", "qwen2-window-layers", "neox-sequential")}


def test_json_round_trip():
    configs = {**PARAM_CONFIGS, **_hf_configs()}
    configs["scaled"] = small(positional="rotary", rope_scaling=RopeScaling("yarn", 4.0, 16, attention_factor=1.2), attn_scale=0.3)
    for name, cfg in configs.items():
        text = cfg.to_json()
        json.loads(text)  # plain JSON
        back = ModelConfig.from_json(text)
        assert back == cfg, name
        assert back.to_json() == text
    assert configs["qwen2-window-layers"].layer_types == ("full", "sliding", "sliding")
    assert isinstance(ModelConfig.from_json(configs["scaled"].to_json()).rope_scaling, RopeScaling)


def test_config_is_frozen_and_replace_validates():
    cfg = small()
    with pytest.raises(Exception):
        cfg.n_layers = 3
    assert cfg.replace(n_layers=3).n_layers == 3
    with pytest.raises(ValueError, match="n_kv_heads"):
        cfg.replace(n_kv_heads=2)


def test_derived_sizes():
    cfg = small(d_model=40, n_heads=5)
    assert cfg.head_dim == 8 and cfg.kv_heads == 5 and cfg.rot_dim == 8 and not cfg.attn_only
    assert cfg.scale == pytest.approx(8**-0.5)
    cfg = small(n_layers=3, positional="rotary", sliding_window=4, layer_types=("full", "sliding", "full"))
    assert [cfg.window(l) for l in range(3)] == [None, 4, None]
    assert small(sliding_window=4).window(1) == 4 and small().window(0) is None


INVALID = [
    (dict(d_model=42, n_heads=5), "not divisible by n_heads"),
    (dict(n_kv_heads=2), "multiple of n_kv_heads"),
    (dict(n_kv_heads=0), "positive integers.*n_kv_heads=0"),
    (dict(n_layers=0), "positive integers.*n_layers=0"),
    (dict(d_mlp=0), "d_mlp=0.*attention-only"),
    (dict(d_vocab=-1), "d_vocab=-1"),
    (dict(n_heads=2.5), "n_heads=2.5"),
    (dict(positional="rotary", rotary_dim=5), "rotary_dim=5 must be even"),
    (dict(positional="rotary", rotary_dim=10), "exceeds d_head"),
    (dict(positional="rope"), "positional='rope' is not one of"),
    (dict(act_fn="swish"), "act_fn='swish' is not one of"),
    (dict(normalization="ln"), "normalization='ln' is not one of"),
    (dict(layer_types=("full",)), "layer_types has 1 entries for 2 layers"),
    (dict(layer_types=("full", "windowed"), sliding_window=3), "layer_types must hold"),
    (dict(sliding_window=0), "sliding_window must be >= 1"),
    (dict(rope_scaling=RopeScaling("linear", 2.0)), "needs positional='rotary'"),
    (dict(positional="rotary", rope_scaling=RopeScaling("llama3", 8.0)), "needs original_max_position"),
    (dict(positional="rotary", rope_scaling=RopeScaling("bogus", 2.0)), "rope_scaling.kind='bogus'"),
    (dict(positional="rotary", rope_scaling=RopeScaling("linear", 0.0)), "factor must be > 0"),
]


@pytest.mark.parametrize("changes, message", INVALID, ids=[m.split()[0] for _, m in INVALID])
def test_invalid_configs_raise_clear_errors(changes, message):
    with pytest.raises(ValueError, match=message):
        small(**changes)


def test_from_dict_rejects_unknown_fields():
    data = small().to_dict()
    data["n_layer"] = 2
    with pytest.raises(ValueError, match=r"unknown ModelConfig fields \['n_layer'\]"):
        ModelConfig.from_dict(data)


def test_hf_cases_cover_every_family():
    """Every registered family is held to transformers by at least one case of hf_cases.CASES."""
    pytest.importorskip("transformers")
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    from interp.models.families import FAMILIES

    model_type_of = {v: k for k, v in CONFIG_MAPPING_NAMES.items()}
    covered = {model_type_of[CASES[n][0]] for n in CASES}
    assert set(FAMILIES) <= covered, f"families without a case: {sorted(set(FAMILIES) - covered)}"
