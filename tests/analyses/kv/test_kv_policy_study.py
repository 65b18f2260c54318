"""The KV-cache policy study (`interp.analyses.kv.policies`, `interp kv --task passkey`) against
computations written out here, never against the module's own output:

- perplexity: `full` is exp(mean next-token cross-entropy) of a plain forward over exactly the
  positions the protocol feeds; a streaming policy is the same over a forward whose attention scores
  are masked by hand to sinks + window; KIVI in chunks of its residual is token-by-token decoding;
  bytes per token are what each policy holds, counted by hand;
- answers: the full cache's greedy continuation is `model.generate`'s, and a policy that shares the
  full prefill (KIVI, H2O, SnapKV) answers as a cache that ran its own prefill does;
- cell counts and the headline sentences from frames built by hand;
- the CLI end to end on a zoo model, and bad settings refused in one line (exit 2) before the model
  loads, with nothing written.
"""

from __future__ import annotations

import copy
import json
import math
import re

import pandas as pd
import pytest
import torch
from core_models import build, small, tokens
from smol import needs_smol

import interp
from interp.analyses.kv.policies import (
    answer,
    cell_table,
    headline,
    passkey_table,
    policy_perplexity,
    policy_runs,
)
from interp.analyses.kv.tasks import retrieval_prompts
from interp.cli import main as cli

from spies import refuse_loading

REQUIRED = ["policy", "selection", "tokens_per_head", "full_fraction", "seed", "length", "depth", "correct", "n", "accuracy", "perplexity",
            "bytes_per_token"]


# ---- computations written out ---------------------------------------------------------------------
def streaming_rows(n: int, sinks: int, window: int) -> torch.Tensor:
    """bool [n, n]: query i sees key j <= i when j is one of the first `sinks` or i - j < window."""
    i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
    return (j <= i) & ((j < sinks) | (i - j < window))


def masked_forward(model, toks: torch.Tensor, sees: torch.Tensor) -> torch.Tensor:
    """Logits of a plain forward whose attention scores, in every layer and head, are -inf where
    `sees` [n, n] is False."""

    def mask(scores, hook):
        return scores.masked_fill(~sees.to(scores.device), float("-inf"))

    hooks = [(f"blocks.{layer}.attn.hook_attn_scores", mask) for layer in range(model.cfg.n_layers)]
    return model.run_with_hooks(toks, fwd_hooks=hooks)


def fed_perplexity(logits: torch.Tensor, toks: torch.Tensor, prefix: int) -> float:
    """exp of the mean cross-entropy of positions prefix .. T-2 predicting tokens prefix+1 .. T-1: the
    positions fed through the cache after a prefill of `prefix` tokens (the last fed token predicts
    nothing)."""
    logp = torch.log_softmax(logits[0, prefix:-1].double(), dim=-1)
    nll = -logp.gather(-1, toks[0, prefix + 1 :, None])
    assert nll.shape[0] == toks.shape[1] - prefix - 1
    return math.exp(float(nll.mean()))


def greedy(model, toks: torch.Tensor, k: int, policy: str):
    """k greedy tokens through a `policy` cache that runs its own prefill of `toks` (the last token
    is not fed), and the cache."""
    cache = model.new_kv_cache(1, toks.shape[1] + k, policy=policy)
    logits, ids = model(toks, kv_cache=cache)[:, -1], []
    for step in range(k):
        nxt = logits.argmax(-1)
        ids.append(int(nxt))
        if step < k - 1:
            logits = model(nxt[:, None], kv_cache=cache)[:, -1]
    return ids, cache


def key_found(text: str, key: str) -> bool:
    return re.search(rf"(?<!\d){key}(?!\d)", text) is not None


# ---- models -----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def gqa():
    """Rotary, RMSNorm, 4 query heads on 2 KV heads of 32 channels (KIVI's default group divides it)."""
    return build(small(positional="rotary", normalization="rmsnorm", act_fn="silu", gated_mlp=True, d_model=128,
                       n_heads=4, n_kv_heads=2, n_ctx=160, n_layers=2))


@pytest.fixture(scope="module")
def zoo():
    return interp.load("rope-gqa-4l")  # bytes tokenizer, rotary, 4 query heads on 2 KV heads, n_ctx 256


