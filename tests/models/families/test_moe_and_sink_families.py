"""Mixtures of experts (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, gpt-oss) and gpt-oss's learned attention-sink
logits. Parity of logits and patterns with transformers runs for every case of hf_cases.py in
tests/models/families/test_hf_parity.py; here: the router and the experts against a hand computation, token by token; the
sinks on both attention backends (every mask path: causal, padding, window, bands, decode, a mask given
outright, ALiBi) against a hand softmax with one more column; every hook point firing once; the streaming
statistics with sinks against their float64 oracle; greedy generation against transformers' per family;
weight processing; the configs and what they refuse. Sizes are distinct (d_model 44, 4 heads of 10 on 2 KV
heads, 5 experts of 28, a shared expert of 36, vocab 53) so a transposition cannot pass."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import interp
from core_models import build, fused_agreeing_with_instrumented, scored
from core_models import tokens as own_tokens
from hf_cases import CASES, VOCAB, build_hf
from interp import HookedTransformer, ModelConfig
from interp.kernels import attention_stats
from interp.kernels import attention as kernels
from interp.kernels.attention import AttentionMask, fused_attention, instrumented_attention
from interp.kernels.stats import Scoring
from interp.kernels.stats.reference import reference_stats
from interp.models.families import get_family
from near_ties import assert_greedy_agrees

transformers = pytest.importorskip("transformers")

C_CASES = ["mixtral-window", "qwen2-moe-shared", "qwen3-moe-window", "olmoe", "gpt-oss"]


def own_cfg(**changes) -> ModelConfig:
    """A mixture with everything: router bias, expert biases, a shared expert, sinks, a window layer."""
    base = dict(n_layers=2, d_model=44, n_heads=4, d_head=10, n_kv_heads=2, d_vocab=53, n_ctx=64, d_mlp=28,
                positional="rotary", normalization="rmsnorm", act_fn="silu", gated_mlp=True, num_experts=5,
                experts_per_token=2, router_bias=True, d_mlp_shared=36, learned_sinks=True, sliding_window=4,
                layer_types=("sliding", "full"), init_range=0.2)
    return ModelConfig(**{**base, **changes})


@pytest.fixture(scope="module")
def model() -> HookedTransformer:
    return build(own_cfg())


@pytest.fixture(scope="module")
def pairs():
    """(transformers' model, ours) per case, built once for this module."""
    return {name: (hf := build_hf(name), interp.from_hf(hf)) for name in C_CASES}


# ---- the router and the experts, by hand ----------------------------------------------------------------
def _expert_by_hand(e, x: torch.Tensor, clamp=None) -> torch.Tensor:
    gate, lin = x @ e.W_gate + e.b_gate, x @ e.W_in + e.b_in
    if clamp is None:
        return (F.silu(gate) * lin) @ e.W_out + e.b_out
    limit, alpha = clamp
    gate, lin = gate.clamp(max=limit), lin.clamp(-limit, limit)
    return (gate * torch.sigmoid(alpha * gate) * (lin + 1)) @ e.W_out + e.b_out


def _moe_by_hand(mlp, x: torch.Tensor, norm: bool, clamp=None) -> torch.Tensor:
    """One token at a time: softmax of the router's logits, the top k, their weighted experts, the shared one."""
    out = torch.zeros_like(x)
    for i, tok in enumerate(x):
        weights = torch.softmax(tok @ mlp.W_gate + mlp.b_gate, -1)
        top = weights.topk(mlp.experts_per_token)
        w = top.values / top.values.sum() if norm else top.values
        out[i] = sum(w[j] * _expert_by_hand(mlp.experts[int(e)], tok, clamp) for j, e in enumerate(top.indices))
        if mlp.shared_expert is not None:
            out[i] += torch.sigmoid(tok @ mlp.W_shared_gate)[0] * _expert_by_hand(mlp.shared_expert, tok)
    return out


@pytest.mark.parametrize("norm", [True, False])
def test_router_and_experts_equal_a_hand_computation(norm):
    m = build(own_cfg(norm_topk_prob=norm))
    mlp = m.blocks[1].mlp
    x = torch.randn(3, 7, 44, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        out = mlp(x)
        ref = _moe_by_hand(mlp, x.reshape(-1, 44), norm).view_as(x)
        assert float((out - ref).abs().max()) < 1e-5 * float(ref.abs().max())
        # the routing matters: the router's columns permuted, other experts answer
        saved = mlp.W_gate.clone()
        mlp.W_gate.copy_(saved[:, [1, 2, 3, 4, 0]])
        assert float((mlp(x) - out).abs().max()) > 1e-2
        mlp.W_gate.copy_(saved)


def test_gpt_oss_clamped_experts_equal_a_hand_computation(pairs):
    _, ours = pairs["gpt-oss"]
    mlp = ours.blocks[0].mlp
    assert (mlp.experts[0].limit, mlp.experts[0].alpha) == (0.1, 1.702)
    x = torch.randn(9, 48, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref = _moe_by_hand(mlp, x, True, clamp=(0.1, 1.702))
        assert float((mlp(x[None])[0] - ref).abs().max()) < 1e-6
        pre = x @ mlp.experts[0].W_gate + mlp.experts[0].b_gate
        assert bool((pre > 0.1).any())  # the clamp bites at this limit, so the test above checks it


def test_expert_hooks_see_the_routing_and_can_re_route(model):
    toks = own_tokens(2, 9, seed=3)
    _, cache = model.run_with_cache(toks)
    weights, indices = cache["blocks.0.mlp.hook_expert_weights"], cache["blocks.0.mlp.hook_expert_indices"]
    assert weights.shape == (2, 9, 5) and indices.shape == (2, 9, 2)
    torch.testing.assert_close(weights.sum(-1), torch.ones(2, 9))
    assert torch.equal(indices, weights.topk(2).indices)
    routed = sum(cache[f"blocks.0.mlp.experts.{e}.hook_pre"].shape[0] for e in range(5))
    assert routed == 2 * 9 * 2  # every token reaches its two experts, and only those
    assert cache["blocks.0.mlp.experts.0.hook_post"].shape[-1] == 28
    assert cache["blocks.0.mlp.hook_shared_gate"].shape == (2, 9, 1)

    def only_expert_3(w, hook):  # HookedTransformer's contract: the weights before the choice re-route
        return torch.zeros_like(w).index_fill_(-1, torch.tensor([3]), 1.0)

    mlp = model.blocks[0].mlp
    x = torch.randn(1, 4, 44, generator=torch.Generator().manual_seed(4))
    with torch.no_grad(), model.hooks([("blocks.0.mlp.hook_expert_weights", only_expert_3)]):
        out = mlp(x)
    with torch.no_grad():  # all weight on expert 3 (the second choice has weight 0), plus the shared expert
        shared = torch.sigmoid(x @ mlp.W_shared_gate) * mlp.shared_expert(x)
        torch.testing.assert_close(out, mlp.experts[3](x) + shared)


def test_every_hook_point_fires_once_on_both_backends(model):
    toks = own_tokens(2, 9, seed=5)
    for backend in ("fused", "instrumented"):
        counts: dict[str, int] = {}

        def count(x, hook):
            counts[hook.name] = counts.get(hook.name, 0) + 1

        with model.attention("auto" if backend == "fused" else "instrumented"):
            names = [n for n in model.hook_dict if backend == "instrumented" or "attn_scores" not in n and "pattern" not in n]
            model.run_with_hooks(toks, fwd_hooks=[(n, count) for n in names])
        assert counts == {n: 1 for n in names}, backend
    for name in ("blocks.1.mlp.hook_expert_weights", "blocks.1.mlp.hook_expert_indices", "blocks.1.mlp.experts.4.hook_pre",
                 "blocks.1.mlp.experts.4.hook_pre_linear", "blocks.1.mlp.experts.4.hook_post", "blocks.1.mlp.hook_shared_gate",
                 "blocks.1.mlp.shared_expert.hook_post"):
        assert name in model.hook_dict


def test_gradients_reach_the_router_and_integer_hooks_take_none(model):
    toks = own_tokens(1, 6, seed=6)
    loss, cache = model.run_with_cache(toks, return_type="loss", incl_bwd=True,
                                       names_filter=lambda n: "mlp.hook_expert" in n)
    assert "blocks.0.mlp.hook_expert_weights_grad" in cache.keys()
    assert "blocks.0.mlp.hook_expert_indices_grad" not in cache.keys()  # integers have no gradient
    model.zero_grad()


# ---- learned sink logits: both backends against a hand softmax -------------------------------------------
def _sink_attention_by_hand(q, k, v, visible, sinks, scale, bias=None):
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    s = (q @ k.transpose(-1, -2)).double() * scale + (0 if bias is None else bias.double())
    s = s.masked_fill(~visible, float("-inf"))
    col = sinks.double()[None, :, None, None].expand(*s.shape[:-1], 1)
    return (torch.softmax(torch.cat([s, col], -1), -1)[..., :-1] @ v.double()).float()


def _qkv(n_q, n_k, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(2, 6, n_q, 10, generator=g), torch.randn(2, 3, n_k, 10, generator=g),
            torch.randn(2, 3, n_k, 10, generator=g), torch.randn(6, generator=g) * 2)


def _causal(n_q, n_k, window=None):
    p, j = torch.arange(n_k - n_q, n_k)[:, None], torch.arange(n_k)[None, :]
    ok = j <= p
    return (ok if window is None else ok & (p - j < window))[None, None]


@pytest.mark.parametrize("backend", [fused_attention, instrumented_attention], ids=["fused", "instrumented"])
def test_sink_logits_equal_a_hand_softmax_on_every_mask_path(backend, monkeypatch):
    q, k, v, sinks = _qkv(13, 13)
    valid = torch.ones(2, 13, dtype=torch.bool)
    valid[1, :4] = False
    slopes = torch.tensor([0.5, 0.25, 0.125, 0.3, 0.2, 0.1])
    rel = (torch.arange(13)[:, None] - torch.arange(13)[None, :]).abs().float()
    cases = {
        "causal": (AttentionMask(13, 13), None, _causal(13, 13), None),
        "padding": (AttentionMask(13, 13, key_valid=valid), None, _causal(13, 13) & valid[:, None, None], None),
        "window": (AttentionMask(13, 13), 4, _causal(13, 13, 4), None),
        "explicit": (AttentionMask(13, 13, explicit=_causal(13, 13, 6)), None, _causal(13, 13, 6), None),
        "alibi": (AttentionMask(13, 13), None, _causal(13, 13), -slopes[None, :, None, None] * rel),
    }
    for name, (mask, window, visible, bias) in cases.items():
        out = backend(q, k, v, mask, Scoring(scale=0.3, window=window, sink_logits=sinks,
                                             alibi_slopes=None if bias is None else slopes))
        ref = _sink_attention_by_hand(q, k, v, visible, sinks, 0.3, bias)
        rows = visible.any(-1, keepdim=True)  # a padding query's row is meaningless
        assert float(((out - ref).abs() * rows).max()) < 1e-5, name
    # decoding: the last query (and the last three) against every key
    for n_q in (1, 3):
        out = backend(q[:, :, -n_q:], k, v, AttentionMask(n_q, 13), Scoring(scale=0.3, sink_logits=sinks))
        assert float((out - _sink_attention_by_hand(q[:, :, -n_q:], k, v, _causal(n_q, 13), sinks, 0.3)).abs().max()) < 1e-5
    # a long windowed prefill runs in bands (made short here), the sink key in front of every band
    monkeypatch.setattr(kernels, "BAND_FROM", 8)
    monkeypatch.setattr(kernels, "BAND_MIN", 3)
    assert kernels.banded(AttentionMask(13, 13), 3)
    out = backend(q, k, v, AttentionMask(13, 13), Scoring(scale=0.3, window=3, sink_logits=sinks))
    assert float((out - _sink_attention_by_hand(q, k, v, _causal(13, 13, 3), sinks, 0.3)).abs().max()) < 1e-5
    # the sinks matter: without them the output differs; with sinks at -1e4 it is plain attention
    plain = backend(q, k, v, AttentionMask(13, 13), Scoring(scale=0.3))
    assert float((plain - backend(q, k, v, AttentionMask(13, 13), Scoring(scale=0.3, sink_logits=sinks))).abs().max()) > 1e-2
    gone = backend(q, k, v, AttentionMask(13, 13), Scoring(scale=0.3, sink_logits=torch.full((6,), -1e4)))
    assert float((plain - gone).abs().max()) < 1e-5


def test_sinks_in_the_model_patterns_and_logits(model):
    toks = own_tokens(2, 11, seed=7)
    mask = torch.ones(2, 11, dtype=torch.long)
    mask[1, :3] = 0
    fused = fused_agreeing_with_instrumented(model, toks, mask)
    real = mask.bool()[..., None]
    _, cache = model.run_with_cache(toks, names_filter=lambda n: n.endswith("hook_pattern"))
    rows = cache["pattern", 0].sum(-1)
    assert bool((rows < 1 - 1e-3).all())  # each head's sink takes a share
    assert model.tl_parameters()["blocks.0.attn.sinks"].shape == (4,)
    saved = [b.attn.sinks.detach().clone() for b in model.blocks]
    try:  # the sinks matter to the logits
        with torch.no_grad():
            for b in model.blocks:
                b.attn.sinks.fill_(-1e4)
            assert float(((model(toks, attention_mask=mask) - fused).abs() * real).max()) > 1e-3
    finally:
        with torch.no_grad():
            for b, s in zip(model.blocks, saved):
                b.attn.sinks.copy_(s)


def test_sinks_through_caches_whose_heads_hold_different_tokens(model):
    """A per-head policy cache attends each group of heads on its own: each group gets its own heads' sinks.
    Policies that keep every token here (a window longer than the text), so the logits are the full forward's."""
    toks = own_tokens(2, 10, seed=12)
    with torch.no_grad():
        ref = model(toks)
        for policy in ("streaming(2,14)", "h2o(16)"):
            cache = model.new_kv_cache(2, 16, policy={(0, 0): policy, (1, 1): policy})
            out = torch.cat([model(toks[:, :6], kv_cache=cache), model(toks[:, 6:], kv_cache=cache)], 1)
            assert not all(g.contiguous for g in cache.groups[0])  # the per-group path
            assert float((out - ref).abs().max()) < 1e-5, policy


def test_own_format_round_trip(model, tmp_path):
    model.save(tmp_path)
    back = interp.load(tmp_path)
    toks = own_tokens(2, 9, seed=13)
    assert back.cfg == model.cfg
    with torch.no_grad():
        torch.testing.assert_close(back(toks), model(toks))


# ---- streaming statistics with sinks -------------------------------------------------------------------------
def _close_stats(stats, ref, where):
    for name, value in stats.to_dict().items():
        r = ref[name].float()
        assert torch.equal(value.isnan(), r.isnan()), (where, name)
        assert float((value - r).abs().nan_to_num(0).max()) < 2e-5 * max(1.0, float(r.abs().nan_to_num(0).max())), (where, name)


def test_statistics_with_sinks_equal_the_oracle():
    g = torch.Generator().manual_seed(8)
    q, k = torch.randn(2, 6, 29, 10, generator=g) * 2, torch.randn(2, 3, 29, 10, generator=g) * 2
    toks, sinks = torch.randint(0, 6, (2, 29), generator=g), torch.randn(6, generator=g) * 3
    valid = torch.ones(2, 29, dtype=torch.bool)
    valid[0, :5] = False
    for kw in (dict(), dict(window=5), dict(key_padding_mask=valid), dict(window=4, key_padding_mask=valid)):
        st = attention_stats(q, k, toks, **scored(sink_logits=sinks, scale=0.4, block_q=8, block_k=8, **kw))
        _close_stats(st, reference_stats(q, k, toks, **scored(sink_logits=sinks, scale=0.4, **kw)), kw)
    plain = attention_stats(q, k, toks, **scored(scale=0.4))
    assert float((plain.max - attention_stats(q, k, toks, **scored(scale=0.4, sink_logits=sinks)).max).abs().max()) > 1e-2
    with pytest.raises(ValueError, match="torch statistics kernel only"):
        attention_stats(q, k, toks, **scored(sink_logits=sinks, backend="triton"))


def test_model_statistics_with_sinks_equal_the_oracle_from_tokens_and_from_a_cache(model):
    toks = own_tokens(2, 10, seed=9)
    stats = model.attention_stats(toks)
    _, cache = model.run_with_cache(toks, names_filter=lambda n: "hook_rot_" in n)
    for layer in range(2):
        a = model.blocks[layer].attn
        ref = reference_stats(cache[f"blocks.{layer}.attn.hook_rot_q"].transpose(1, 2),
                              cache[f"blocks.{layer}.attn.hook_rot_k"].transpose(1, 2), toks, **scored(scale=a.scale,
                              window=a.window, sink_logits=a.sinks))
        _close_stats(stats[layer], ref, layer)
    kv = model.new_kv_cache(2, 16, capture_queries=True)
    with torch.no_grad():
        model(toks, kv_cache=kv)
    from_cache = model.attention_stats(kv_cache=kv)
    for layer in range(2):
        torch.testing.assert_close(from_cache[layer].entropy, stats[layer].entropy, atol=1e-5, rtol=1e-5)


# ---- greedy generation equals transformers' ------------------------------------------------------------------
@pytest.mark.parametrize("name", C_CASES)
def test_generate_equals_transformers(name, pairs):
    hf, ours = pairs[name]
    prompt = torch.randint(1, VOCAB, (2, 6), generator=torch.Generator().manual_seed(10))
    mask = torch.ones_like(prompt)
    padded = name == "gpt-oss"  # left padding once: the sink must not count the padding
    if padded:
        mask[1, :2] = 0
    with torch.no_grad():
        ref = hf.generate(prompt, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0,
                          eos_token_id=None, output_scores=True, return_dict_in_generate=True)
    out = ours.generate(prompt, attention_mask=mask if padded else None, max_new_tokens=8)
    assert_greedy_agrees(out, ref.sequences, torch.stack(ref.scores, dim=1), start=6)


# ---- the configs ---------------------------------------------------------------------------------------------
def test_configs_round_trip_and_count_their_parameters(pairs, model):
    for m in [model] + [ours for _, ours in pairs.values()]:
        assert ModelConfig.from_dict(m.cfg.to_dict()) == m.cfg
        assert m.cfg.n_params() == sum(p.numel() for p in m.parameters()), m.cfg.model_type
    cfg = pairs["gpt-oss"][1].cfg
    assert (cfg.num_experts, cfg.experts_per_token, cfg.router_bias, cfg.learned_sinks) == (4, 2, True, True)
    assert cfg.windows() == [5, None, 5] and cfg.rope_scaling.truncate is False
    assert pairs["qwen2-moe-shared"][1].cfg.d_mlp_shared == 40 and not pairs["qwen2-moe-shared"][1].cfg.norm_topk_prob
    assert pairs["olmoe"][1].cfg.qk_norm_over == "projection"
    assert {c.original_architecture for c in (p[1].cfg for p in pairs.values())} >= {"MixtralForCausalLM", "GptOssForCausalLM"}
    assert model.W_gate.shape == (2, 44, 5)  # the routers, TransformerLens's MoE name
    with pytest.raises(AttributeError, match="mixture of 5 experts"):
        model.W_in


@pytest.mark.parametrize("case, change, match", [
    ("qwen2-moe-shared", dict(decoder_sparse_step=2), "decoder_sparse_step"),
    ("qwen3-moe-window", dict(mlp_only_layers=[0]), "mlp_only_layers"),
    ("olmoe", dict(clip_qkv=8.0), "clip_qkv"),
    ("gpt-oss", dict(quantization_config={"quant_method": "mxfp4"}), "quantization_config"),
])
def test_what_the_families_refuse(case, change, match):
    cfg_cls, _, kwargs = CASES[case]
    d = getattr(transformers, cfg_cls)(vocab_size=VOCAB, **kwargs).to_dict()
    with pytest.raises(NotImplementedError, match=match):
        get_family(d["model_type"]).config({**d, **change})


def test_config_checks_the_expert_fields():
    with pytest.raises(ValueError, match="exceeds num_experts"):
        own_cfg(experts_per_token=6)
    with pytest.raises(ValueError, match="go together"):
        own_cfg(experts_per_token=None)
    with pytest.raises(ValueError, match="describe experts"):
        own_cfg(num_experts=None, experts_per_token=None)  # router_bias and d_mlp_shared without experts
    with pytest.raises(ValueError, match="swiglu"):
        own_cfg(swiglu_limit=7.0)


def test_yarn_without_truncation_and_with_mscale_equal_transformers():
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from interp.models.positions import rope_frequencies

    for rope in ({"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                  "original_max_position_embeddings": 4096, "rope_theta": 150000.0},
                 {"rope_type": "yarn", "factor": 40.0, "mscale": 0.707, "mscale_all_dim": 1.0,
                  "original_max_position_embeddings": 4096, "rope_theta": 10000.0}):
        hf_cfg = transformers.LlamaConfig(hidden_size=256, num_attention_heads=4, num_hidden_layers=1, intermediate_size=64,
                                          vocab_size=10, max_position_embeddings=131072, rope_parameters=dict(rope))
        ours = get_family("llama").config(hf_cfg.to_dict())
        inv, scale = rope_frequencies(ours)
        ref_inv, ref_scale = ROPE_INIT_FUNCTIONS["yarn"](hf_cfg, "cpu")
        torch.testing.assert_close(inv, ref_inv.float(), rtol=1e-6, atol=0)
        assert scale == pytest.approx(ref_scale)


# ---- weight processing ---------------------------------------------------------------------------------------
def _logprobs(m, toks):
    with torch.no_grad():
        return m(toks).log_softmax(-1)


@pytest.mark.parametrize("name", ["qwen2-moe-shared", "gpt-oss"])
def test_weight_processing_keeps_log_probs_or_refuses(name, pairs):
    hf, _ = pairs[name]
    toks = torch.randint(1, VOCAB, (2, 12), generator=torch.Generator().manual_seed(11))
    m = interp.from_hf(hf)
    before = _logprobs(m, toks)
    if name == "gpt-oss":  # the sinks' share of each query differs: b_V is no constant for b_O
        with pytest.raises(ValueError, match="fold_value_biases=True: this model's learned attention-sink"):
            m.process_weights_()
        m.process_weights_(fold_value_biases=False)
    else:
        m.process_weights_()
    assert float((_logprobs(m, toks) - before).abs().max()) < 1e-4
    assert torch.allclose(m.blocks[0].ln2.w, torch.ones_like(m.blocks[0].ln2.w))  # folded into router and experts


def test_processing_a_layernorm_mixture_is_refused():
    m = build(own_cfg(normalization="layernorm", learned_sinks=False))
    with pytest.raises(ValueError, match="mixture of experts with LayerNorm"):
        m.process_weights_(fold_value_biases=False)
