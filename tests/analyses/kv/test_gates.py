"""DuoAttention's gates against computations written out here: gates all 1 are the model bit for bit;
gates all 0 are every head streaming, as a streaming KV cache and as scores masked by hand with the
sinks + window rule; a gate of 0.3 on one KV head mixes that head's z by hand; training lowers the
loss, keeps the gates in [0, 1], lets a bigger L1 weight close more of them and reaches them with
gradients; results are cached by model and settings; bad input is refused in one line."""

from __future__ import annotations

import pytest
import torch
from core_models import build, small, tokens

from interp.analyses.kv.gates import gate_table, gated_attention, load_gates, save_gates, train_gates
from interp.analyses.kv.tasks import RetrievalPrompt
from interp.errors import BadValue

N_LAYERS, N_HEADS, N_KV = 3, 6, 2
S, W, N = 2, 8, 40


@pytest.fixture(scope="module")
def gqa():
    """Rotary, RMSNorm, gated MLP, 6 query heads on 2 KV heads (3 per group)."""
    return build(small(positional="rotary", normalization="rmsnorm", act_fn="silu", gated_mlp=True, d_model=48,
                       n_heads=N_HEADS, n_kv_heads=N_KV, n_ctx=96, n_layers=N_LAYERS))


def streaming_rows(n: int, sinks: int, window: int) -> torch.Tensor:
    """bool [n, n]: query i sees key j <= i when j < sinks or i - j < window."""
    i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
    return (j <= i) & ((j < sinks) | (i - j < window))


def masked_hooks(layers, sees: torch.Tensor) -> list:
    """Hooks masking every head's scores of `layers` to `sees` [n, n]."""
    def fn(scores, hook):
        return scores.masked_fill(~sees, float("-inf"))
    return [(f"blocks.{layer}.attn.hook_attn_scores", fn) for layer in layers]


def z_of(model, toks, layer, fwd_hooks=()) -> torch.Tensor:
    got = {}

    def keep(z, hook):
        got["z"] = z.detach().clone()
    model.run_with_hooks(toks, fwd_hooks=[*fwd_hooks, (f"blocks.{layer}.attn.hook_z", keep)])
    return got["z"]


# ---- gated attention ------------------------------------------------------------------------------
def test_gates_one_are_the_model(gqa):
    toks = tokens(2, N)
    full = gqa(toks)
    for gates in (torch.ones(N_LAYERS, N_KV), torch.ones(N_LAYERS, N_KV, requires_grad=True)):  # skipped, mixed
        with gated_attention(gqa, gates, sinks=S, window=W):
            out = gqa(toks)
        assert torch.equal(out, full)
    assert not any(hp.active for hp in gqa.hook_dict.values())  # the hooks are gone


@pytest.mark.parametrize("cfg", [
    dict(positional="rotary", normalization="rmsnorm", act_fn="silu", gated_mlp=True, d_model=48, n_heads=6,
         n_kv_heads=2, n_ctx=96, n_layers=3),
    dict(n_ctx=96),  # learned positions, MHA: hook_q / hook_k
], ids=["rotary-gqa", "learned-mha"])
def test_gates_zero_are_streaming(cfg):
    model = build(small(**cfg))
    toks = tokens(1, N)
    with gated_attention(model, torch.zeros(model.cfg.n_layers, model.cfg.kv_heads), sinks=S, window=W):
        out = model(toks)
    cache = model.new_kv_cache(1, N, policy=f"streaming({S},{W})")
    torch.testing.assert_close(out, model(toks, kv_cache=cache), rtol=1e-5, atol=1e-5)
    by_hand = model.run_with_hooks(toks, fwd_hooks=masked_hooks(range(model.cfg.n_layers), streaming_rows(N, S, W)))
    torch.testing.assert_close(out, by_hand, rtol=1e-5, atol=1e-5)
    assert (out - model(toks)).abs().max() > 1e-2  # streaming is not the full model here