# ---- 1. perplexity -----------------------------------------------------------------------------------
@pytest.mark.parametrize("n, prefix, chunk", [(100, None, 32), (97, 33, 7), (60, 40, 64)])
@torch.no_grad()
def test_perplexity_of_full_and_streaming_is_the_written_out_loss(gqa, n, prefix, chunk):
    toks = tokens(1, n, seed=n)
    sinks, window = 3, 16
    got = policy_perplexity(gqa, toks, policy_runs(f"full,streaming({sinks},{window})"), prefix=prefix,
                            chunk=chunk, progress_bar=False)
    p = n // 2 if prefix is None else prefix
    full = fed_perplexity(gqa(toks), toks, p)
    streaming = fed_perplexity(masked_forward(gqa, toks, streaming_rows(n, sinks, window)), toks, p)
    assert got["full"][0] == pytest.approx(full, rel=1e-5)
    assert got[f"streaming({sinks},{window})"][0] == pytest.approx(streaming, rel=1e-5)
    assert abs(streaming / full - 1) > 1e-3  # the window changed something: the test can tell them apart
    # bytes per token at the end, by hand: full holds every token's key and value (fp32) in every
    # (layer, KV head); streaming holds sinks + window of them, each with an int32 slot
    d, heads = gqa.cfg.head_dim, gqa.cfg.n_layers * gqa.cfg.kv_heads
    assert got["full"][1] == pytest.approx(heads * 2 * d * 4)
    assert got[f"streaming({sinks},{window})"][1] == pytest.approx(heads * (sinks + window) * (2 * d * 4 + 4) / n)


@pytest.mark.parametrize("prefix", [75, 64, 37])
@torch.no_grad()
def test_kivi_in_chunks_of_its_residual_is_token_by_token_decoding(gqa, prefix):
    """The module's protocol: chunks of KIVI's residual (32) give token-by-token numbers exactly, at any
    prefix (chunks that started at the prefix would read a group in full precision after it flushed).

    In float64. In float32 a chunk's keys and values (a [32, d] matmul) and a token's ([1, d]) differ by
    round-off whose sign depends on the CPU's kernels, and KIVI-2's 2-bit codes flip where a value sits at
    a rounding boundary: on an AVX-512/AMX Xeon kivi2 gave 504.94 chunked vs 506.19 token by token (this
    test at prefix 64). In float64 the two differ by ~1e-16, far inside the float32 the quantizer reads
    (`kv_quant` quantizes x.float()), so both sides quantize the same values on any CPU and what is left
    is the protocol: which tokens are codes and which are still in full precision at each step."""
    n = 150
    toks = tokens(1, n, seed=prefix)
    gqa = copy.deepcopy(gqa).double()
    got = policy_perplexity(gqa, toks, policy_runs("kivi4,kivi2"), prefix=prefix, chunk=32, progress_bar=False)
    for name in ("kivi4", "kivi2"):
        cache = gqa.new_kv_cache(1, n, policy=name)
        gqa(toks[:, :prefix], kv_cache=cache)
        nll = []
        for i in range(prefix, n - 1):
            logp = torch.log_softmax(gqa(toks[:, i : i + 1], kv_cache=cache)[0, -1].double(), -1)
            nll.append(-float(logp[toks[0, i + 1]]))
        assert got[name][0] == pytest.approx(math.exp(sum(nll) / len(nll)), rel=1e-5), name


# ---- 2. answers ------------------------------------------------------------------------------------
def test_answers_are_greedy_decoding_and_the_shared_prefill_changes_nothing(zoo):
    k = 6
    prompts = retrieval_prompts(zoo, [248], [0.2, 0.8], 1, seed=3)
    runs = policy_runs("full,kivi4,h2o(64),snapkv(64,16,5),streaming(4,32)")
    embeds = []  # the prompt's forwards: one full prefill shared by full, KIVI, H2O, SnapKV; streaming its own
    with zoo.hooks(fwd_hooks=[("hook_embed", lambda x, hook: embeds.append(x.shape[1]))]):
        answers = [answer(zoo, p, runs, max_new_tokens=k) for p in prompts]
    assert [e for e in embeds if e > 1] == [p.n_tokens for p in prompts for _ in range(2)]

    table = passkey_table(zoo, prompts, runs, max_new_tokens=k, progress_bar=False)
    assert len(table) == len(prompts) * len(runs)
    for p, got in zip(prompts, answers):
        by = {a["label"]: a for a in got}
        assert [a["label"] for a in got] == [r.label for r in runs]
        want = zoo.generate(p.tokens, max_new_tokens=k, stop_at_eos=False)[0, p.n_tokens :]
        assert len(want) == k and by["full"]["text"] == zoo.tokenizer.decode(want.tolist())
        for name in ("kivi4", "h2o(64)", "snapkv(64,16,5)"):
            ids, own = greedy(zoo, p.tokens, k, name)
            assert by[name]["text"] == zoo.tokenizer.decode(ids), name
            assert by[name]["bytes_per_token"] == pytest.approx(own.bytes_per_token()), name  # the same entries held
        rows = table[table["key"] == p.key].set_index("policy")
        for a in got:
            row = rows.loc[a["label"]]
            assert row["answer"] == a["text"] and bool(row["correct"]) == key_found(a["text"], p.key)
            assert (row["length"], row["depth"], row["seed"], row["n_tokens"]) == (248, p.depth, 3, p.n_tokens)
    assert dict(zip(table["policy"], table["tokens_per_head"])) == pytest.approx(
        {"full": math.nan, "kivi4": math.nan, "h2o(64)": 64, "snapkv(64,16,5)": 64, "streaming(4,32)": 36},
        nan_ok=True)


