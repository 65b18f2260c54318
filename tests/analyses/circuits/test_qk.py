"""QK attribution (`interp.analyses.circuits.qk`, `interp circuit --qk`): the terms add up to the score the
model computed (read from a plain run, not from the decomposition's own run) on every native family and our
own configs, one sender pair's term written out by hand, the first-order attention-weight change against
the true one where the change is small, the one-line refusals, and the command's table."""

from __future__ import annotations

import json
import math

import pytest
import torch

import interp
from interp.analyses.circuits import Runner
from interp.analyses.circuits.head_names import parse_heads
from interp.analyses.circuits.qk import qk_attribution
from interp.analyses.store import read_table
from interp.cli import main as cli

from arch_cases import ARCHITECTURES, builder, native_case
from core_models import OWN_CONFIGS, build, rope_by_hand, small, whole_and_offloaded
from circuit_tasks import random_task

NATIVE = [t for t in ARCHITECTURES if native_case(t) is not None]


def model_scores(model, tokens, layer, head):
    """The head's scores [batch, q, k] and pattern from an ordinary run (capped, with ALiBi, masked -inf)."""
    names = [f"blocks.{layer}.attn.hook_attn_scores", f"blocks.{layer}.attn.hook_pattern"]
    with torch.no_grad():
        _, cache = model.run_with_cache(tokens, names_filter=lambda n: n in names)
    return cache[names[0]][:, head].double(), cache[names[1]][:, head].double()


def check_sums(model, n: int = 8, key_pos=None):
    """The decomposition of the last layer's last head at the last position (and two before it), against an
    ordinary run: terms (+ ALiBi) -> the score (soft-capped, it is the cap of their sum), contrast terms ->
    the score less its mean over the visible keys."""
    cfg = model.cfg
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(cfg.d_vocab, (2, n), generator=g)
    layer, head = cfg.n_layers - 1, cfg.n_heads - 1
    query = [n - 1, n - 3]
    qk = qk_attribution(model, tokens, layer, head, query, key_pos=key_pos, top_keys=3)
    scores, pattern = model_scores(model, tokens, layer, head)
    total = qk.terms.double().sum((-1, -2)) + (qk.alibi.double() if qk.alibi is not None else 0)  # [N, K]
    cap = model.blocks[layer].attn.softcap
    big = max(1.0, float(total.abs().max()))
    for r in range(2):
        i, keys = query[r], qk.key_pos[r]
        row = scores[r, i]
        seen = torch.isfinite(row)
        want = row[keys]
        if cap is not None:  # the model's scores are capped; the decomposition is of the raw score
            alibi = qk.alibi[r].double() if qk.alibi is not None else 0
            got = cap * torch.tanh((total[r] - alibi) / cap) + alibi
        else:
            got = total[r]
        torch.testing.assert_close(got, want, atol=2e-5 * big, rtol=1e-5)
        if cap is None:
            contrast = qk.contrast[r].double().sum((-1, -2)) + (qk.alibi_contrast[r].double() if qk.alibi is not None else 0)
            torch.testing.assert_close(contrast, want - row[seen].mean(), atol=2e-5 * big, rtol=1e-5)
        torch.testing.assert_close(qk.pattern[r].double(), pattern[r, i, keys], atol=1e-6, rtol=1e-5)
        if key_pos is None:  # the keys it attends to most
            assert set(keys.tolist()) == set(pattern[r, i].argsort(descending=True)[:3].tolist())
    assert qk.max_error <= 2e-5 * big and qk.contrast_max_error <= 2e-5 * big
    return qk


@pytest.mark.parametrize("name", sorted(OWN_CONFIGS))
def test_terms_add_up_to_the_score_on_our_configs(name):
    model = build(OWN_CONFIGS[name])
    qk = check_sums(model)
    S = 1 + (model.cfg.n_layers - 1) * (model.cfg.n_heads + (model.cfg.d_mlp is not None))
    assert qk.query_senders[-1] == "bias" and len(qk.query_senders) == S + 1 == qk.terms.shape[-2]
    assert (qk.alibi is not None) == (model.cfg.positional == "alibi")


@pytest.mark.parametrize("model_type", NATIVE)
def test_terms_add_up_to_the_score_on_every_native_family(model_type):
    model = interp.from_hf(builder(model_type)())
    qk = check_sums(model)
    assert qk.softcapped == (model.blocks[-1].attn.softcap is not None)