def test_one_gate_mixes_its_heads_z(gqa):
    layer, kv, alpha = 1, 1, 0.3
    toks = tokens(1, N, seed=3)
    gates = torch.ones(N_LAYERS, N_KV)
    gates[layer, kv] = alpha
    z_full = z_of(gqa, toks, layer)
    z_stream = z_of(gqa, toks, layer, masked_hooks([layer], streaming_rows(N, S, W)))
    want = z_full.clone()
    heads = [h for h in range(N_HEADS) if h // (N_HEADS // N_KV) == kv]  # query heads 3, 4, 5
    want[:, :, heads] = alpha * z_full[:, :, heads] + (1 - alpha) * z_stream[:, :, heads]
    with gated_attention(gqa, gates, sinks=S, window=W):
        z_gated = z_of(gqa, toks, layer)
        logits = gqa(toks)
    torch.testing.assert_close(z_gated, want, rtol=1e-5, atol=1e-6)
    assert torch.equal(z_gated[:, :, :heads[0]], z_full[:, :, :heads[0]])  # the other KV head's heads: untouched
    by_hand = gqa.run_with_hooks(toks, fwd_hooks=[(f"blocks.{layer}.attn.hook_z", lambda z, hook: want)])
    torch.testing.assert_close(logits, by_hand, rtol=1e-5, atol=1e-5)


def test_gradients_reach_every_gate(gqa):
    toks = tokens(1, N)
    with torch.no_grad():
        target = gqa.ln_final(gqa(toks, stop_at_layer=N_LAYERS))
    gates = torch.full((N_LAYERS, N_KV), 0.5, requires_grad=True)
    with gated_attention(gqa, gates, sinks=S, window=W):
        hidden = gqa.ln_final(gqa(toks, stop_at_layer=N_LAYERS))
    (hidden - target).pow(2).mean().backward()
    assert gates.grad is not None and bool((gates.grad != 0).all())
    # At gates all 1 the distillation term and its gradient are exactly 0 (what lets train_gates skip step 1).
    ones = torch.ones(N_LAYERS, N_KV, requires_grad=True)
    with gated_attention(gqa, ones, sinks=S, window=W):
        loss = (gqa.ln_final(gqa(toks, stop_at_layer=N_LAYERS)) - target).pow(2).mean()
    loss.backward()
    assert loss.item() == 0 and bool((ones.grad == 0).all())
    r = train_gates(gqa, toks, sinks=S, window=W, steps=1, lr=0.05, progress_bar=False)
    torch.testing.assert_close(r.gates, torch.full((N_LAYERS, N_KV), 0.95))  # Adam's first step: lr, L1's sign


def test_gated_attention_refuses_a_kv_cache_and_padding(gqa):
    toks = tokens(2, N)
    cache = gqa.new_kv_cache(2, N)
    mask = torch.ones(2, N, dtype=torch.long)
    with gated_attention(gqa, torch.zeros(N_LAYERS, N_KV), sinks=S, window=W):
        with pytest.raises(BadValue, match="whole sequences"):
            gqa(toks, kv_cache=cache)
        torch.testing.assert_close(gqa(toks, attention_mask=mask), gqa(toks))  # no padding: fine
        mask[1, :3] = 0
        with pytest.raises(BadValue, match="padding"):
            gqa(toks, attention_mask=mask)
    gqa(toks, kv_cache=cache)  # the guard is gone


# ---- training -------------------------------------------------------------------------------------
def test_training_lowers_the_loss_and_keeps_gates_in_range(gqa):
    r = train_gates(gqa, tokens(4, N, seed=1), sinks=S, window=W, steps=8, lr=0.05, l1=1.0, progress_bar=False)
    assert r.steps == 8 and list(r.curve.step) == list(range(1, 9))
    assert r.curve.total.iloc[0] == pytest.approx(1.0)  # step 1 runs at the initial gates, 1: only the L1 term
    assert r.curve.total.iloc[-3:].mean() < r.curve.total.iloc[0] - 0.05
    torch.testing.assert_close(torch.tensor(r.curve.total.to_numpy()),
                               torch.tensor((r.curve.distill + r.curve.l1).to_numpy()))
    assert r.gates.shape == (N_LAYERS, N_KV) and bool(((r.gates >= 0) & (r.gates <= 1)).all())
    assert r.seconds > 0 and r.settings["target"] == "ln_final" and r.settings["positions"] == "all"
    table = gate_table(r)
    assert list(table.columns) == ["layer", "kv_head", "gate"] and len(table) == N_LAYERS * N_KV
    assert table.gate.tolist() == pytest.approx(r.gates.reshape(-1).tolist())


def test_a_bigger_l1_closes_more_gates(gqa):
    data = tokens(4, N, seed=2)
    small_l1 = train_gates(gqa, data, sinks=S, window=W, steps=8, lr=0.1, l1=0.001, progress_bar=False)
    big_l1 = train_gates(gqa, data, sinks=S, window=W, steps=8, lr=0.1, l1=2.0, progress_bar=False)
    assert big_l1.gates.mean() < small_l1.gates.mean() - 0.1
    assert bool((big_l1.gates >= 0).all())  # clamped, not pushed below 0


def test_retrieval_prompts_score_after_the_key(gqa):
    prompt = RetrievalPrompt(variant="passkey", length=N, depth=0.5, seed=0, key="12345", text="",
                             tokens=tokens(1, N), key_span=(10, 15))
    r = train_gates(gqa, [prompt], sinks=S, window=W, steps=2, lr=0.3, l1=0.5, progress_bar=False)
    assert r.steps == 2 and r.settings["positions"] == "after the needle's key"
    # Step 1 moves the gates by the L1 term alone (every gate 1 is the full model: no distillation); step 2's
    # distillation loss is the mean squared difference of the final normalized hidden states, gated by step 1's
    # gates vs the full model, over the positions after the key only (15..N-1): written out here.
    first = train_gates(gqa, [prompt], sinks=S, window=W, steps=1, lr=0.3, l1=0.5, progress_bar=False)
    assert r.curve["distill"][0] == 0.0 and bool((first.gates < 1).all())

    def final(model, toks):
        return model.ln_final(model(toks, stop_at_layer=model.cfg.n_layers)).double()

    with torch.no_grad():
        full = final(gqa, prompt.tokens)
        with gated_attention(gqa, first.gates, sinks=S, window=W):
            gated = final(gqa, prompt.tokens)
    after = float((gated[:, 15:] - full[:, 15:]).pow(2).mean())
    everywhere = float((gated - full).pow(2).mean())
    assert r.curve["distill"][1] == pytest.approx(after, rel=1e-4)
    assert abs(after - everywhere) > 0.05 * after  # the positions matter: scoring all of them is another number


def test_time_budget_stops_training(gqa):
    r = train_gates(gqa, tokens(2, N), sinks=S, window=W, steps=10_000, time_budget_s=0.5, progress_bar=False)
    assert 1 <= r.steps < 10_000 and len(r.curve) == r.steps


def test_nan_loss_is_an_error():
    model = build(small(positional="rotary", n_ctx=96))
    with torch.no_grad():
        model.ln_final.w.fill_(float("nan"))
    with pytest.raises(FloatingPointError, match="step 2: the loss is nan"):  # step 1, all gates 1, runs nothing
        train_gates(model, tokens(1, N), sinks=S, window=W, steps=3, progress_bar=False)


def test_cache_by_model_and_settings(gqa, tmp_path):
    data = tokens(2, N)
    first = train_gates(gqa, data, sinks=S, window=W, steps=2, cache_dir=tmp_path, progress_bar=False)
    again = train_gates(gqa, data, sinks=S, window=W, steps=2, cache_dir=tmp_path, progress_bar=False)
    assert not first.from_cache and again.from_cache
    assert torch.equal(first.gates, again.gates) and again.curve.equals(first.curve)
    other = train_gates(gqa, data, sinks=S, window=W, steps=2, l1=0.5, cache_dir=tmp_path, progress_bar=False)
    assert not other.from_cache and len(list(tmp_path.glob("gates-*.json"))) == 2
    path = save_gates(first, tmp_path / "copy.json")
    assert torch.equal(load_gates(path).gates, first.gates)
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(BadValue, match="not a gates file"):
        load_gates(tmp_path / "bad.json")


# ---- bad input ------------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs, match", [
    (dict(gates=torch.ones(N_LAYERS, N_HEADS)), r"\[n_layers, kv_heads\] = \[3, 2\]"),
    (dict(gates=torch.full((N_LAYERS, N_KV), 1.5)), r"in \[0, 1\]"),
    (dict(window=0), "window must be >= 1"),
    (dict(sinks=-1), "sinks must be >= 0"),
])
def test_gated_attention_refuses_bad_input(gqa, kwargs, match):
    args = {**dict(gates=torch.ones(N_LAYERS, N_KV), sinks=S, window=W), **kwargs}
    with pytest.raises(BadValue, match=match):
        with gated_attention(gqa, args.pop("gates"), **args):
            raise AssertionError("the block ran")


@pytest.mark.parametrize("kwargs, match", [
    (dict(window=0), "window must be >= 1"),
    (dict(sinks=-1), "sinks must be >= 0"),
    (dict(steps=0), "steps must be >= 1"),
    (dict(lr=0.0), "lr must be > 0"),
    (dict(l1=-1.0), "l1 must be >= 0"),
    (dict(time_budget_s=0), "time_budget_s must be > 0"),
    (dict(window=N), "within sinks \\+ window"),
    (dict(data=[]), "no samples"),
])
def test_train_gates_refuses_bad_input_before_work(gqa, kwargs, match):
    calls = []
    args = {**dict(data=tokens(1, N), sinks=S, window=W, steps=2), **kwargs}
    with gqa.hooks(fwd_hooks=[("hook_embed", lambda x, hook: calls.append(1))]):
        with pytest.raises(BadValue, match=match):
            train_gates(gqa, args.pop("data"), **args)
    assert calls == []