def test_a_window_up_to_the_requested_length_runs_though_the_prompt_is_shorter(zoo):
    """A prompt holds a unit or so fewer tokens than asked (246 of 248); a window that fits the length
    asked for plus the answer is what the CLI accepts before any prompt exists, so the study runs it."""
    prompt = retrieval_prompts(zoo, [248], [0.5], 1, seed=0)[0]
    assert prompt.n_tokens < 248
    table = passkey_table(zoo, [prompt], policy_runs("streaming(4,248)"), max_new_tokens=4, progress_bar=False)
    ids, _ = greedy(zoo, prompt.tokens, 4, "full")  # the window covers everything: the full model's answer
    assert table["answer"].tolist() == [zoo.tokenizer.decode(ids)]


# ---- 3. cells -------------------------------------------------------------------------------------
def test_cell_counts_are_the_sums_by_hand():
    outcomes = {  # (policy, budget, length, depth) -> correct per prompt
        ("full", None, 248, 0.1): [True, True, False], ("full", None, 248, 0.5): [False, False, False],
        ("full", None, 500, 0.1): [True, True, True], ("h2o(48)", 48, 248, 0.1): [False, True, False],
        ("h2o(48)", 48, 248, 0.5): [True, False, False], ("h2o(48)", 48, 500, 0.1): [False, False, False],
    }
    bytes_at = {("full", 248): 2048.0, ("full", 500): 2048.0, ("h2o(48)", 248): 400.0, ("h2o(48)", 500): 210.0}
    rows = [dict(policy=pol, selection="all", tokens_per_head=budget, variant="passkey", length=length, depth=depth, seed=7,
                 key=f"{10000 + i}", n_tokens=length - 2, answer="", correct=ok,
                 bytes_per_token=bytes_at[pol, length] + i)
            for (pol, budget, length, depth), oks in outcomes.items() for i, ok in enumerate(oks)]
    cells = cell_table(pd.DataFrame(rows), {"full": (7.5, 2048.0)})  # no perplexity for h2o(48)
    assert set(REQUIRED) <= set(cells.columns)
    assert len(cells) == len(outcomes)
    for (pol, budget, length, depth), oks in outcomes.items():
        row = cells[(cells["policy"] == pol) & (cells["length"] == length) & (cells["depth"] == depth)]
        assert len(row) == 1
        row = row.iloc[0]
        assert (row["correct"], row["n"]) == (sum(oks), len(oks))
        assert row["accuracy"] == pytest.approx(sum(oks) / len(oks))
        assert row["bytes_per_token"] == pytest.approx(bytes_at[pol, length] + 1)  # mean of +0, +1, +2
        assert (row["selection"], row["seed"]) == ("all", 7)
        assert (math.isnan(row["tokens_per_head"]) if budget is None else row["tokens_per_head"] == budget)
        assert row["perplexity"] == 7.5 if pol == "full" else math.isnan(row["perplexity"])