def test_keys_asked_for_and_the_tidy_frame():
    model = build(OWN_CONFIGS["alibi-6heads"])
    qk = check_sums(model, key_pos=[0, 2])
    f = qk.frame
    assert list(f.columns) == ["prompt", "query_pos", "key_pos", "query_sender", "key_sender", "term", "contrast_term"]
    Sq, Sk = len(qk.query_senders), len(qk.key_senders)
    assert len(f) == 2 * 2 * (Sq * Sk + 1)  # 2 prompts x 2 keys x pairs, and ALiBi's own term
    sums = f.groupby(["prompt", "key_pos"]).term.sum().to_numpy()
    torch.testing.assert_close(torch.tensor(sums, dtype=torch.float64), qk.score.double().flatten(), atol=1e-4, rtol=1e-5)
    assert set(f.key_pos) == {0, 2} and (f[f.query_sender == "alibi"].key_sender == "alibi").all()


@pytest.mark.parametrize("name", ["learned-layernorm", "rotary-rms-swiglu-gqa"])
def test_one_pair_written_out_by_hand(name):
    """A layer-0 head's output at the query x the embeddings at the key, on layer 1's head 3 (for GQA its KV head
    is 1): ln1 with the clean run's scale (LayerNorm: centred, times w; no b: it is a constant, the bias sender's),
    W_Q / W_K (no b_Q, b_K: constants), RoPE at the query's and key's positions, the attention scale."""
    model = build(OWN_CONFIGS[name])
    cfg, attn = model.cfg, model.blocks[1].attn
    tokens = torch.randint(cfg.d_vocab, (1, 7), generator=torch.Generator().manual_seed(3))
    i, j, h = 6, 2, 3
    qk = qk_attribution(model, tokens, 1, h, i, key_pos=[j])
    with torch.no_grad():
        _, cache = model.run_with_cache(tokens)
    resid = cache["blocks.1.hook_resid_pre"][0].double()
    x_q = torch.einsum("pd,dm->pm", cache["blocks.0.attn.hook_z"][0, :, 2].double(), model.blocks[0].attn.W_O[2].double())
    x_k = cache["blocks.0.hook_resid_pre"][0].double()  # embed (+ positions)

    def norm_linear(x, p):  # ln1's linear part with the scale frozen at the run's
        ln = model.blocks[1].ln1
        if cfg.normalization == "layernorm":
            c = resid[p] - resid[p].mean()
            scale = (c.pow(2).mean() + ln.eps).sqrt()
            return (x[p] - x[p].mean()) / scale * ln.w.double()
        scale = (resid[p].pow(2).mean() + ln.eps).sqrt()
        return x[p] / scale * ln.w.double()

    def rope(v, p):
        return rope_by_hand(v, p, cfg)

    kv = h // (cfg.n_heads // cfg.kv_heads)
    q = rope(norm_linear(x_q, i) @ attn.W_Q[h].double(), i)
    k = rope(norm_linear(x_k, j) @ attn.W_K[kv].double(), j)
    by_hand = float((q @ k).detach()) * attn.scale
    a, b = qk.query_senders.index("L0H2"), qk.key_senders.index("embed")
    assert qk.kv_head == kv
    assert float(qk.terms[0, 0, a, b]) == pytest.approx(by_hand, rel=1e-4, abs=1e-6)
    assert abs(by_hand) > 1e-3  # not a vacuous zero


def test_the_first_order_weight_change_where_the_change_is_small():
    """Small weights: the scores move little between two prompts, so the first-order change of the attention
    weight (the pairs' shares summed) is the true change to a few percent; and the changes of term add up to the
    change of score exactly."""
    model = build(small(positional="rotary", init_range=0.02, n_layers=2), seed=2)
    task = random_task(model, n=3, p=9)
    runner = Runner(model, task)
    qk = runner.qk_attribution("L1H1", top_keys=4)
    assert qk.delta_max_error < 1e-6
    true, first = qk.weight_true.double(), qk.weight_first_order.double()
    assert float(true.abs().max()) > 1e-5
    torch.testing.assert_close(qk.weight_change.double().sum((-1, -2)), first, atol=1e-9, rtol=1e-6)
    assert float((first - true).abs().max()) <= 0.05 * float(true.abs().max())
    assert set(qk.prompts.tolist()) == {0, 1, 2} and qk.query_pos.tolist() == task.positions.tolist()


@pytest.mark.parametrize("call, says", [
    (lambda m, t: qk_attribution(m, t, 2, 0, 3), "no head L2H0: this model has 2 layers of 5 heads"),
    (lambda m, t: qk_attribution(m, t, 1, 5, 3), "no head L1H5"),
    (lambda m, t: qk_attribution(m, t, 1, 0, 7), "query position 7 is outside the prompt (7 tokens"),
    (lambda m, t: qk_attribution(m, t, 1, 0, 3, key_pos=[9]), "key position 9 is outside the prompt"),
    (lambda m, t: qk_attribution(m, t, 1, 0, 3, key_pos=[5]), "key position 5 is not visible from query position 3"),
    (lambda m, t: parse_heads("1-0", m.cfg), "not a head: '1-0'"),
])
def test_bad_input_is_refused_in_one_line_before_any_run(call, says, monkeypatch):
    model = build(OWN_CONFIGS["learned-layernorm"])
    monkeypatch.setattr(model, "forward", lambda *a, **k: pytest.fail("ran"))
    with pytest.raises(ValueError) as e:
        call(model, torch.zeros(2, 7, dtype=torch.long))
    assert says in str(e.value) and "\n" not in str(e.value)


