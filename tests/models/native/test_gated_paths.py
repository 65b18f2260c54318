"""Gated attention (`attn_output_gate`: z * sigmoid(x W_gate_attn) before W_O) and learned sink logits outside
`Attention.forward`: weight processing keeps a gated model's log-probs or refuses in one line; saving, loading
and offloading carry the gate; the analyses that recompute a head's z from q, k, v (DuoAttention's streaming
branch, StreamingLLM's cache positions, the KV-precision head table) give the model's own numbers; the FLOP
formula counts the gate's projection; `tl_parameters` lists the gate."""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

import interp
from interp.analyses.kv.gates import gated_attention
from interp.analyses.kv.precision import head_table
from interp.analyses.streaming import streaming_loss
from interp.kernels.kv_quant import fake_quantize
from interp.models import lm_loss

from core_models import build, small, tokens

ROTARY = dict(positional="rotary", normalization="rmsnorm", act_fn="silu", gated_mlp=True, n_heads=4, n_kv_heads=2,
              d_head=10)


def gated(sinks: bool = False, **changes) -> interp.HookedTransformer:
    """A small gated model (and with learned sink logits), every norm weight and bias perturbed."""
    model = build(small(**{**ROTARY, **changes}, attn_output_gate=True, learned_sinks=sinks))
    with torch.no_grad():
        for block in model.blocks:
            if block.attn.sinks is not None:
                block.attn.sinks.copy_(torch.linspace(-1.0, 2.0, block.attn.n_heads))
    return model


# ---- weight processing ------------------------------------------------------------------------------------
def test_fold_ln_folds_ln1_into_the_gate():
    model, toks = gated(qkv_bias=False), tokens(2, 11)
    with torch.no_grad():
        ref = model(toks).log_softmax(-1)
        model.process_weights_(fold_ln=True, center_writing_weights=True, center_unembed=True, fold_value_biases=True)
        assert torch.allclose(model(toks).log_softmax(-1), ref, atol=1e-4)
    assert all(bool((b.ln1.w == 1).all()) for b in model.blocks)


@pytest.mark.parametrize("cfg, steps, says", [
    (dict(qkv_bias=True), dict(fold_value_biases=True), "gates each head's output"),
    (dict(normalization="layernorm"), dict(fold_ln=True), "gate bias"),
    (dict(positional="learned", n_kv_heads=None), dict(refactor_factored_attn_matrices=True), "d_head basis"),
])
def test_processing_a_gated_model_refuses_what_would_change_it(cfg, steps, says):
    model = gated(**cfg)
    off = dict(fold_ln=False, center_writing_weights=False, center_unembed=False, fold_value_biases=False)
    with pytest.raises(ValueError, match=says):
        model.process_weights_(**{**off, **steps})


@pytest.mark.parametrize("steps", [dict(fold_ln=True, fold_value_biases=True),
                                   dict(fold_ln=True, refactor_factored_attn_matrices=True)])
def test_learned_sinks_refuse_the_value_bias_a_layernorm_fold_creates(steps):
    """qkv_bias=False, but folding ln1's bias into W_V makes a b_V, which the sink's share makes query-dependent."""
    model = build(small(normalization="layernorm", qkv_bias=False, learned_sinks=True, n_kv_heads=None))
    with pytest.raises(ValueError, match="sink"):
        model.process_weights_(**{**dict(center_writing_weights=False, center_unembed=False,
                                         fold_value_biases=False), **steps})


# ---- saving, loading, offloading --------------------------------------------------------------------------
def test_save_load_and_offload_carry_the_gate_and_sinks(tmp_path):
    model, toks = gated(sinks=True), tokens(2, 9)
    model.save(tmp_path / "m")
    with torch.no_grad():
        ref = model(toks)
        loaded = interp.load(tmp_path / "m")
        assert torch.equal(loaded(toks), ref)
        assert torch.equal(loaded.blocks[1].attn.W_gate_attn, model.blocks[1].attn.W_gate_attn)
        assert torch.equal(loaded.blocks[1].attn.sinks, model.blocks[1].attn.sinks)
        assert torch.allclose(interp.load(tmp_path / "m", offload="disk")(toks), ref, atol=1e-6)


