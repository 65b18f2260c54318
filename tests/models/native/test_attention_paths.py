"""The two attention paths: fused (SDPA) and instrumented (explicit scores and pattern).

They must agree on logits and on every gradient, for every family and every positional scheme;
the instrumented path must be right by itself (a hand-worked example, patterns recomputed from
cached q/k); `auto` must leave the fused path only where a layer's scores/pattern are asked for,
and the fused path must never materialise a pattern.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import interp
import interp.models.native.attention_layer as attention_module
from core_models import OWN_CONFIGS, build, hf_pair, left_mask, own, small, tokens
from hf_cases import CASES
from interp.kernels.attention import (
    ATTENTION_BACKENDS,
    AttentionBackend,
    AttentionMask,
    Needs,
    choose,
    fused_attention,
    get_backend,
    instrumented_attention,
)
from interp.kernels.stats import Scoring
from interp.models.positions import alibi_slopes, sinusoidal_table

N = 11  # longer than every sliding window in the configs


def _loss(model, inp, mask, weights, **kw):
    logits = model(inp, attention_mask=mask, **kw)
    return (logits * weights * mask[..., None]).sum(), logits


def _grads(model, backend, toks, mask, weights):
    """Logits, d loss / d parameters, and d loss / d residual stream at layer 0 (via start_at_layer)."""
    params = [p for p in model.parameters() if p.requires_grad]
    with model.attention(backend):
        loss, logits = _loss(model, toks, mask, weights)
        g_params = torch.autograd.grad(loss, params)
        resid = model(toks, attention_mask=mask, stop_at_layer=0).detach().requires_grad_(True)
        loss2, logits2 = _loss(model, resid, mask, weights, start_at_layer=0)
        (g_resid,) = torch.autograd.grad(loss2, resid)
    torch.testing.assert_close(logits2, logits, rtol=0, atol=1e-6)  # start_at_layer=0 is the same forward
    return logits.detach(), list(g_params), g_resid


def _max_rel(a: torch.Tensor, b: torch.Tensor, floor: float) -> float:
    return float((a.float() - b.float()).abs().max()) / max(float(b.float().abs().max()), floor)


# Every registered backend against the instrumented path (the materialised reference): a new backend is
# one registry entry, and these parametrised tests hold it to the same numbers, forward and backward.
OTHER_BACKENDS = [name for name in ATTENTION_BACKENDS if name != "instrumented"]


def _compare_paths(model, vocab, backend="fused"):
    toks, mask = tokens(3, N, vocab=vocab), left_mask(3, N)
    weights = torch.randn(3, N, vocab, generator=torch.Generator().manual_seed(1))
    fused = _grads(model, backend, toks, mask, weights)
    instr = _grads(model, "instrumented", toks, mask, weights)
    assert _max_rel(fused[0], instr[0], 1e-3) < 1e-5
    floor = 1e-3 * max(float(g.abs().max()) for g in instr[1])
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    for name, gf, gi in zip(names, fused[1], instr[1]):
        assert _max_rel(gf, gi, floor) < 1e-4, name
    assert _max_rel(fused[2], instr[2], 1e-6) < 1e-4


@pytest.mark.parametrize("backend", OTHER_BACKENDS)
@pytest.mark.parametrize("name", list(OWN_CONFIGS))
def test_fused_equals_instrumented_own_configs(name, backend):
    _compare_paths(own(name), OWN_CONFIGS[name].d_vocab, backend)


def test_choose_reads_capabilities(monkeypatch):
    """`choose` decides from what a backend declares: a windowless backend registered first is taken for
    plain layers, skipped under "auto" for windowed ones, and refused by name when forced on one."""
    plain = AttentionBackend("plain", fused_attention, gives_pattern=False, materialises=False, windows=False,
                             alibi=False, devices=("cpu",))
    monkeypatch.setattr("interp.kernels.attention.ATTENTION_BACKENDS",
                        {"plain": plain, **{k: v for k, v in ATTENTION_BACKENDS.items() if k != "plain"}})
    assert choose("auto", Needs()).name == "plain"
    assert choose("auto", Needs(window=True)).name == "fused"
    assert choose("auto", Needs(alibi=True)).name == "fused"
    assert choose("auto", Needs(device="cuda")).name == "fused"
    assert choose("auto", Needs(pattern=True, window=True)).name == "instrumented"
    with pytest.raises(RuntimeError, match="layer 2 is forced to the plain attention backend, which cannot give a "
                                           "sliding window and the cuda device"):
        choose("plain", Needs(window=True, device="cuda"), where="layer 2")
    model = own("no-norm-mqa-window")  # windows on every layer: "auto" never takes the windowless backend
    assert {b.attn.backend_now().name for b in model.blocks} == {"fused"}


@pytest.mark.parametrize("name", list(CASES))
def test_fused_equals_instrumented_hf_families(name):
    _, model = hf_pair(name)
    _compare_paths(model, model.cfg.d_vocab)


@pytest.mark.parametrize("name", [*OWN_CONFIGS, "hf:llama-mqa-yarn", "hf:qwen2-window-layers", "hf:neox"])
def test_bf16_paths_within_reference_error(name):
    """flash-attention's criterion: the fused bf16 error against the float32 result is at most twice
    the error of the eager (instrumented) path run in bf16, plus a small absolute slack."""
    if name.startswith("hf:"):
        model32 = hf_pair(name[3:])[1]
    else:
        cfg = OWN_CONFIGS[name]
        # ReLU's kink: bf16 noise flips a few units near 0 on one path and not the other, and a flipped
        # unit moves a parameter gradient by O(1) whichever path is better; judge attention on a smooth MLP.
        model32 = own(name) if cfg.act_fn != "relu" else build(cfg.replace(act_fn="gelu"))
    model16 = copy.deepcopy(model32).to(torch.bfloat16)
    vocab = model32.cfg.d_vocab
    toks, mask = tokens(3, N, vocab=vocab), left_mask(3, N)
    weights = torch.randn(3, N, vocab, generator=torch.Generator().manual_seed(1))
    ref = _grads(model32, "instrumented", toks, mask, weights)
    fused = _grads(model16, "fused", toks, mask, weights.bfloat16())
    eager = _grads(model16, "instrumented", toks, mask, weights.bfloat16())

    def err(x, r):
        return float((x.float() - r).abs().max())

    # Logits: flash-attention's factor 2. Gradients here are those of a whole model's bf16 backward (a
    # max over one tensor each: a noisier statistic than one kernel's dq/dk/dv, ratios up to ~2.5 seen): 3.
    checks = [(fused[0], eager[0], ref[0], 2), (fused[2], eager[2], ref[2], 3)]
    checks += [(f, e, r, 3) for f, e, r in zip(fused[1], eager[1], ref[1])]
    for f, e, r, factor in checks:
        slack = 1e-3 * float(r.abs().max()) + 1e-6
        assert err(f, r) <= factor * err(e, r) + slack
    assert err(fused[0], ref[0]) < 0.05 * float(ref[0].abs().max())  # and bf16 is not wildly off


# ---- the instrumented path by itself -----------------------------------------------------------


def test_instrumented_hand_worked_2x2():
    q = torch.tensor([[1.0, 2.0], [0.0, -1.0]])[None, None]
    k = torch.tensor([[2.0, 0.0], [1.0, 1.0]])[None, None]
    v = torch.tensor([[10.0, 20.0], [30.0, 40.0]])[None, None]
    seen = {}

    def keep(name):
        def hook(t):
            seen[name] = t
            return t

        return hook

    out = instrumented_attention(
        q, k, v, AttentionMask(2, 2, causal=False), Scoring(scale=1 / math.sqrt(2)),
        scores_hook=keep("scores"), pattern_hook=keep("pattern"),
    )
    # scores = QK^T / sqrt(2) = [[2, 3], [0, -1]] / sqrt(2)
    torch.testing.assert_close(seen["scores"][0, 0], torch.tensor([[2.0, 3.0], [0.0, -1.0]]) / math.sqrt(2))
    torch.testing.assert_close(seen["pattern"][0, 0], torch.tensor([[0.330, 0.670], [0.670, 0.330]]), atol=5e-4, rtol=0)
    torch.testing.assert_close(out[0, 0], torch.tensor([[23.40, 33.40], [16.60, 26.60]]), atol=5e-3, rtol=0)
    # the fused path gives the same numbers
    torch.testing.assert_close(get_backend("fused")(q, k, v, AttentionMask(2, 2, causal=False), Scoring(scale=1 / math.sqrt(2))), out)


def test_alibi_slopes_match_press_et_al():
    def get_slopes(n):  # ofirpress/attention_with_linear_biases, verbatim logic
        def power_of_2(n):
            start = 2 ** (-(2 ** -(math.log2(n) - 3)))
            return [start * start**i for i in range(n)]

        if math.log2(n).is_integer():
            return power_of_2(n)
        closest = 2 ** math.floor(math.log2(n))
        return power_of_2(closest) + get_slopes(2 * closest)[0::2][: n - closest]

    for n in (1, 4, 6, 8, 12):
        torch.testing.assert_close(alibi_slopes(n), torch.tensor(get_slopes(n)))
    torch.testing.assert_close(alibi_slopes(6), torch.tensor([2**-2, 2**-4, 2**-6, 2**-8, 2**-1, 2**-3]))


def test_sinusoidal_table_matches_vaswani():
    table = sinusoidal_table(7, 6)
    for p in range(7):
        for i in range(3):
            angle = p / 10000 ** (2 * i / 6)
            assert table[p, 2 * i].item() == pytest.approx(math.sin(angle), abs=1e-6)
            assert table[p, 2 * i + 1].item() == pytest.approx(math.cos(angle), abs=1e-6)


def _expected_pattern(model, cache, layer, n):
    """softmax(q k^T * scale + alibi, causal & window) recomputed from cached q/k."""
    attn = model.blocks[layer].attn
    q = cache[f"blocks.{layer}.attn.hook_rot_q"] if attn.rotary else cache[f"blocks.{layer}.attn.hook_q"]
    k = cache[f"blocks.{layer}.attn.hook_rot_k"] if attn.rotary else cache[f"blocks.{layer}.attn.hook_k"]
    k = k.repeat_interleave(attn.n_heads // attn.n_kv_heads, dim=2)  # GQA: head h reads kv-head h // group
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * attn.scale
    i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
    if attn.alibi_slopes is not None:
        scores = scores - attn.alibi_slopes[:, None, None] * (i - j).abs()
    visible = j <= i
    if attn.window is not None:
        visible &= i - j < attn.window
    return scores.masked_fill(~visible, float("-inf")).softmax(-1)


@pytest.mark.parametrize("name", ["learned-layernorm", "rotary-rms-swiglu-gqa", "alibi-window-untied-bias", "no-norm-mqa-window"])
def test_cached_patterns_are_causal_softmax_of_cached_qk(name):
    model = own(name)
    _, cache = model.run_with_cache(tokens(2, N), names_filter=lambda n: "attn.hook" in n)
    for layer in range(model.cfg.n_layers):
        pattern = cache["pattern", layer]
        assert pattern.shape == (2, model.cfg.n_heads, N, N)
        assert torch.all(pattern.triu(1) == 0)  # exactly zero above the diagonal
        torch.testing.assert_close(pattern.sum(-1), torch.ones(2, model.cfg.n_heads, N))
        torch.testing.assert_close(pattern, _expected_pattern(model, cache, layer, N), atol=1e-6, rtol=1e-5)
        if model.blocks[layer].attn.window is not None:  # keys outside the window get exactly 0
            w = model.blocks[layer].attn.window
            assert torch.all(pattern.tril(-w) == 0)
    assert pattern.max() > 0.5  # peaked patterns: a wrong mask could not hide in a uniform one


# ---- auto: only the asked-for layers leave the fused path ---------------------------------------


class OpSpy(TorchDispatchMode):
    """Records every aten op and the shapes of its outputs."""

    def __init__(self):
        super().__init__()
        self.calls: list[tuple[str, list[tuple[int, ...]], list[torch.dtype]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        outs = out if isinstance(out, (tuple, list)) else [out]
        tensors = [o for o in outs if isinstance(o, torch.Tensor)]
        self.calls.append((str(func), [tuple(t.shape) for t in tensors], [t.dtype for t in tensors]))
        return out

    def softmaxes(self) -> int:
        return sum("softmax" in f for f, _, _ in self.calls)

    def float_qk_tensors(self, n: int) -> list[str]:
        return [f for f, shapes, dtypes in self.calls for s, d in zip(shapes, dtypes) if d.is_floating_point and len(s) == 4 and s[-2:] == (n, n) and s[1] > 1]


@pytest.fixture
def backend_spy(monkeypatch):
    used = []

    run = AttentionBackend.__call__

    def spy(self, *args, **kwargs):  # records the backend that actually ran
        used.append(self.name)
        return run(self, *args, **kwargs)

    monkeypatch.setattr(AttentionBackend, "__call__", spy)
    return used


def test_auto_switches_only_hooked_layers(backend_spy):
    model = own("alibi-window-untied-bias")  # 3 layers
    toks = tokens(2, N)
    assert [b.attn.instrumented_now() for b in model.blocks] == [False, False, False]
    model(toks)
    assert backend_spy == ["fused"] * 3
    backend_spy.clear()
    _, cache = model.run_with_cache(toks, names_filter=["blocks.1.attn.hook_pattern", "blocks.2.hook_resid_post"])
    assert backend_spy == ["fused", "instrumented", "fused"]
    assert set(cache.keys()) == {"blocks.1.attn.hook_pattern", "blocks.2.hook_resid_post"}
    backend_spy.clear()
    with model.hooks([("blocks.2.attn.hook_attn_scores", lambda t, hook: None)]):
        assert [b.attn.instrumented_now() for b in model.blocks] == [False, False, True]
        model(toks)
    assert backend_spy == ["fused", "fused", "instrumented"]
    assert [b.attn.instrumented_now() for b in model.blocks] == [False, False, False]  # hooks gone, fused again
    backend_spy.clear()
    with model.attention("instrumented", layers=[0]):
        model(toks)
    assert backend_spy == ["instrumented", "fused", "fused"]
    assert model.attention_backend == "auto" and [b.attn.backend for b in model.blocks] == ["auto"] * 3


@pytest.mark.parametrize("name", ["rotary-rms-swiglu-gqa", "alibi-window-untied-bias"])
def test_fused_path_never_materialises_the_pattern(name):
    model = own(name)
    toks, mask = tokens(2, N), left_mask(2, N)
    for kw in ({}, {"attention_mask": mask}):
        with OpSpy() as spy, torch.no_grad():
            model(toks, **kw)
        assert spy.softmaxes() == 0
        assert any("scaled_dot_product" in f for f, _, _ in spy.calls)
        # No [batch, head, q, k] float tensor is computed by a matmul (ALiBi's additive bias is one, as a mask)
        assert not [f for f in spy.float_qk_tensors(N) if "mm" in f or "matmul" in f]
        if not kw and model.cfg.positional != "alibi" and model.cfg.sliding_window is None:
            assert spy.float_qk_tensors(N) == []
    # Control: the spy does see the pattern when one layer is instrumented.
    with OpSpy() as spy, torch.no_grad(), model.hooks([("blocks.0.attn.hook_pattern", lambda t, hook: None)]):
        model(toks)
    assert spy.softmaxes() == 1 and spy.float_qk_tensors(N)


def test_forcing_fused_while_hooking_the_pattern_is_an_error():
    model = own("learned-layernorm")
    for point in ("hook_pattern", "hook_attn_scores"):
        with model.attention("fused"), model.hooks([(f"blocks.1.attn.{point}", lambda t, hook: None)]):
            with pytest.raises(RuntimeError, match="fused.*(instrumented|auto)"):
                model(tokens(1, 5))
    assert not any(hp.active for hp in model.hook_points())
    with model.attention("fused", layers=[1]):  # forced per layer: layer 0 is still auto
        _, cache = model.run_with_cache(tokens(1, 5), names_filter="blocks.0.attn.hook_pattern")
        assert cache["pattern", 0].shape == (1, 5, 5, 5)
        with pytest.raises(RuntimeError, match="layer 1 is forced to the fused"):
            model.run_with_cache(tokens(1, 5), names_filter="blocks.1.attn.hook_pattern")
    with model.attention("fused"), pytest.raises(RuntimeError, match="fused"):
        model.run_with_cache(tokens(1, 5))  # caching everything includes the patterns
    with pytest.raises(RuntimeError, match="never materialises"):
        get_backend("fused")(*(torch.randn(1, 1, 2, 2),) * 3, AttentionMask(2, 2), Scoring(scale=1.0),
                             pattern_hook=lambda t: t)


def test_the_backends_take_one_scoring_and_a_layer_hands_its_own():
    """A backend's geometry is one `Scoring` after the mask (the separate keywords are gone, CHANGELOG.md); a
    layer's forward hands its own (`attn.scoring`) with the sink logits live, so the gradient reaches them,
    while readers of `attn.scoring` get them detached."""
    q, k, v = (torch.randn(1, 2, 3, 4, generator=torch.Generator().manual_seed(i)) for i in range(3))
    for backend in ATTENTION_BACKENDS.values():
        with pytest.raises(TypeError, match="scale"):
            backend(q, k, v, AttentionMask(3, 3), scale=0.5)
        with pytest.raises(TypeError, match="scoring must be a Scoring"):
            backend(q, k, v, AttentionMask(3, 3), 0.5)
        default = backend(q, k, v, AttentionMask(3, 3), Scoring())  # scale None: 1 / sqrt(d_head)
        assert torch.equal(default, backend(q, k, v, AttentionMask(3, 3), Scoring(scale=1 / math.sqrt(4))))
    cfg = interp.ModelConfig(n_layers=2, d_model=24, n_heads=4, n_kv_heads=2, d_head=6, d_vocab=11, n_ctx=32,
                             learned_sinks=True, sliding_window=4, positional="rotary", normalization="rmsnorm", d_mlp=16)
    model = interp.HookedTransformer(cfg, seed=1)
    with torch.no_grad():
        for b in model.blocks:
            b.attn.sinks.normal_(0, 2, generator=torch.Generator().manual_seed(b.attn.layer))
    toks = torch.randint(0, 11, (2, 9), generator=torch.Generator().manual_seed(0))
    _, cache = model.run_with_cache(toks, names_filter=lambda n: n.endswith(("rot_q", "rot_k", "hook_v", "hook_z")))
    for layer, b in enumerate(model.blocks):
        q, k, v = (cache[f"blocks.{layer}.attn.hook_{x}"].transpose(1, 2) for x in ("rot_q", "rot_k", "v"))
        z = get_backend("fused")(q, k, v, AttentionMask(9, 9), b.attn.scoring).transpose(1, 2)
        assert torch.equal(z, cache[f"blocks.{layer}.attn.hook_z"])
        assert b.attn.sinks.requires_grad and not b.attn.scoring.sink_logits.requires_grad
    model(toks).logsumexp(-1).sum().backward()
    assert all(float(b.attn.sinks.grad.abs().sum()) > 0 for b in model.blocks)


@pytest.mark.parametrize("name", ["rotary-rms-swiglu-gqa", "learned-layernorm"])
@pytest.mark.parametrize("point", ["hook_pattern", "hook_attn_scores"])
def test_hooks_can_edit_scores_and_patterns(name, point):
    """Force every query to attend only to position 0: z is then v at position 0, for every query."""
    model = own(name)
    layer = 1

    def edit(t, hook):
        if point == "hook_pattern":
            out = torch.zeros_like(t)
            out[..., 0] = 1.0
        else:
            out = torch.full_like(t, float("-inf"))
            out[..., 0] = 0.0
        return out

    names = [f"blocks.{layer}.attn.hook_v", f"blocks.{layer}.attn.hook_z", f"blocks.{layer}.attn.hook_pattern"]
    with model.hooks([(f"blocks.{layer}.attn.{point}", edit)]):
        _, cache = model.run_with_cache(tokens(2, N), names_filter=names)
    attn = model.blocks[layer].attn
    v0 = cache["v", layer][:, :1].repeat_interleave(attn.n_heads // attn.n_kv_heads, dim=2)  # [b, 1, head, d]
    torch.testing.assert_close(cache["z", layer], v0.expand_as(cache["z", layer]))
    assert torch.all(cache["pattern", layer][..., 0] == 1)


def test_hook_result_path_equals_fused_output():
    for name in ("rotary-rms-swiglu-gqa", "alibi-window-untied-bias", "learned-tied-rms"):
        model = own(name)
        toks, mask = tokens(2, N), left_mask(2, N)
        with torch.no_grad():
            ref = model(toks, attention_mask=mask)
            with model.hooks([(lambda n: n.endswith("hook_result"), lambda t, hook: None)]):
                out = model(toks, attention_mask=mask)
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_stop_and_start_at_layer_round_trip():
    for name in ("rotary-partial-parallel", "alibi-window-untied-bias"):
        model = own(name)
        toks, mask = tokens(2, N), left_mask(2, N)
        with torch.no_grad():
            full = model(toks, attention_mask=mask)
            for split in range(model.cfg.n_layers + 1):
                resid = model(toks, attention_mask=mask, stop_at_layer=split)
                assert resid.shape == (2, N, model.cfg.d_model)
                out = model(resid, attention_mask=mask, start_at_layer=split)
                torch.testing.assert_close(out, full, atol=1e-6, rtol=1e-6)
            loss = model(model(toks, stop_at_layer=1), start_at_layer=1, return_type="loss", tokens=toks)
            torch.testing.assert_close(loss, model(toks, return_type="loss"))


def test_window_one_attends_only_to_itself():
    """sliding_window=1: each query sees its own key only, so z is v at the same position."""
    model = build(small(positional="rotary", sliding_window=1))
    _, cache = model.run_with_cache(tokens(1, 6), names_filter=lambda n: n.startswith("blocks.0.attn"))
    torch.testing.assert_close(cache["pattern", 0], torch.eye(6).expand(1, 5, 6, 6))
    torch.testing.assert_close(cache["z", 0], cache["v", 0])
    with torch.no_grad(), model.attention("fused"):
        fused = model(tokens(1, 6))
    torch.testing.assert_close(fused, model.run_with_cache(tokens(1, 6), names_filter=lambda n: "pattern" in n)[0])


def test_per_head_weight_views_index_heads_and_edit_the_model():
    """W_Q [head, d_model, d_head], W_K/W_V [kv_head, ...], W_O [head, d_head, d_model] are views: a
    head's weights are where hooks see that head, and editing them in place edits the model."""
    model = build(OWN_CONFIGS["rotary-rms-swiglu-gqa"].replace(qkv_bias=True))
    attn = model.blocks[0].attn
    assert attn.W_Q.shape == (6, 48, 8) and attn.W_K.shape == attn.W_V.shape == (2, 48, 8) and attn.W_O.shape == (6, 8, 48)
    assert model.W_Q.shape == (2, 6, 48, 8) and model.W_K.shape == (2, 2, 48, 8)
    toks = tokens(2, N)
    names = ["blocks.0.ln1.hook_normalized", "blocks.0.attn.hook_q", "blocks.0.attn.hook_v", "blocks.0.attn.hook_result", "blocks.0.attn.hook_z"]
    _, cache = model.run_with_cache(toks, names_filter=names)
    x = cache["normalized", 0, "ln1"]
    torch.testing.assert_close(cache["q", 0][:, :, 4], x @ attn.W_Q[4] + attn.b_Q[4])
    torch.testing.assert_close(cache["v", 0][:, :, 1], x @ attn.W_V[1] + attn.b_V[1])
    torch.testing.assert_close(cache["result", 0][:, :, 3], cache["z", 0][:, :, 3] @ attn.W_O[3])
    with torch.no_grad():
        attn.W_Q[4].zero_()
        attn.b_Q[4].fill_(0.5)
    _, cache = model.run_with_cache(toks, names_filter="blocks.0.attn.hook_q")
    assert torch.all(cache["q", 0][:, :, 4] == 0.5) and not torch.all(cache["q", 0][:, :, 3] == 0.5)
