"""Head roles against cases built by hand: a head made to copy the needle scores retrieval 1 and no
other head does unless its attention lands there too; the streaming loss of a KV head equals a forward
with that head's queries masked by hand; KV-head scores are the max / mean over the query heads that
share it; selections keep the top k; bad selections are one clear line."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch
import torch.nn.functional as F
from core_models import build, small, tokens

import interp
from interp.analyses.kv.roles import (
    check_selection,
    equal_bytes_budget,
    equal_bytes_runs,
    kv_roles,
    loss_scores,
    per_kv_head,
    razor_scores,
    ranking,
    retrieval_scores,
    selection_runs,
)
from interp.analyses.kv.tasks import passkey_prompt
from interp.testing import simulated_gpu
from interp.errors import BadValue


@pytest.fixture(scope="module")
def zoo():
    return interp.load("attn-only-2l")


def test_a_head_made_to_copy_the_needle_scores_one(zoo):
    """Hooks make the model answer with the key's characters in order and make L0H2 put its top-1
    attention on the needle's copy of each one at the step that produces it: L0H2 scores 5 of 5 = 1;
    a head whose top-1 is forced elsewhere (L1H0, onto the first token) scores 0."""
    prompt = passkey_prompt(zoo, 248, 0.5, "48213")
    a, b = prompt.key_span
    key_ids = prompt.tokens[0, a:b].tolist()
    step = {"i": 0}

    def force_attention(scores, hook):  # [batch, head, q, k]: decoding steps only
        if scores.shape[2] != 1:
            return scores
        s = scores.clone()
        if hook.layer() == 0:
            s[0, 2, 0] = float("-inf")
            s[0, 2, 0, a + min(step["i"], len(key_ids) - 1)] = 0.0
        else:
            s[0, 0, 0] = float("-inf")
            s[0, 0, 0, 0] = 0.0
        return s

    def force_answer(resid, hook):  # the key's next character, by a large push along its unembedding
        if resid.shape[1] != 1:
            return resid
        i = min(step["i"], len(key_ids) - 1)
        step["i"] += 1
        return resid + 1e4 * zoo.W_U[:, key_ids[i]] / zoo.W_U[:, key_ids[i]].norm()

    last = f"blocks.{zoo.cfg.n_layers - 1}.hook_resid_post"
    handles = [zoo.add_hook("blocks.0.attn.hook_attn_scores", force_attention),
               zoo.add_hook("blocks.1.attn.hook_attn_scores", force_attention),
               zoo.add_hook(last, force_answer)]
    try:
        frame = retrieval_scores(zoo, [prompt], max_new_tokens=len(key_ids))
    finally:
        for h in handles:
            h.remove()
    score = frame.set_index(["layer", "head"])["retrieval"]
    assert int(frame["copied"].iloc[0]) == len(key_ids)
    assert score[(0, 2)] == 1.0
    assert score[(1, 0)] == 0.0
    assert (frame["retrieval"] <= 1).all() and (frame["retrieval"] >= 0).all()


def test_a_model_that_copies_nothing_is_an_error_not_zeros(zoo):
    prompt = passkey_prompt(zoo, 248, 0.5, "48213")
    handle = zoo.add_hook(f"blocks.{zoo.cfg.n_layers - 1}.hook_resid_post",
                          lambda r, hook: r + 1e4 * zoo.W_U[:, 1] / zoo.W_U[:, 1].norm())  # never a digit
    try:
        with pytest.raises(BadValue, match="copied no needle token"):
            retrieval_scores(zoo, [prompt], max_new_tokens=3)
    finally:
        handle.remove()


@pytest.fixture(scope="module")
def gqa():
    return build(small(positional="rotary", normalization="rmsnorm", act_fn="silu", gated_mlp=True, d_model=48,
                       n_heads=6, n_kv_heads=2, n_ctx=96, n_layers=3))


def test_streaming_loss_of_a_kv_head_by_hand(gqa):
    sinks, window = 2, 6
    toks = tokens(2, 40, seed=3)
    frame = loss_scores(gqa, toks, sinks=sinks, window=window).set_index(["layer", "kv_head"])["loss"]
    n, start = toks.shape[1], sinks + window
    i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
    hide = ~((j <= i) & ((j < sinks) | (i - j < window)))

    def loss_of(logits):  # mean next-token loss of the tokens predicted from positions >= sinks + window
        return F.cross_entropy(logits[:, start:-1].flatten(0, 1), toks[:, start + 1 :].flatten())

    clean = loss_of(gqa(toks))
    for layer, kv in ((0, 1), (2, 0)):
        def mask(scores, hook):
            s = scores.clone()
            s[:, 3 * kv : 3 * kv + 3] = s[:, 3 * kv : 3 * kv + 3].masked_fill(hide, float("-inf"))
            return s

        want = loss_of(gqa.run_with_hooks(toks, fwd_hooks=[(f"blocks.{layer}.attn.hook_attn_scores", mask)])) - clean
        assert frame[(layer, kv)] == pytest.approx(float(want), abs=1e-5)
    assert len(frame) == 3 * 2


def test_kv_head_scores_are_the_max_and_mean_of_their_query_heads():
    q = pd.DataFrame(dict(layer=[0, 0, 0, 0], head=[0, 1, 2, 3], kv_head=[0, 0, 1, 1],
                          retrieval=[0.1, 0.5, 0.0, 0.2], echo=[0.3, 0.1, 0.9, 0.0]))
    kv = per_kv_head(q, ["retrieval", "echo"]).set_index("kv_head")
    assert kv.loc[0, "retrieval"] == 0.5 and kv.loc[0, "retrieval_mean"] == pytest.approx(0.3)
    assert kv.loc[1, "echo"] == 0.9 and kv.loc[1, "echo_mean"] == pytest.approx(0.45)
    roles = kv_roles(q, loss=pd.DataFrame(dict(layer=[0, 0], kv_head=[0, 1], loss=[0.01, 0.2])))
    assert list(ranking(roles, "loss").sort_values(ascending=False).index) == [(0, 1), (0, 0)]


def test_razor_is_the_larger_of_echo_and_induction(zoo):
    """RazorAttention's scores written out from the attention patterns of the same repeated random tokens
    (BOS, then L tokens twice): echo is the weight a query in the second copy puts on its token's earlier
    occurrence (p - L), induction on the token after it (p - L + 1); razor is the larger."""
    from interp.analyses.heads import repeated_random_tokens  # the token generator razor_scores uses

    L = 20
    r = razor_scores(zoo, seq_len=L, batch_size=2).set_index(["layer", "head"])
    assert len(r) == zoo.cfg.n_layers * zoo.cfg.n_heads
    toks = repeated_random_tokens(zoo.cfg.d_vocab, L, 2, 2, seed=0,
                                  bos_token_id=getattr(zoo.tokenizer, "bos_token_id", None) or 0)
    _, cache = zoo.run_with_cache(toks, names_filter=lambda n: n.endswith("hook_pattern"))
    dest = torch.arange(1 + L, 1 + 2 * L)
    for layer in range(zoo.cfg.n_layers):
        pattern = cache["pattern", layer]  # [batch, head, q, k]
        echo = pattern[:, :, dest, dest - L].mean((0, 2))
        induction = pattern[:, :, dest, dest - L + 1].mean((0, 2))
        for head in range(zoo.cfg.n_heads):
            row = r.loc[(layer, head)]
            assert row["echo"] == pytest.approx(float(echo[head]), abs=1e-5)
            assert row["induction"] == pytest.approx(float(induction[head]), abs=1e-5)
            assert row["razor"] == max(row["echo"], row["induction"])
    assert r.loc[(1, 0), "induction"] > 0.5 > r.loc[(1, 0), "echo"]  # attn-only-2l's induction head: not a swap


def test_selections_keep_the_top_k_and_stream_the_rest():
    scores = pd.Series([0.9, 0.1, 0.5, 0.7, 0.0, 0.3], index=pd.MultiIndex.from_tuples(
        [(0, 0), (0, 1), (1, 0), (1, 1), (2, 0), (2, 1)], names=["layer", "kv_head"]))
    runs = selection_runs({"loss": scores, "random": None}, 3, 2, fractions=(0.34, 0.5), seeds=(0, 1), sinks=4,
                          window=16)
    top = [r for r in runs if r.selection == "loss"]
    assert [sorted(r.policy) for r in top] == [[(0, 0), (1, 1)], [(0, 0), (1, 0), (1, 1)]]
    assert all(r.default == "streaming(4,16)" and set(r.policy.values()) == {"full"} for r in runs)
    rnd = [r for r in runs if r.selection == "random"]
    assert len(rnd) == 4 and rnd[0].policy != rnd[1].policy and all(len(r.policy) == r.full_heads for r in rnd)
    again = selection_runs({"random": None}, 3, 2, fractions=(0.34,), seeds=(0,), sinks=4, window=16)
    assert again[0].policy == rnd[0].policy  # seeded


def test_equal_bytes_budget_by_hand():
    # 10% of heads hold all 1024 tokens, 90% hold 4 + 128: on average 0.1 * 1024 + 0.9 * 132 = 221.2 (2048: 323.6)
    assert equal_bytes_budget(0.1, 1024, 4, 128) == 221
    runs = equal_bytes_runs((0.1, 0.5), (1024, 2048), sinks=4, window=128)
    assert [r.policy for r in runs] == ["snapkv(221)", "snapkv(324)", "snapkv(578)", "snapkv(1090)"]
    assert runs[1].lengths == (2048,)


@pytest.mark.parametrize("names, fractions, match", [
    (["retrival"], [0.1], "unknown selection retrival"),
    (["loss"], [0.0], r"fraction of the KV heads in \(0, 1\]"),
    (["loss"], [1.5], r"fraction of the KV heads in \(0, 1\]"),
    (["loss"], [0.005], "keeps none"),
])
def test_bad_selections_are_one_line(names, fractions, match):
    with pytest.raises(BadValue, match=match):
        check_selection(names, fractions, 90)


def test_the_cli_compares_selections_end_to_end(tmp_path, capsys):
    from interp.cli import main as cli

    out = tmp_path / "roles"
    argv = ["kv", "select", "attn-only-2l", "--rankings", "retrieval,razor,loss,random", "--lengths", "248",
            "--depths", "0.5", "--prompts", "1", "--window", "32", "--fractions", "0.25,0.5", "--seq-len", "200",
            "--scoring-prompts", "2", "--selection-seeds", "2", "--out", str(out), "--no-progress"]
    assert cli(argv) == 0, capsys.readouterr().err
    cells = pd.read_parquet(out / "kv_policies.parquet")
    heads = pd.read_parquet(out / "kv_head_roles.parquet")
    assert {"retrieval", "echo", "induction", "razor", "sink", "loss"} <= set(heads.columns)
    assert len(heads) == 2 * 4  # one row per query head of attn-only-2l
    n_kv = 2 * 4
    picked = cells[cells["selection"] == "loss"].sort_values("full_fraction")
    assert list(picked["full_heads"]) == [round(0.25 * n_kv), round(0.5 * n_kv)]
    assert set(cells["selection"]) == {"full", "streaming", "retrieval", "razor", "loss", "random", "snapkv"}
    assert len(cells[cells["selection"] == "random"]) == 2 * 2  # 2 seeds x 2 budgets
    report = (out / "report.md").read_text()
    assert "of 1 keys" in report and "retrieval score above 0.1" in report


@pytest.mark.parametrize("change, message", [
    ({"--rankings": "retrieval,lru"}, "unknown selection lru"),
    ({"--fractions": "0.1,1.5"}, "fraction of the KV heads in (0, 1]"),
    ({"--fractions": "0.01"}, "keeps none"),
    ({"--window": "400"}, "streaming(4,400): the window must be between 1 and"),
    ({"--lengths": "248,900"}, "--lengths 900"),
])
def test_bad_selection_settings_are_one_line_before_the_model_loads(tmp_path, capsys, monkeypatch, change, message):
    from interp.cli import main as cli

    monkeypatch.setattr(interp, "load", lambda *a, **k: pytest.fail("the model must not load"))
    out = tmp_path / "out"
    settings = {"--rankings": "retrieval,random", "--lengths": "248", "--depths": "0.5",
                "--prompts": "1", "--seq-len": "128", "--out": str(out), **change}
    assert cli(["kv", "select", "attn-only-2l", *[x for kv in settings.items() for x in kv], "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err
    assert not out.exists()


def test_the_atlas_retrieval_analysis_gives_the_retrieval_column(zoo):
    """`--analyses ...,retrieval`: the registry adapter's rows are the retrieval scores of each head, here
    on a model made (by hooks) to copy the key with L0H2 looking at the needle token it copies."""
    from interp.analyses.atlas.registry import ANALYSES, Context
    from interp.analyses.atlas.registry.retrieval import PARAMS

    entry = ANALYSES["retrieval"]
    assert [m.name for m in entry.metrics] == ["retrieval"] and entry.metrics[0].heatmap and entry.expensive
    length = min(PARAMS["length"], zoo.cfg.n_ctx - PARAMS["max_new_tokens"])
    prompts = interp.analyses.kv.tasks.retrieval_prompts(zoo, [length], list(PARAMS["depths"]), PARAMS["per_depth"],
                                                      PARAMS["seed"])
    state = {"prompt": 0, "step": 0}
    spans = [(p.key_span, p.tokens[0, p.key_span[0]:p.key_span[1]].tolist()) for p in prompts]

    def force_attention(scores, hook):
        if scores.shape[2] != 1:
            return scores
        (a, _), ids = spans[state["prompt"]]
        s = scores.clone()
        s[0, 2, 0] = float("-inf")
        s[0, 2, 0, a + min(state["step"], len(ids) - 1)] = 0.0
        return s

    def force_answer(resid, hook):
        if resid.shape[1] != 1:
            state["step"] = 0
            return resid
        (_, _), ids = spans[state["prompt"]]
        i = state["step"]
        state["step"] += 1
        if state["step"] == PARAMS["max_new_tokens"]:
            state["prompt"] += 1
        tok = ids[min(i, len(ids) - 1)] if i < len(ids) else 0  # the key, then a non-digit
        return resid + 1e4 * zoo.W_U[:, tok] / zoo.W_U[:, tok].norm()

    handles = [zoo.add_hook("blocks.0.attn.hook_attn_scores", force_attention),
               zoo.add_hook(f"blocks.{zoo.cfg.n_layers - 1}.hook_resid_post", force_answer)]
    try:
        with simulated_gpu():  # as on a GPU: no host tensor meets the model's (tests/models/placement/test_device.py)
            rows = entry.run(Context(model=zoo, tokens=tokens(1, 16, vocab=200).to(zoo.device), data=None))
    finally:
        for h in handles:
            h.remove()
    score = rows.set_index(["layer", "head"])["value"]
    assert set(rows["metric"]) == {"retrieval"} and len(rows) == zoo.cfg.n_layers * zoo.cfg.n_heads
    assert score[(0, 2)] == 1.0 and (score <= 1).all()


def test_gates_train_a_count_of_steps_and_a_time_cap_that_cuts_is_said(tmp_path, capsys, monkeypatch):
    """Issue 36: `--gate-steps` runs exactly that many seeded steps (the same gates on any machine); a
    `--gate-seconds` cap that stops training early is named in the report and settings.json."""
    import json

    from interp.cli import main as cli
    from interp.analyses import evaldata

    base = ["kv", "select", "attn-only-2l", "--rankings", "gates,random", "--lengths", "248", "--depths",
            "0.5", "--prompts", "1", "--window", "32", "--fractions", "0.5", "--seq-len", "200",
            "--scoring-prompts", "1", "--selection-seeds", "1", "--no-progress"]
    runs = {}
    for label, extra in (("count", ["--gate-steps", "3"]), ("again", ["--gate-steps", "3"]),
                         ("capped", ["--gate-steps", "50", "--gate-seconds", "1e-6"])):
        out = tmp_path / label
        monkeypatch.setenv("INTERP_CACHE", str(tmp_path / f"cache-{label}"))  # trained anew each time
        assert cli([*base, *extra, "--out", str(out)]) == 0, capsys.readouterr().err
        runs[label] = (json.loads((out / "settings.json").read_text()), pd.read_parquet(out / "kv_head_roles.parquet"),
                       (out / "report.md").read_text())
    settings, heads, report = runs["count"]
    assert settings["gate_steps"] == 3 and settings["gate_steps_done"] == 3 and settings["gate_seconds"] is None
    assert "time cap" not in report and "gate" in heads.columns and heads["gate"].between(0, 1).all()
    assert settings["data_source"]["sha256"] == evaldata.manifest()[evaldata.LANGUAGE_REFERENCE]["sha256"]
    pd.testing.assert_frame_equal(runs["again"][1], heads)  # seeded: trained again, the same gates
    capped, _, capped_report = runs["capped"]
    assert capped["gate_steps"] == 50 and 1 <= capped["gate_steps_done"] < 50
    assert (f"The time cap of 1e-06 s stopped DuoAttention's gate training after {capped['gate_steps_done']} of its "
            "50 steps") in capped_report


def test_the_loss_ranking_reads_the_first_loss_tokens_of_the_text_and_says_so(tmp_path):
    """The number that moved (README, head roles: the loss ranking at 50% kept 5 of 8 keys, then 0 of 8): the
    streaming-loss ranking had read the whole perplexity text, then its first 1,024 tokens. The span is now a
    setting recorded in settings.json and said in the report, and the ranking is exactly `loss_scores` on that
    span: reading another span (the whole text, or a default other than 1,024) fails here."""
    import json

    import interp
    from interp.analyses.kv.roles_study import LOSS_TOKENS, RolesSettings, RolesStudy
    from interp.analyses.kv.tasks import retrieval_prompts
    from interp.analyses.study import StudyData, run
    from interp.analyses.data import DataSpec

    assert LOSS_TOKENS == 1024 and RolesSettings.loss_tokens == 1024
    model = interp.load("attn-only-2l")
    spec = DataSpec(kind="text", n_seqs=1, seq_len=200)
    prompts = retrieval_prompts(model, [248], [0.5], 1, 0)
    settings = RolesSettings(model="attn-only-2l", data=StudyData.of(spec), prompt_list=tuple(prompts),
                             selections=("loss",), fractions=(0.5,), selection_seeds=(0,), sinks=4, window=32,
                             n_scoring=1, equal_bytes=None, loss_tokens=120, progress=False)
    out = tmp_path / "roles"
    run(RolesStudy(), model, out, settings, log=lambda *a: None)
    record = json.loads((out / "settings.json").read_text())
    assert record["loss_tokens"] == 120
    assert "reads the perplexity text's first 120 tokens (the loss of the 83 tokens" in (out / "report.md").read_text()
    text = StudyData.of(spec).tokens(model)
    heads = pd.read_parquet(out / "kv_head_roles.parquet").groupby(["layer", "kv_head"])["loss"].first()
    want = loss_scores(model, text[:, :120], sinks=4, window=32).set_index(["layer", "kv_head"])["loss"]
    whole = loss_scores(model, text, sinks=4, window=32).set_index(["layer", "kv_head"])["loss"]
    assert np.allclose(heads.loc[want.index].to_numpy(), want.to_numpy(), rtol=0, atol=1e-6)
    assert not np.allclose(want.to_numpy(), whole.to_numpy(), rtol=0, atol=1e-4)  # the span matters here too