def test_a_wrapped_model_is_refused_saying_what_it_lacks():
    from wrapped_cases import WRAPPED, build_wrapped_hf

    kind = sorted(WRAPPED)[0]
    model = interp.from_hf(build_wrapped_hf(kind, 0))
    assert not model.native
    with pytest.raises(NotImplementedError) as e:
        qk_attribution(model, torch.zeros(1, 5, dtype=torch.long), 0, 0, 4)
    assert "wrapped" in str(e.value) and "hook_result" in str(e.value) and "\n" not in str(e.value)


def test_the_command_writes_its_qk_table_and_sections(tmp_path, monkeypatch):
    import interp.analyses.circuits.study as circuit_study
    parsed = []  # the head string is parsed once, in `check`; `measure` reads the heads it returned
    monkeypatch.setattr(circuit_study, "parse_heads", lambda *a: parsed.append(a) or parse_heads(*a))
    out = tmp_path / "ind"
    assert cli(["circuit", "attn-only-2l", "--task", "induction", "--prompts", "2", "--method", "eap",
                "--qk", "1.0,L1H3", "--qk-keys", "2", "--no-progress", "--out", str(out)]) == 0
    assert [a[0] for a in parsed] == ["1.0,L1H3"]
    qk = read_table(out, "qk")
    assert {"head", "query_sender", "key_sender", "mean_term", "mean_abs_term", "mean_contrast", "mean_delta",
            "mean_weight_change"} <= set(qk.columns)
    assert set(qk["head"]) == {"L1H0", "L1H3"} and len(qk) == 2 * 6 * 6  # embed, 4 heads of layer 0, bias
    record = json.loads((out / "settings.json").read_text())
    assert [r["head"] for r in record["qk"]] == ["L1H0", "L1H3"] and record["qk"][0]["max_abs_error"] < 1e-4
    assert record["qk"][0]["keys_per_query"] == 2 and math.isfinite(record["qk"][0]["contrast_max_abs_error"])
    page = (out / "report.html").read_text()
    assert 'id="qk-L1H0"' in page and 'id="qk-L1H3"' in page and (out / "figures" / "qk_L1H0.png").exists()


@pytest.mark.parametrize("argv, says", [
    (["--qk", "2.0"], "no head L2H0: this model has 2 layers of 4 heads"),
    (["--qk", "one"], "not a head: 'one'"),
    (["--qk", "1.0", "--qk-keys", "0"], "--qk-keys must be at least 1"),
])
def test_bad_heads_are_one_line_before_loading(tmp_path, capsys, monkeypatch, argv, says):
    monkeypatch.setattr(interp, "load", lambda *a, **k: pytest.fail("loaded"))
    assert cli(["circuit", "attn-only-2l", "--task", "induction", *argv, "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and says in err and "\n" not in err
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("name", ["gemma3-like", "rotary-partial-parallel"])
def test_the_runner_reads_its_cached_runs_and_gets_what_a_fresh_run_gets(name):
    """Runner.qk_attribution reuses the clean and corrupted runs it cached (only the head's block runs
    again); a fresh qk_attribution over the same prompts gives the same terms and changes."""
    model = build(OWN_CONFIGS[name])
    task = random_task(model, n=5, p=8)
    runner = Runner(model, task, batch_size=2)
    layer = model.cfg.n_layers - 1
    cached = runner.qk_attribution(f"L{layer}H1")
    fresh = qk_attribution(model, task.clean, layer, 1, task.positions, rows=task.rows, corrupted=task.corrupted,
                           batch_size=3)
    assert torch.equal(cached.key_pos, fresh.key_pos) and cached.terms.shape[0] == task.n_answers
    for field in ("terms", "contrast", "score", "delta", "weight_change"):
        torch.testing.assert_close(getattr(cached, field), getattr(fresh, field), atol=5e-5, rtol=1e-4)


def test_an_offloaded_model_gives_what_the_whole_model_gives(tmp_path):
    whole, offloaded, tokens = whole_and_offloaded(tmp_path / "m")
    a = qk_attribution(whole, tokens, 1, 2, 7, corrupted=tokens.flip(1))
    b = qk_attribution(offloaded, tokens, 1, 2, 7, corrupted=tokens.flip(1))
    for field in ("terms", "contrast", "score", "weight_change"):
        torch.testing.assert_close(getattr(a, field), getattr(b, field))