# ---- 4. the CLI -------------------------------------------------------------------------------------
def test_the_cli_writes_the_study(tmp_path, capsys):
    out = tmp_path / "study"
    # streaming(4,250): as wide as the length asked for plus the answer allow (the prompts are shorter)
    policies = ["full", "streaming(4,32)", "kivi4", "h2o(48)", "streaming(4,250)"]
    argv = ["kv", "passkey", "attn-only-2l", "--lengths", "248", "--depths", "0.3,0.7", "--prompts", "2",
            "--policies", ",".join(policies), "--seq-len", "256", "--new-tokens", "6", "--seed", "1", "--out",
            str(out), "--no-progress"]
    assert cli(argv) == 0, capsys.readouterr().err
    for name in ("kv_policies.parquet", "kv_passkey_answers.parquet", "report.html", "report.md", "settings.json",
                 "figures/kv_policies.png"):
        assert (out / name).is_file(), name
    cells = pd.read_parquet(out / "kv_policies.parquet")
    assert set(REQUIRED) <= set(cells.columns)
    assert cells["policy"].unique().tolist() == policies
    per_policy = 2 * 1 * 2  # prompts x lengths x depths
    assert cells.groupby("policy")["n"].sum().to_dict() == {p: per_policy for p in policies}
    assert (cells["accuracy"] == cells["correct"] / cells["n"]).all()
    assert set(cells["depth"]) == {0.3, 0.7} and set(cells["length"]) == {248} and set(cells["seed"]) == {1}
    answers = pd.read_parquet(out / "kv_passkey_answers.parquet")
    assert len(answers) == 4 * len(policies)
    recount = answers.groupby(["policy", "depth"])["correct"].sum()
    for r in cells.itertuples():
        assert r.correct == recount[r.policy, r.depth]
    assert all(key_found(a, k) == c for a, k, c in zip(answers["answer"], answers["key"], answers["correct"]))
    report = (out / "report.md").read_text()
    full = int(cells.loc[cells["policy"] == "full", "correct"].sum())
    assert f"attn-only-2l finds the pass key with the full cache in {full} of 4 at 248 tokens." in report
    for p in policies[1:]:
        k = int(cells.loc[cells["policy"] == p, "correct"].sum())
        assert re.search(rf"{re.escape(p)}: [0-9.]+x the full cache's bytes per token, perplexity [+-][0-9.]+%, "
                         rf"{k} of 4 at 248 tokens\.", report), p
    assert "<html" in (out / "report.html").read_text().lower()
    settings = json.loads((out / "settings.json").read_text())
    from interp.analyses import evaldata

    pinned = evaldata.manifest()[evaldata.LANGUAGE_REFERENCE]["sha256"]  # the perplexity text, named (issue 36)
    assert settings["data_source"]["sha256"] == pinned and f"sha256 {pinned}" in report
    assert settings["policies"] == policies and settings["lengths"] == [248] and settings["depths"] == [0.3, 0.7]
    assert settings["seeds"] == [1] and settings["max_new_tokens"] == 6 and settings["perplexity_tokens"] == 256


@pytest.mark.parametrize("change, message", [
    ({"--policies": "full,lru"}, "unknown KV-cache policy 'lru'"),
    ({"--policies": "full,streaming(4,4000)"}, "streaming(4,4000): the window must be between 1 and"),
    ({"--policies": "h2o(0)"}, "h2o(0): the budget must be between 1"),
    ({"--depths": "0.5,1.5"}, "--depths 1.5"),
    ({"--prompts": "0"}, "--prompts must be >= 1"),
    ({"--lengths": "248,300"}, "--lengths 300: prompts plus 8 answer tokens must fit this model's context (n_ctx=256)"),
    ({"--lengths": "248,248"}, "--lengths repeats 248"),
    ({"--seq-len": "4096"}, "4096 tokens (--seq-len) is longer than this model's context (n_ctx=256)"),
    ({"--policies": "full,full"}, "listed twice: full"),
])
def test_bad_settings_are_one_line_before_the_model_loads(tmp_path, capsys, monkeypatch, change, message):
    refuse_loading(monkeypatch)
    out = tmp_path / "out"
    settings = {"--lengths": "248", "--depths": "0.5", "--prompts": "1", "--seq-len": "128",
                "--policies": "full", "--out": str(out), **change}
    assert cli(["kv", "passkey", "attn-only-2l", *[x for kv in settings.items() for x in kv], "--no-progress"]) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith("error: ") and captured.err.count("\n") == 1, captured.err
    assert message in captured.err, captured.err
    assert not out.exists(), "nothing may be written"


def test_a_folder_holding_a_users_file_is_refused_and_the_file_untouched(tmp_path, capsys, monkeypatch):
    refuse_loading(monkeypatch)
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("my notes")
    argv = ["kv", "passkey", "attn-only-2l", "--lengths", "248", "--depths", "0.5", "--prompts", "1",
            "--seq-len", "128", "--policies", "full", "--out", str(out), "--no-progress"]
    assert cli(argv) == 2
    err = capsys.readouterr().err
    assert "already holds files interp did not write (notes.txt)" in err and err.count("\n") == 1, err
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"] and (out / "notes.txt").read_text() == "my notes"


