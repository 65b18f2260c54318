"""The sink twins (issue 58, parts 3-4): the zoo's softmax / learned-sink / gated-attention twins differ only in
their attention (identical step-0 shared weights, data order and seed); the attention gate off is bit-identical
to the model without it and on equals SDPA * sigmoid(x W_gate_attn) written out by hand; a learned sink logit's
pattern rows sum to 1 - its share (softmax over [scores, b] by hand); the onset step of a hand-made series."""

from __future__ import annotations

import dataclasses
import math
import numpy as np
import pandas as pd
import pytest
import torch

from interp import HookedTransformer, ModelConfig
from interp.analyses.sink_origins.onset import onset_step, onset_steps
from interp.models.zoo.recipes import ATTN_ONLY_2L, ATTN_ONLY_2L_TWINS, SINK_TWINS, SINKS_SOFTMAX_4L
from interp.models.zoo.training import BatchSampler, initial_model

TINY = dict(n_layers=2, d_model=40, n_heads=4, n_kv_heads=2, d_head=10, d_vocab=31, n_ctx=24, d_mlp=56,
            positional="rotary", normalization="rmsnorm", act_fn="silu", gated_mlp=True, qkv_bias=False,
            attn_out_bias=False, mlp_bias=False)


def tokens(seed=0, batch=3, n=17) -> torch.Tensor:
    return torch.randint(0, 31, (batch, n), generator=torch.Generator().manual_seed(seed))


# ---- the twins differ only in their attention ---------------------------------------------------------------
@pytest.mark.parametrize("base, twins", [(SINKS_SOFTMAX_4L, SINK_TWINS[1:]), (ATTN_ONLY_2L, ATTN_ONLY_2L_TWINS)])
def test_twin_recipes_differ_only_in_attention(base, twins):
    for twin in twins:
        mine = dataclasses.replace(twin, name=base.name, description=base.description, init_like=None,
                                   model=dataclasses.replace(twin.model, learned_sinks=False, attn_output_gate=False,
                                                             pre_norms=True))
        assert mine == base, twin.name  # recipe (steps, lr, data, seed, checkpoints) and model otherwise equal
        assert twin.init_like == base.model


def test_twins_tiny_share_step0_weights_and_batches():
    """Tiny versions of the twin recipes: every shared parameter equal at step 0; the extra ones only extra."""
    base = dataclasses.replace(SINKS_SOFTMAX_4L, model=ModelConfig(**TINY))
    twins = [base] + [dataclasses.replace(base, model=dataclasses.replace(base.model, **{opt: True}),
                                          init_like=base.model)
                      for opt in ("learned_sinks", "attn_output_gate")]
    states = [initial_model(r, r.seed).state_dict() for r in twins]
    for name, state in zip(("learned", "gated"), states[1:]):
        assert set(states[0]) <= set(state)
        extra = set(state) - set(states[0])
        assert extra and all(k.endswith(("attn.sinks", "attn.W_gate_attn")) for k in extra), name
        for k, v in states[0].items():
            assert torch.equal(v, state[k]), (name, k)
    # without init_like the gate's weights would shift every later draw: the twin recipe is what keeps them equal
    plain = HookedTransformer(twins[2].model, seed=0).state_dict()
    assert not torch.equal(plain["blocks.1.attn.W_qkv"], states[0]["blocks.1.attn.W_qkv"])
    # the data order is a function of the recipe's seed and shapes only: the same first batches
    stream = np.arange(5000, dtype=np.int16) % 256
    first = [[next(s) for _ in range(2)] for s in
             (BatchSampler(stream, r.model.n_ctx, r.batch_size, r.seed, r.copy_prob, r.copy_span, r.random_span_prob)
              for r in twins)]
    for other in first[1:]:
        for a, b in zip(first[0], other):
            assert torch.equal(a.tokens, b.tokens) and torch.equal(a.weights, b.weights)


# ---- the attention gate ----------------------------------------------------------------------------------------
def test_gate_off_is_bit_identical():
    ids = tokens()
    plain = HookedTransformer(ModelConfig(**TINY), seed=3).eval()
    off = HookedTransformer(ModelConfig(**TINY, attn_output_gate=False), seed=3).eval()
    assert torch.equal(plain(ids), off(ids))
    assert all(b.attn.W_gate_attn is None for b in off.blocks)
    assert not any("attn_gate" in k for k in off.hook_dict)
    assert ModelConfig(**TINY).n_params() == sum(p.numel() for p in plain.parameters())


def _sdpa(q, k, v, scale):
    """Causal softmax attention by hand; q [b, p, h, d], k / v [b, p, kv, d] -> [b, p, h, d]."""
    group = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(group, 2), v.repeat_interleave(group, 2)
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    n = q.shape[1]
    s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    return torch.einsum("bhqk,bkhd->bqhd", s.softmax(-1), v)


def test_gate_on_is_sdpa_times_sigmoid():
    cfg = ModelConfig(**TINY, attn_output_gate=True)
    model = HookedTransformer(cfg, seed=5).eval()
    assert cfg.n_params() == sum(p.numel() for p in model.parameters())
    with torch.no_grad():
        for b in model.blocks:
            b.attn.W_gate_attn.normal_(0, 0.5, generator=torch.Generator().manual_seed(1))
    _, cache = model.run_with_cache(tokens())
    h, dh = cfg.n_heads, cfg.head_dim
    for l, block in enumerate(model.blocks):
        x = cache[f"blocks.{l}.ln1.hook_normalized"]
        gate = torch.sigmoid(x @ block.attn.W_gate_attn).unflatten(-1, (h, dh))
        torch.testing.assert_close(cache[f"blocks.{l}.attn.hook_attn_gate"], gate)
        sdpa = _sdpa(cache[f"blocks.{l}.attn.hook_rot_q"], cache[f"blocks.{l}.attn.hook_rot_k"],
                     cache[f"blocks.{l}.attn.hook_v"], cfg.scale)
        z = sdpa * gate
        torch.testing.assert_close(cache[f"blocks.{l}.attn.hook_z"], z, atol=1e-5, rtol=1e-4)
        out = z.flatten(2) @ block.attn.W_O_flat
        torch.testing.assert_close(cache[f"blocks.{l}.hook_attn_out"], out, atol=1e-5, rtol=1e-4)
    assert (cache["blocks.0.attn.hook_attn_gate"] < 1).all()  # the gate does act


