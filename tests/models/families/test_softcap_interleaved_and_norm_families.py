"""Four features and their families: soft-capping (Gemma 2), interleaved rotary (GPT-J), the embedding norm
(Bloom), OLMo 2's norms (QK-norm over the whole projections, norms only after attention and MLP).

Soft-capped attention on both backends against a float64 computation written out here, and the fused
path's blocks of queries held to their memory bound (no [q, k] pattern of the whole call); the streaming
statistics with the cap against the float64 oracle (torch tiles here, the Triton kernel under
TRITON_INTERPRET=1 in a subprocess); the final cap on every path to the logits (forward, the loss in
slabs); interleaved rotary against a hand rotation; for each family (tests/support/hf_cases.py: gemma2, gptj,
bloom, olmo2): greedy generation equal to transformers', weight processing that keeps the log-probs (or
refuses in one line), the pieces each one adds. Parity of logits and patterns on both backends with
padding is tests/models/families/test_hf_parity.py's, run on the same cases. Sizes are distinct primes where they can be,
so a transposition cannot pass.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import interp
import interp.kernels.attention as A
from core_models import fused_agreeing_with_instrumented, hf_pair, scored, small
from interp import HookedTransformer
from interp.kernels import attention_stats
from interp.kernels.stats import STAT_NAMES, Scoring
from interp.kernels.stats.reference import reference_stats
from interp.models.families import get_family
from interp.models.positions import Rotary
from near_ties import assert_greedy_agrees

transformers = pytest.importorskip("transformers")

FAMILIES = ["gemma2", "gptj", "bloom", "olmo2"]  # the cases of tests/support/hf_cases.py
VOCAB, N = 97, 12


def _tokens(batch: int, n: int, seed: int = 0, vocab: int = VOCAB) -> torch.Tensor:
    return torch.randint(3, vocab, (batch, n), generator=torch.Generator().manual_seed(seed))


def _left_mask(batch: int, n: int) -> torch.Tensor:
    mask = torch.ones(batch, n, dtype=torch.long)
    for i in range(1, batch):
        mask[i, : 2 * i + 1] = 0
    return mask


# ---- soft-capped attention: both backends against a hand computation ----------------------------------
def _hand_attention(q, k, v, *, scale, cap, window=None, key_valid=None, slopes=None, n_sink=0):
    """float64, pair by pair: scores q.k * scale, cap * tanh(. / cap), - slope |p - j|, softmax over the keys
    j <= p with p - j < window (or j < n_sink) that are real; a row with none sees its own key."""
    b, h, n_q, _ = q.shape
    kv, n_k = k.shape[1], k.shape[2]
    q, k, v = q.double(), k.double().repeat_interleave(h // kv, 1), v.double().repeat_interleave(h // kv, 1)
    out = torch.zeros(b, h, n_q, v.shape[-1], dtype=torch.float64)
    for bi in range(b):
        for i in range(n_q):
            p = n_k - n_q + i
            seen = [j for j in range(n_k) if j <= p and (window is None or p - j < window or j < n_sink)
                    and (key_valid is None or bool(key_valid[bi, j]))] or [p]
            for hi in range(h):
                s = torch.stack([q[bi, hi, i] @ k[bi, hi, j] * scale for j in seen])
                s = cap * torch.tanh(s / cap) if cap is not None else s
                if slopes is not None:
                    s = s - slopes[hi].double() * torch.tensor([abs(p - j) for j in seen], dtype=torch.float64)
                out[bi, hi, i] = torch.softmax(s, 0) @ v[bi, hi, seen]
    return out


CAP_CASES = {  # name: (n_q, n_k, window, n_sink, padded, alibi)
    "causal": (13, 13, None, 0, False, False),
    "suffix-padded": (5, 17, None, 0, True, False),  # decoding-like: queries the last 5 of 17 keys
    "window-sinks": (17, 17, 4, 2, True, False),
    "alibi-window": (13, 13, 5, 0, True, True),
}


def _cap_inputs(n_q, n_k, padded, alibi, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, 6, n_q, 7, generator=g) * 1.5  # 6 heads on 3 KV heads, d_head 7
    k, v = torch.randn(2, 3, n_k, 7, generator=g) * 1.5, torch.randn(2, 3, n_k, 7, generator=g)
    key_valid = None
    if padded:
        key_valid = torch.ones(2, n_k, dtype=torch.bool)
        key_valid[1, :3] = False
    slopes = 2.0 ** -torch.arange(1, 7, dtype=torch.float32) if alibi else None
    return q, k, v, key_valid, slopes


@pytest.mark.parametrize("case", list(CAP_CASES))
def test_soft_capped_attention_equals_a_hand_computation_on_both_backends(case, monkeypatch):
    n_q, n_k, window, n_sink, padded, alibi = CAP_CASES[case]
    q, k, v, key_valid, slopes = _cap_inputs(n_q, n_k, padded, alibi)
    want = _hand_attention(q, k, v, scale=0.37, cap=2.5, window=window, key_valid=key_valid, slopes=slopes, n_sink=n_sink)
    monkeypatch.setattr(A, "CAP_BLOCK", 3)  # the fused path in blocks of 3 queries (an odd edge at the end)
    for name, backend in A.ATTENTION_BACKENDS.items():
        mask = A.AttentionMask(n_q, n_k, key_valid=key_valid, n_sink=n_sink)
        got = backend(q, k, v, mask, Scoring(scale=0.37, window=window, alibi_slopes=slopes, softcap=2.5))
        real = 1.0 if key_valid is None else key_valid[:, None, -n_q:, None]  # real queries only
        assert float(((got.double() - want).abs() * real).max()) < 1e-5, name
    # Negative: the cap matters on these scores (it is not a no-op the comparison would pass anyway).
    plain = _hand_attention(q, k, v, scale=0.37, cap=None, window=window, key_valid=key_valid, slopes=slopes, n_sink=n_sink)
    assert float((plain - want).abs().max()) > 1e-2


def test_soft_cap_with_learned_sink_logits_agrees_on_both_backends(monkeypatch):
    """No model has both yet; the fused capped path still takes sink logits as the instrumented path does
    (one more column in the softmax, not capped) instead of dropping them."""
    q, k, v, key_valid, _ = _cap_inputs(11, 11, True, False)
    sink_logits = torch.tensor([0.5, -1.0, 2.0, 0.0, 1.5, -0.5])
    monkeypatch.setattr(A, "CAP_BLOCK", 4)
    mask = A.AttentionMask(11, 11, key_valid=key_valid)
    plain = Scoring(scale=0.37, softcap=2.5, window=6)
    sinks = Scoring(scale=0.37, softcap=2.5, window=6, sink_logits=sink_logits)
    fused = A.fused_attention(q, k, v, mask, sinks)
    torch.testing.assert_close(fused, A.instrumented_attention(q, k, v, mask, sinks), atol=2e-6, rtol=1e-5)
    assert float((fused - A.fused_attention(q, k, v, mask, plain)).abs().max()) > 1e-2


def test_soft_cap_is_a_backend_capability():
    needs = A.Needs(softcap=True)
    assert A.choose("auto", needs).name == "fused"
    plain = A.AttentionBackend("plain", A.fused_attention, gives_pattern=False, materialises=False)  # not declared
    assert plain.cannot(needs) == ["soft-capped attention scores"]


class _Shapes(TorchDispatchMode):
    """Records the shape and dtype of every tensor an aten op returns."""

    def __init__(self):
        super().__init__()
        self.seen: list[tuple[tuple[int, ...], torch.dtype, str]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor):
                self.seen.append((tuple(t.shape), t.dtype, str(func)))
        return out

    def tiles(self) -> list[tuple[int, int]]:
        """(rows, keys) of every [batch, head, rows, keys] softmax: the blocks of weights (and of scores)."""
        return [s[-2:] for s, _, f in self.seen if "softmax" in f and len(s) == 4]


def test_the_fused_capped_path_holds_one_block_of_scores_at_a_time(monkeypatch):
    """Fused soft-capped attention never builds the call's [q, k] scores: its blocks hold at most CAP_BLOCK
    queries, and fewer when CAP_TILE (floats of scores per block) says so; windows cut the keys too."""
    n = 97
    q, k, v, _, _ = _cap_inputs(n, n, False, False)
    mask = A.AttentionMask(n, n)
    capped = Scoring(scale=0.37, softcap=2.5)
    ref = A.instrumented_attention(q, k, v, mask, capped)
    monkeypatch.setattr(A, "CAP_BLOCK", 8)
    with _Shapes() as spy:
        out = A.fused_attention(q, k, v, mask, capped)
    tiles = spy.tiles()
    assert max(r for r, _ in tiles) == 8 and max(c for _, c in tiles) == n  # 8 queries, up to every key
    torch.testing.assert_close(out, ref, atol=2e-6, rtol=1e-5)
    monkeypatch.setattr(A, "CAP_TILE", 2 * 6 * 3 * n)  # batch * heads * 3 queries * all keys
    with _Shapes() as spy:
        out = A.fused_attention(q, k, v, mask, capped)
    assert max(r for r, _ in spy.tiles()) == 3
    torch.testing.assert_close(out, ref, atol=2e-6, rtol=1e-5)
    with _Shapes() as spy:  # a window of 5: each block reads only the keys its window reaches
        A.fused_attention(q, k, v, mask, Scoring(scale=0.37, softcap=2.5, window=5))
    assert max(c for _, c in spy.tiles()) <= 8 + 5 - 1
    with _Shapes() as spy:  # control: the instrumented path does build the whole [q, k]
        A.instrumented_attention(q, k, v, mask, capped)
    assert (n, n) in spy.tiles()


# ---- soft-capping in a model -----------------------------------------------------------------------------
CAPPED = small(positional="rotary", normalization="rmsnorm", act_fn="gelu_new", gated_mlp=True, n_layers=3,
               n_kv_heads=1, sliding_window=4, layer_types=("sliding", "full", "sliding"), sandwich_norms=True,
               attn_scores_soft_cap=2.0, output_logits_soft_cap=3.0, init_range=0.3)


@pytest.fixture(scope="module")
def capped():
    return HookedTransformer(CAPPED, seed=3).eval()


def test_hook_attn_scores_hands_the_capped_masked_scores(capped):
    toks, mask = _tokens(3, N, vocab=CAPPED.d_vocab), _left_mask(3, N)
    _, cache = capped.run_with_cache(toks, attention_mask=mask)
    for layer in range(3):
        q, k = cache["rot_q", layer].transpose(1, 2), cache["rot_k", layer].transpose(1, 2)  # [b, h, pos, d]
        raw = q @ k.transpose(-1, -2) * capped.cfg.scale
        scores = cache["attn_scores", layer]
        visible = scores > float("-inf")
        assert float(scores[visible].abs().max()) <= 2.0
        torch.testing.assert_close(scores[visible], (2.0 * torch.tanh(raw / 2.0))[visible], atol=1e-6, rtol=1e-6)
    fused = fused_agreeing_with_instrumented(capped, toks, mask)
    assert float(fused.abs().max()) <= 3.0  # the final cap


def test_the_loss_applies_the_final_cap_on_every_path(capped, monkeypatch):
    toks = _tokens(2, N, vocab=CAPPED.d_vocab)
    with torch.no_grad():
        logits = capped(toks)
        want = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, CAPPED.d_vocab), toks[:, 1:].reshape(-1))
        assert float((capped(toks, return_type="loss") - want).abs()) < 1e-6
        import interp.models.native.transformer as T
        monkeypatch.setattr(T, "_NLL_SLAB", 3 * capped.cfg.d_vocab)  # the loss in slabs of 3 rows
        assert float((capped(toks, return_type="loss") - want).abs()) < 1e-6
        # Negative: the uncapped logits give another loss.
        resid = capped(toks, stop_at_layer=capped.cfg.n_layers)
        raw = capped.ln_final(resid) @ capped.W_U
        other = torch.nn.functional.cross_entropy(raw[:, :-1].reshape(-1, raw.shape[-1]), toks[:, 1:].reshape(-1))
        assert float((other - want).abs()) > 1e-3


def test_cache_policies_that_score_by_attention_are_refused_with_a_cap(capped):
    """H2O / SnapKV / TOVA rank keys by attention computed without the cap: refused in one line; the
    policies that do not read attention keep working (generate's window cache among them)."""
    with pytest.raises(ValueError, match="soft-caps its attention scores"):
        capped.new_kv_cache(1, N, policy="h2o(4)")
    cache = capped.new_kv_cache(1, N, policy="knorm(4)")
    with torch.no_grad():
        capped(_tokens(1, N, vocab=CAPPED.d_vocab), kv_cache=cache)


def test_gemma2_caps_bend_the_logits():
    """Guard for the parity tests: with the caps of tests/support/hf_cases.py, dropping either one changes the logits."""
    hf, _ = hf_pair("gemma2")
    model = interp.from_hf(hf)  # its own copy: the shared pair is never edited
    toks = _tokens(3, N)
    with torch.no_grad():
        ref = hf(toks).logits
        assert float((model(toks) - ref).abs().max()) < 1e-4
        model.unembed.soft_cap = None
        assert float((model(toks) - ref).abs().max()) > 1e-2
        model.unembed.soft_cap = 4.0
        for b in model.blocks:
            b.attn.softcap = None
        assert float((model(toks) - ref).abs().max()) > 1e-2
    assert model.cfg.attn_scores_soft_cap == 3.0 and model.cfg.output_logits_soft_cap == 4.0
    assert model.cfg.window(0) == 5 and model.cfg.window(1) is None  # local, global, local


# ---- the streaming statistics with the cap ---------------------------------------------------------------
STATS_CASES = {  # name: (heads, kv_heads, n_q, n_k, window, left_pad, alibi, n_sink)
    "mha": (3, 3, 37, 37, None, None, False, 1),
    "gqa-window-padding": (6, 2, 29, 41, 7, [0, 5], False, 2),
    "alibi": (5, 5, 31, 31, None, [3, 0], True, 1),
}


def _stats_inputs(heads, kv_heads, n_q, n_k, left_pad, alibi):
    g = torch.Generator().manual_seed(1)
    q, k = torch.randn(2, heads, n_q, 11, generator=g) * 2, torch.randn(2, kv_heads, n_k, 11, generator=g) * 2
    half = torch.randint(0, 7, (2, (n_k + 1) // 2), generator=g)
    extra = dict(tokens=torch.cat([half, half], 1)[:, :n_k])
    if left_pad is not None:
        extra["key_padding_mask"] = torch.arange(n_k)[None] >= torch.tensor(left_pad)[:, None]
    if alibi:
        extra["alibi_slopes"] = 2.0 ** -torch.arange(1, heads + 1, dtype=torch.float32)
    return q, k, extra


def _max_diff(got, want) -> float:
    worst = 0.0
    for name in STAT_NAMES:
        a, b = getattr(got, name).double(), want[name]
        assert torch.equal(a.isnan(), b.isnan()), name
        ok = ~b.isnan()
        worst = max(worst, float((a[ok] - b[ok]).abs().max()))
    return worst


@pytest.mark.parametrize("case", list(STATS_CASES))
def test_stats_with_the_cap_equal_the_float64_oracle(case):
    heads, kv, n_q, n_k, window, left_pad, alibi, n_sink = STATS_CASES[case]
    q, k, extra = _stats_inputs(heads, kv, n_q, n_k, left_pad, alibi)
    args = dict(window=window, n_sink=n_sink, scale=0.3, **extra)
    want = reference_stats(q, k, **scored(softcap=2.5, **args))
    for blocks in ((8, 16), (5, 3), (None, None)):
        got = attention_stats(q, k, **scored(backend="torch", block_q=blocks[0], block_k=blocks[1], softcap=2.5, **args))
        assert _max_diff(got, want) < 1e-5, blocks
    uncapped = reference_stats(q, k, **scored(**args))
    assert float((uncapped["entropy"] - want["entropy"]).nan_to_num().abs().max()) > 1e-2  # the cap matters


def test_model_stats_use_each_layers_cap(capped):
    """`attention_stats` of a capped model (from tokens, and from a KV cache) equals the statistics of its
    own instrumented patterns."""
    toks = _tokens(2, N, vocab=CAPPED.d_vocab)
    _, cache = capped.run_with_cache(toks, names_filter=lambda n: n.endswith("hook_pattern"))
    stats = capped.attention_stats(toks)
    kv = capped.new_kv_cache(2, N, capture_queries=True)
    with torch.no_grad():
        capped(toks, kv_cache=kv)
    from_cache = capped.attention_stats(kv_cache=kv)
    for layer in range(3):
        pattern = cache["pattern", layer]
        for st in (stats[layer], from_cache[layer]):
            torch.testing.assert_close(st.max, pattern.amax(-1), atol=1e-5, rtol=0)
            torch.testing.assert_close(st.sink, pattern[..., 0], atol=1e-5, rtol=0)
            entropy = -torch.special.xlogy(pattern, pattern).sum(-1)
            torch.testing.assert_close(st.entropy, entropy, atol=1e-5, rtol=0)


def _triton_worker() -> None:
    """With TRITON_INTERPRET=1 (this file run as a script): print ``RESULTS {case: max abs diff}``."""
    out = {}
    for case, (heads, kv, n_q, n_k, window, left_pad, alibi, n_sink) in STATS_CASES.items():
        q, k, extra = _stats_inputs(heads, kv, n_q, n_k, left_pad, alibi)
        args = dict(window=window, n_sink=n_sink, scale=0.3, **extra)
        got = attention_stats(q, k, **scored(backend="triton", block_q=16, block_k=16, softcap=2.5, **args))
        out[case] = _max_diff(got, reference_stats(q, k, **scored(softcap=2.5, **args)))
    print("RESULTS " + json.dumps(out))


@pytest.mark.triton
def test_triton_stats_with_the_cap_equal_the_float64_oracle():
    pytest.importorskip("triton")
    proc = subprocess.run([sys.executable, __file__, "--triton-worker"], capture_output=True, text=True,
                          env=dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(Path(__file__).resolve().parents[2] / "support")),
                          timeout=600, cwd=tempfile.gettempdir())
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULTS ")]
    assert proc.returncode == 0 and lines, proc.stdout + proc.stderr
    diffs = json.loads(lines[-1][len("RESULTS "):])
    assert set(diffs) == set(STATS_CASES) and max(diffs.values()) < 1e-5, diffs


# ---- interleaved rotary --------------------------------------------------------------------------------------
def test_adjacent_pair_rotary_equals_a_hand_rotation():
    cfg = small(positional="rotary", d_model=42, n_heads=3, rotary_dim=10, rotary_base=97.0, rotary_adjacent_pairs=True)
    rotary = Rotary(cfg)
    positions = torch.tensor([[0, 3, 7, 11, 13]])
    x = torch.randn(1, 5, 3, 14, generator=torch.Generator().manual_seed(0))  # d_head 14, 10 of them rotate
    cos, sin = rotary.cos_sin(positions, torch.float32)
    got = Rotary.rotate_adjacent(x, cos, sin)
    want = x.clone()
    for t, p in enumerate(positions[0].tolist()):
        for i in range(5):  # pair (2i, 2i + 1) turns by p * base ** (-2i / rotary_dim)
            angle = p * 97.0 ** (-2 * i / 10)
            a, b = x[0, t, :, 2 * i], x[0, t, :, 2 * i + 1]
            want[0, t, :, 2 * i] = a * math.cos(angle) - b * math.sin(angle)
            want[0, t, :, 2 * i + 1] = b * math.cos(angle) + a * math.sin(angle)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    halves = Rotary(cfg.replace(rotary_adjacent_pairs=False))
    assert float((Rotary.rotate(x, *halves.cos_sin(positions, torch.float32)) - want).abs().max()) > 1e-2  # not rotate-half
    model = HookedTransformer(cfg)
    assert all(b.attn.rotate == Rotary.rotate_adjacent for b in model.blocks)


# ---- each family against transformers ---------------------------------------------------------------------
@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("name", FAMILIES)
def test_generate_equals_transformers(name, padded):
    """Greedy tokens through our KV cache equal transformers' generate(do_sample=False), left-padded prompts
    too; 10 new tokens after 6 cross Gemma 2's window of 5."""
    hf, model = hf_pair(name)
    prompt = _tokens(3, 6, seed=4)
    mask = _left_mask(3, 6) if padded else torch.ones_like(prompt)
    with torch.no_grad():
        ref = hf.generate(prompt, attention_mask=mask, max_new_tokens=10, do_sample=False, pad_token_id=0,
                          eos_token_id=None, output_scores=True, return_dict_in_generate=True)
    out = model.generate(prompt, attention_mask=mask if padded else None, max_new_tokens=10)
    assert_greedy_agrees(out, ref.sequences, torch.stack(ref.scores, dim=1), start=6)


@pytest.mark.parametrize("name", FAMILIES)
def test_weight_processing_keeps_the_log_probs(name):
    hf, _ = hf_pair(name)
    toks = _tokens(3, N)
    capped = name == "gemma2"
    model = interp.from_hf(hf, fold_ln=True, center_writing_weights=True, center_unembed=not capped, fold_value_biases=True)
    with torch.no_grad():
        want = hf(toks).logits.log_softmax(-1)
        assert float((model(toks).log_softmax(-1) - want).abs().max()) < 1e-4
        compat = interp.from_hf(hf).enable_compatibility_mode()  # TransformerLens's defaults, as its bridge
        assert float((compat(toks).log_softmax(-1) - want).abs().max()) < 1e-4
    assert compat.runtime.processing["center_unembed"] is (not capped)
    if capped:
        with pytest.raises(ValueError, match=r"soft-caps its logits .*pass center_unembed=False"):
            interp.from_hf(hf, center_unembed=True)


@pytest.mark.parametrize("name", FAMILIES)
def test_config_round_trips_and_counts_its_parameters(name):
    _, model = hf_pair(name)
    cfg = model.cfg
    assert type(cfg).from_dict(cfg.to_dict()) == cfg
    assert cfg.n_params() == sum(p.numel() for p in model.parameters())
    assert cfg.original_architecture == {"gemma2": "Gemma2ForCausalLM", "gptj": "GPTJForCausalLM",
                                         "bloom": "BloomForCausalLM", "olmo2": "Olmo2ForCausalLM"}[name]


@pytest.mark.parametrize("name", FAMILIES)
def test_saved_in_our_format_loads_back(name, tmp_path):
    hf, model = hf_pair(name)
    model.save(tmp_path)
    again = interp.load(tmp_path)
    assert again.cfg == model.cfg
    toks = _tokens(2, N)
    with torch.no_grad():
        assert float((again(toks) - hf(toks).logits).abs().max()) < 1e-4


@pytest.mark.parametrize("backend", ["fused", "instrumented"])
@pytest.mark.parametrize("name", FAMILIES)
def test_every_hook_fires_once(name, backend):
    _, model = hf_pair(name)
    names = [n for n in model.hook_dict if backend == "instrumented" or not n.endswith(("hook_attn_scores", "hook_pattern"))]
    fired = Counter()
    with model.attention(backend), model.hooks([(n, lambda t, hook: fired.update([hook.name])) for n in names]):
        model(_tokens(2, N))
    assert fired == Counter({n: 1 for n in names})


@pytest.mark.parametrize("name, key, value, message", [
    ("gemma2", "use_bidirectional_attention", True, "use_bidirectional_attention=True"),
    ("gemma2", "hidden_activation", "relu2", "hidden_activation='relu2'"),
    ("gptj", "rotary_dim", None, "rotary_dim=None"),
    ("gptj", "tie_word_embeddings", True, "tie_word_embeddings=True"),
    ("bloom", "apply_residual_connection_post_layernorm", True, "apply_residual_connection_post_layernorm=True"),
    ("olmo2", "attention_bias", True, "attention_bias=True"),
])
def test_config_values_a_family_cannot_represent_raise(name, key, value, message):
    hf, _ = hf_pair(name)
    d = {**hf.config.to_dict(), key: value}
    with pytest.raises(NotImplementedError, match=message):
        get_family(d["model_type"]).config(d)


def test_gemma2_caps_default_to_transformers_and_turn_off_with_null():
    hf, _ = hf_pair("gemma2")
    d = {k: v for k, v in hf.config.to_dict().items() if k not in ("attn_logit_softcapping", "final_logit_softcapping")}
    cfg = get_family("gemma2").config(d)
    assert (cfg.attn_scores_soft_cap, cfg.output_logits_soft_cap) == (50.0, 30.0)  # Gemma2Config's defaults
    cfg = get_family("gemma2").config({**d, "attn_logit_softcapping": None, "final_logit_softcapping": None})
    assert cfg.attn_scores_soft_cap is None and cfg.output_logits_soft_cap is None
    d.pop("layer_types")
    assert get_family("gemma2").config(d).layer_types == ("sliding", "full", "sliding")


def test_bloom_slopes_are_ours_for_any_head_count():
    from transformers.models.bloom.modeling_bloom import build_alibi_tensor

    from interp.models.positions import alibi_slopes

    for heads in range(1, 21):
        theirs = build_alibi_tensor(torch.ones(1, 2), heads, torch.float32).view(heads, 2)[:, 1]  # slope * position 1
        torch.testing.assert_close(alibi_slopes(heads), theirs, rtol=1e-6, atol=0)


def test_bloom_embedding_norm_feeds_hook_embed():
    hf, model = hf_pair("bloom")
    toks = _tokens(2, N)
    _, cache = model.run_with_cache(toks)
    with torch.no_grad():
        want = hf.transformer.word_embeddings_layernorm(hf.transformer.word_embeddings(toks))
    torch.testing.assert_close(cache["hook_embed"], want, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(cache["embed_ln.hook_normalized"], want, atol=1e-6, rtol=1e-6)
    assert cache["embed_ln.hook_scale"].shape == (2, N, 1)
    assert torch.equal(cache["embed_ln.hook_out"], cache["hook_embed"])  # TransformerLens 4's name for it
    assert model.cfg.post_embedding_ln and model.cfg.positional == "alibi" and model.cfg.tie_embeddings
    # Negative: without the embedding norm the logits change (on a copy: the shared pair is never edited).
    other = interp.from_hf(hf)
    other.embed_ln = None
    with torch.no_grad():
        assert float((other(toks) - hf(toks).logits).abs().max()) > 1e-2


def test_gptj_shares_its_one_norm_and_rotates_in_pairs():
    hf, model = hf_pair("gptj")
    cfg = model.cfg
    assert cfg.parallel_attn_mlp and cfg.rotary_adjacent_pairs and cfg.rot_dim == 4 < cfg.head_dim == 8
    for block in model.blocks:
        assert torch.equal(block.ln1.w, block.ln2.w) and torch.equal(block.ln1.b, block.ln2.b)
    assert cfg.unembed_bias and not cfg.qkv_bias and not cfg.attn_out_bias and cfg.mlp_bias
    toks = _tokens(2, N)
    other = interp.from_hf(hf)  # Negative: rotate-half (GPT-NeoX's layout) on the same weights gives other logits
    for b in other.blocks:
        b.attn.rotate = Rotary.rotate
    with torch.no_grad():
        assert float((other(toks) - hf(toks).logits).abs().max()) > 1e-3


@pytest.mark.parametrize("name", ["gemma2", "gptj"])
def test_streaming_cache_positions_rotate_and_cap_as_the_model(name):
    """StreamingLLM's positions='cache' recomputes the sink keys' scores itself. While the cache is never
    full (window + sinks cover the sequence) its renumbering is the identity, so it must equal
    positions='original' (the model's own masks): it does only if it rotates in the model's layout (GPT-J's
    adjacent pairs) and caps the scores as the model does (Gemma 2)."""
    from interp.analyses.streaming import streaming_loss

    _, model = hf_pair(name)
    toks = _tokens(2, N, seed=5)
    cache = streaming_loss(model, toks, N - 2, 2, positions="cache")
    original = streaming_loss(model, toks, N - 2, 2, positions="original")
    torch.testing.assert_close(cache, original, atol=1e-5, rtol=1e-5)
    assert float((cache - streaming_loss(model, toks, N - 2, 0)).abs().max()) > 1e-4  # the sinks matter here


@pytest.mark.parametrize("name", FAMILIES)
def test_from_transformer_lens_bridge_plain_and_processed(name):
    """TransformerLens 4's bridge on the same weights converts back to ours, before and after its weight
    processing (Bloom's embedding norm included); `from_transformer_lens` checks the logits itself."""
    pytest.importorskip("transformer_lens")
    from interp.interop import bridge_from_hf, from_transformer_lens

    hf, _ = hf_pair(name)
    bridge = bridge_from_hf(hf)
    toks = _tokens(2, N)
    for _ in ("plain", "processed"):
        ours = from_transformer_lens(bridge)
        with torch.no_grad():
            torch.testing.assert_close(ours(toks).log_softmax(-1), hf(toks).logits.log_softmax(-1), atol=1e-4, rtol=1e-4)
        bridge.enable_compatibility_mode()


def test_olmo2_norms_come_after_and_qk_norm_spans_the_projection():
    hf, model = hf_pair("olmo2")
    cfg = model.cfg
    assert cfg.qk_norm and cfg.qk_norm_over == "projection" and cfg.sandwich_norms and not cfg.pre_norms
    attn = model.blocks[0].attn
    assert attn.q_norm.w.shape == (6 * 8,) and attn.k_norm.w.shape == (2 * 8,)
    assert isinstance(model.blocks[0].ln1, torch.nn.Identity) and isinstance(model.blocks[0].ln2, torch.nn.Identity)
    toks = _tokens(2, N)
    fired = Counter()
    with model.hooks([(lambda n: True, lambda t, hook: fired.update([hook.name]))]):
        model(toks)
    assert fired == Counter({n: 1 for n in model.hook_dict})
    assert not any(".ln1." in n or ".ln2." in n for n in model.hook_dict)
    _, cache = model.run_with_cache(toks)
    assert cache["blocks.0.attn.q_norm.hook_scale"].shape == (2, N, 1)  # one scale over all heads
    q = cache["blocks.0.attn.hook_q"]
    by_head = q / q.pow(2).mean(-1, keepdim=True).add(cfg.norm_eps).sqrt() * attn.q_norm.w.detach().view(6, 8)
    whole = q / q.flatten(-2).pow(2).mean(-1)[..., None, None].add(cfg.norm_eps).sqrt() * attn.q_norm.w.detach().view(6, 8)
    torch.testing.assert_close(cache["blocks.0.attn.hook_q_normed"], whole, atol=1e-5, rtol=1e-5)
    assert float((by_head - whole).abs().max()) > 1e-2  # per head would be another model
    # Processing folds only what exists: ln_final into W_U; the post-norms and QK-norms stay.
    folded = interp.from_hf(hf, fold_ln=True)
    assert torch.equal(folded.blocks[0].ln1_post.w, model.blocks[0].ln1_post.w)
    assert torch.equal(folded.ln_final.w, torch.ones_like(folded.ln_final.w))


if __name__ == "__main__" and "--triton-worker" in sys.argv:
    _triton_worker()