# ---- 6. the headline -------------------------------------------------------------------------------
def _cells(variant="passkey"):
    """Two depths per length, 2 prompts each: full 2 of 4 at 248 and 3 of 4 at 500; streaming 0 of 4
    and 1 of 4; kivi4 4 of 4 at 248 only."""
    counts = {("full", 248): (1, 1), ("full", 500): (2, 1), ("streaming(4,32)", 248): (0, 0),
              ("streaming(4,32)", 500): (0, 1), ("kivi4", 248): (2, 2)}
    return pd.DataFrame([dict(policy=p, selection="all", tokens_per_head=None, seed=0, variant=variant, length=L, depth=d,
                              correct=c, n=2, accuracy=c / 2, perplexity=math.nan, bytes_per_token=1.0)
                         for (p, L), cs in counts.items() for d, c in zip((0.2, 0.6), cs)])


SUMMARY = pd.DataFrame([dict(policy="full", perplexity=10.0, bytes_per_token=2048.0),
                        dict(policy="streaming(4,32)", perplexity=12.5, bytes_per_token=512.0),
                        dict(policy="kivi4", perplexity=9.9, bytes_per_token=307.2)])


def test_the_headline_reads_the_data():
    lines = headline("tiny", _cells(), SUMMARY)
    assert lines[0] == "tiny finds the pass key with the full cache in 2 of 4 at 248 tokens, 3 of 4 at 500 tokens."
    assert lines[1] == ("streaming(4,32): 0.25x the full cache's bytes per token, perplexity +25.0%, "
                        "0 of 4 at 248 tokens, 1 of 4 at 500 tokens.")
    assert lines[2] == "kivi4: 0.15x the full cache's bytes per token, perplexity -1.0%, 4 of 4 at 248 tokens."
    assert len(lines) == 3
    needle = headline("tiny", _cells("needle"), SUMMARY)
    assert needle[0].startswith("tiny finds the needle's key with the full cache in 2 of 4 at 248 tokens")
    # without a full cache, the first policy is the baseline
    no_full = headline("tiny", _cells(), SUMMARY.iloc[1:])
    assert no_full[0] == ("tiny finds the pass key with the streaming(4,32) cache in 0 of 4 at 248 tokens, "
                          "1 of 4 at 500 tokens.")
    assert no_full[1].startswith("kivi4: 0.60x the streaming(4,32) cache's bytes per token, perplexity -20.8%, 4 of 4")


# ---- SmolLM2 ----------------------------------------------------------------------------------------
@pytest.mark.slow
@needs_smol
@torch.no_grad()
def test_perplexity_on_smollm2_is_the_written_out_loss():
    """SmolLM2 (30 layers, 9 query heads on 3 KV heads): full and streaming(4,24) over 80 tokens of the
    Language Reference equal the plain and the hand-masked forward."""
    from smol import SMOL

    from interp.analyses.data import read_text

    model = interp.load(SMOL)
    toks = model.to_tokens(read_text()[:2000])[:, :80]
    got = policy_perplexity(model, toks, policy_runs("full,streaming(4,24)"), progress_bar=False)
    assert got["full"][0] == pytest.approx(fed_perplexity(model(toks), toks, 40), rel=1e-4)
    masked = masked_forward(model, toks, streaming_rows(80, 4, 24))
    assert got["streaming(4,24)"][0] == pytest.approx(fed_perplexity(masked, toks, 40), rel=1e-4)


@torch.no_grad()
def test_the_window_policy_is_the_model_itself_in_fewer_bytes():
    """On a model with local layers (Gemma 3's shape: windows 4, 4, global), "window" keeps only each
    local layer's window: the perplexity is the plain model's and the bytes are counted by hand."""
    from core_models import GEMMA3_LIKE

    model = build(GEMMA3_LIKE)
    n, p = 40, 20
    toks = tokens(1, n, seed=3)
    runs = policy_runs("full,window")
    assert [r.label for r in runs] == ["full", "window"]
    got = policy_perplexity(model, toks, runs, prefix=p, chunk=7, progress_bar=False)
    assert got["window"][0] == pytest.approx(fed_perplexity(model(toks), toks, p), rel=1e-5)
    assert got["window"][0] == pytest.approx(got["full"][0], rel=1e-5)
    d, kv, w = model.cfg.head_dim, model.cfg.kv_heads, 4
    # two local layers hold 4 keys and values (+ an int32 slot each), the global one all 40
    assert got["window"][1] == pytest.approx((2 * kv * w * (2 * d * 4 + 4) + kv * n * 2 * d * 4) / n)
    assert got["full"][1] == pytest.approx(3 * kv * 2 * d * 4)
    with pytest.raises(ValueError, match="listed twice: window"):
        policy_runs("window,kivi4,window")
    assert [r.label for r in policy_runs("kivi4,window,full")] == ["kivi4", "window", "full"]