def test_gate_on_instrumented_equals_fused():
    model = HookedTransformer(ModelConfig(**TINY, attn_output_gate=True), seed=2).eval()
    ids = tokens(1)
    fused = model(ids)
    hooked = model.run_with_hooks(ids, fwd_hooks=[("blocks.1.attn.hook_pattern", lambda x, hook: x)])
    torch.testing.assert_close(fused, hooked, atol=1e-5, rtol=1e-4)


# ---- the learned sink logit ------------------------------------------------------------------------------------
def test_learned_sink_rows_sum_to_one_minus_share():
    cfg = ModelConfig(**TINY, learned_sinks=True)
    model = HookedTransformer(cfg, seed=7).eval()
    with torch.no_grad():
        for b in model.blocks:
            b.attn.sinks.copy_(torch.tensor([-1.0, 0.0, 1.5, 3.0]))
    _, cache = model.run_with_cache(tokens(2))
    for l, block in enumerate(model.blocks):
        pattern = cache[f"blocks.{l}.attn.hook_pattern"]  # [b, h, q, k]
        q, k = cache[f"blocks.{l}.attn.hook_rot_q"], cache[f"blocks.{l}.attn.hook_rot_k"]
        k = k.repeat_interleave(cfg.n_heads // cfg.kv_heads, 2)
        s = torch.einsum("bqhd,bkhd->bhqk", q, k) * cfg.scale
        n = s.shape[-1]
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        b = block.attn.sinks.detach()[None, :, None, None].expand(*s.shape[:3], 1)
        full = torch.cat([s, b], -1).softmax(-1)  # softmax over [scores, b]
        torch.testing.assert_close(pattern, full[..., :-1], atol=1e-6, rtol=1e-5)
        share = full[..., -1]
        torch.testing.assert_close(pattern.sum(-1), 1 - share, atol=1e-6, rtol=1e-5)
        assert share[:, 3].mean() > share[:, 0].mean()  # a larger logit takes more


# ---- the onset step ---------------------------------------------------------------------------------------------
def test_onset_step_on_a_hand_made_series():
    steps = [0, 50, 100, 200, 400, 800]
    assert onset_step(steps, [0.0, 0.1, 0.2, 0.3, 0.5, 0.4], 0.3) == 200  # reaching the threshold counts
    assert onset_step(steps, [0.0, 0.1, 0.29, 0.2, 0.1, 0.0], 0.3) is None
    assert onset_step(steps, [float("nan"), 0.5, 0.0, 0.0, 0.0, 0.0], 0.3) == 50
    assert onset_step([400, 0, 100], [0.9, 0.0, 0.4], 0.3) == 100  # by step, not by row
    frame = pd.DataFrame(dict(step=steps, sink_share=[0, 0, 0.25, 0.5, 0.5, 0.5], sink_mass_max=[0.1, 0.3] + [0.9] * 4,
                              massive_ratio=[5, 20, 80, 120, 300, 900], induction=[0.01] * 5 + [0.6]))
    got = onset_steps(frame).set_index("series")["onset_step"].to_dict()
    assert got == {"sink_mass_max": 50, "sink_share": 100, "massive_ratio": 200, "induction": 800}
    with pytest.raises(ValueError, match="no column"):
        onset_steps(frame.drop(columns="induction"))


# ---- StreamingLLM on the twins, and the CLI -----------------------------------------------------------------------
def test_streaming_losses_window_covering_everything_is_the_full_cache():
    from interp.analyses.sink_origins.twins import streaming_losses

    model = HookedTransformer(ModelConfig(**TINY, attn_output_gate=True), seed=4).eval()
    with torch.no_grad():  # attention that matters: at init the context barely moves a tiny model's logits
        for b in model.blocks:
            b.attn.W_qkv.mul_(8)
            b.attn.W_O_flat.mul_(20)
    ids = tokens(3, batch=2, n=24)
    got = streaming_losses(model, ids, windows=(20, 4), prefix=8, chunk=4)
    assert math.isclose(got["stream_loss_w20_s4"], got["stream_loss_full"], rel_tol=1e-5)  # sinks + window cover all 24
    assert not math.isclose(got["stream_loss_w4_s4"], got["stream_loss_w4_s0"], rel_tol=1e-3)  # the sinks count
    assert not math.isclose(got["stream_loss_w4_s0"], got["stream_loss_full"], rel_tol=1e-3)  # evicts


def test_over_checkpoints_refuses_bad_input_in_one_line(capsys):
    from interp.cli import main as cli

    assert cli(["sinks", "no-such-run", "--over-checkpoints", "--out", "/tmp/never-written"]) != 0
    assert cli(["sinks", "attn-only-2l", "--over-checkpoints", "--epsilon", "1.5", "--out", "/tmp/never-written"]) != 0
    err = capsys.readouterr().err
    assert "no-such-run" in err and "--epsilon" in err and len(err.strip().splitlines()) == 2