# ---- analyses that recompute z ------------------------------------------------------------------------------
@pytest.mark.parametrize("sinks", [False, True])
def test_duo_attention_streaming_branch_is_the_gated_models_own(sinks):
    """Gates 0 (all streaming) with a window that covers the text: the streaming branch is full attention,
    so the model's own logits, gate and sink logits included."""
    model, toks = gated(sinks=sinks), tokens(2, 12)
    with torch.no_grad():
        ref = model(toks)
        with gated_attention(model, torch.zeros(model.cfg.n_layers, model.cfg.kv_heads), sinks=2, window=32):
            out = model(toks)
    assert torch.allclose(out, ref, atol=1e-5)


def test_streaming_cache_positions_keep_the_gate():
    """Window + sinks cover the text: the cache positions are the positions, so the full model's loss."""
    model, toks = gated(), tokens(2, 12)
    with torch.no_grad():
        ref = lm_loss(model(toks), toks, per_token=True)
        out = streaming_loss(model, toks, window=16, n_sink=2, positions="cache")
    assert torch.allclose(out, ref, atol=1e-5)


def _z_change_by_hand(model, toks, layer: int, precision: str) -> list[float]:
    """||z_q - z|| / ||z|| per query head of `layer`, from the model's own hook_z with K and V fake-quantized."""
    name = f"blocks.{layer}.attn.hook_z"
    with torch.no_grad():
        _, cache = model.run_with_cache(toks, names_filter=name)
        quant = lambda x, hook: fake_quantize(x.transpose(1, 2), precision).transpose(1, 2)  # noqa: E731
        at = f"blocks.{layer}.attn."
        with model.hooks(fwd_hooks=[(at + "hook_rot_k", quant), (at + "hook_v", quant)]):
            _, qcache = model.run_with_cache(toks, names_filter=name)
    z, zq = cache[name].double(), qcache[name].double()
    return ((zq - z).pow(2).sum((0, 1, 3)) / z.pow(2).sum((0, 1, 3))).sqrt().tolist()


@pytest.mark.parametrize("sinks", [False, True])
def test_kv_precision_head_table_is_the_models_own_z(sinks):
    model, toks = gated(sinks=sinks), tokens(2, 12)
    table = head_table(model, toks, ("int4",))
    for layer in range(model.cfg.n_layers):
        mine = table[table.layer == layer].sort_values("head")["z_rel_change"].tolist()
        theirs = _z_change_by_hand(model, toks, layer, "int4")
        assert all(math.isclose(a, b, rel_tol=1e-3, abs_tol=1e-5) for a, b in zip(mine, theirs)), (layer, mine, theirs)


# ---- accounting and views ------------------------------------------------------------------------------------
def test_flops_per_token_count_the_gate():
    model, context = gated(), 5
    cache = model.new_kv_cache(1, context)
    with torch.no_grad():
        model(tokens(1, context - 1), kv_cache=cache)
        with model.attention("instrumented"), FlopCounterMode(display=False) as counter:
            model(tokens(1, 1, seed=1), kv_cache=cache)
    assert counter.get_total_flops() == model.cfg.flops_per_token(context)["total"]


def test_tl_parameters_list_the_gate_per_head():
    model = gated()
    a = model.blocks[1].attn
    W = model.tl_parameters()["blocks.1.attn.W_gate_attn"]  # [head, d_model, d_head], as W_Q
    assert W.shape == (a.n_heads, model.cfg.d_model, a.d_head)
    x = torch.randn(3, model.cfg.d_model)
    assert torch.allclose(torch.einsum("pm,hmd->phd", x, W), (x @ a.W_gate_attn).unflatten(-1, (a.n_heads, a.d_head)))
