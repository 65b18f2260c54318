"""`interp extrapolate`: a rotary model past its trained context, per RoPE scaling (analyses/src/extrapolation/extrapolate.py,
analyses/src/extrapolation/study.py, models/src/rope/heads.py).

1. one forward gives every length's head scores (`scores_at_lengths` equals `scores_by_length`);
2. the never-completed share against a hand computation (both rotary layouts, partial rotary);
3. the per-head repair: on every KV head it is the global scaling (forward and cached decoding, Gemma's
   local layers untouched); on some, those heads only; LogN temperature is the scores times its factor;
4. the study's pieces by hand (buckets, changes, which heads a repair may change);
5. the command: its tables, settings.json and report on the zoo's rotary model and a Gemma-like one, an
   ALiBi model as loaded; bad input in one line before any weight is read; --help without torch;
6. the controlled case: the zoo's ALiBi and RoPE twins read to 4x their trained length behave as published.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import tempfile

import numpy as np
import pandas as pd
import pytest
import torch

import interp
from core_models import GEMMA3_LIKE, build, small, tokens
from interp.analyses.extrapolation.extrapolate import (PairEnergy, autopsy_pass, breaking_order, bucket_perplexity, choose_repair,
                                         head_changes, never_completed_shares, rope_as, sequence_nll,
                                         split_perplexity)
from interp.analyses.extrapolation.study import ExtrapolateSettings, ExtrapolateStudy
from interp.analyses.kv.tasks import retrieval_prompts
from interp.analyses.extrapolation.lengths import METRICS, scores_at_lengths, scores_by_length
from interp.analyses.store import read_table
from interp.analyses.study import SHARED_KEYS, StudyData, run
from interp.analyses.data import DataSpec, build_tokens
from interp.cli import main as cli
from interp.errors import BadValue
from interp.models.formats.tokenizer import ByteTokenizer
from interp.models.rope.choice import choose
from interp.models.rope.heads import logn_heads, scaled_heads

GQA = small(positional="rotary", normalization="rmsnorm", act_fn="silu", gated_mlp=True, d_model=48, n_heads=6,
            n_kv_heads=2, n_ctx=32)  # d_head 8: 4 rotary pairs
SCALINGS = ("linear:2", "ntk:2", "yarn:2")


@pytest.fixture(scope="module")
def gqa():
    return build(GQA)


# ---- 1. one forward, every length ----------------------------------------------------------------------
def test_one_forward_scores_every_length_as_a_forward_per_length(gqa):
    toks = tokens(2, 64)
    one, resid = scores_at_lengths(gqa, toks, [32, 48, 64])
    each = scores_by_length(gqa, toks, [32, 48, 64])
    keys = ["length", "layer", "head", "metric"]
    assert one[keys].equals(each[keys]) and set(one["metric"]) == set(METRICS)
    assert np.allclose(one["value"], each["value"], rtol=1e-5, atol=1e-6)
    assert one["extrapolated"].tolist() == each["extrapolated"].tolist()
    # and the loss from the residual it returns is the model's own
    with torch.no_grad():
        nll = gqa(resid, start_at_layer=GQA.n_layers, tokens=toks, return_type="loss", loss_per_token=True)
    assert torch.allclose(nll, sequence_nll(gqa, toks), atol=1e-5)


@pytest.mark.parametrize("scaling", ["yarn:2", "dynamic:2"])
def test_the_autopsy_is_scores_by_length_under_a_scaling(gqa, scaling):
    """dynamic NTK's frequencies follow the call's length: there each length gets its own forward."""
    toks = tokens(1, 64, seed=6)
    with rope_as(gqa, scaling):
        got, _ = autopsy_pass(gqa, toks, [32, 48, 64])
        want = scores_by_length(gqa, toks, [32, 48, 64])
    assert np.allclose(got["value"], want["value"], rtol=1e-5, atol=1e-6)


# ---- 2. never-completed share by hand ------------------------------------------------------------------
@pytest.mark.parametrize("changes, never", [
    ({}, 3),  # d_head 8, base 10000, n_ctx 32: periods 6.3, 62.8, 628, 6283 tokens
    ({"rotary_adjacent_pairs": True}, 3),
    ({"rotary_base": 20.0}, 1),  # periods 6.3, 13.3, 28.1, 59.4
    ({"rotary_dim": 4, "rotary_base": 100.0}, 1),  # 2 pairs (periods 6.3, 62.8) and 4 dims that never turn
])
def test_never_completed_share_is_the_hand_computation(changes, never):
    cfg = GQA.replace(**changes)
    model = build(cfg)
    toks = tokens(2, 2 * cfg.n_ctx, seed=3)
    energy = PairEnergy(model, cfg.n_ctx)
    autopsy_pass(model, toks, [cfg.n_ctx, 2 * cfg.n_ctx], energy=energy)
    got = never_completed_shares(model, energy)
    _, cache = model.run_with_cache(toks[:, : cfg.n_ctx], names_filter=lambda n: n.endswith(("hook_q", "hook_k")))
    r, d, base, group = cfg.rot_dim, cfg.head_dim, cfg.rotary_base, cfg.n_heads // cfg.kv_heads
    periods = [2 * math.pi * base ** (2 * i / r) for i in range(r // 2)]
    assert sum(p > cfg.n_ctx for p in periods) == never and set(got["never_pairs"]) == {never}
    for layer in range(cfg.n_layers):
        q = cache[f"blocks.{layer}.attn.hook_q"].double().numpy()  # before RoPE: a pair's norm does not turn
        k = cache[f"blocks.{layer}.attn.hook_k"].double().numpy()
        for head in range(cfg.n_heads):
            units = []  # (energy, never completed)
            for i in range(r // 2):
                a, b = (2 * i, 2 * i + 1) if cfg.rotary_adjacent_pairs else (i, i + r // 2)
                qn = np.sqrt(q[:, :, head, a] ** 2 + q[:, :, head, b] ** 2).mean()
                kn = np.sqrt(k[:, :, head // group, a] ** 2 + k[:, :, head // group, b] ** 2).mean()
                units.append((qn * kn, periods[i] > cfg.n_ctx))
            for j in range(r, d):
                units.append((np.abs(q[:, :, head, j]).mean() * np.abs(k[:, :, head // group, j]).mean(), False))
            share = sum(e for e, n in units if n) / sum(e for e, _ in units)
            row = got[(got["layer"] == layer) & (got["head"] == head)]
            assert row["share"].item() == pytest.approx(share, rel=1e-4), (layer, head)


# ---- 3. the per-head repair ------------------------------------------------------------------------------
def _every_kv_head(cfg):
    return [(l, g) for l in range(cfg.n_layers) for g in range(cfg.kv_heads)]


@pytest.mark.parametrize("which", ["gqa", "gemma3-like"])
@pytest.mark.parametrize("scaling", SCALINGS)
def test_scaling_every_kv_head_is_the_global_scaling(which, scaling, gqa):
    model = gqa if which == "gqa" else build(GEMMA3_LIKE)
    toks = tokens(1, 3 * model.cfg.n_ctx // 2, seed=1)
    plain = model(toks)
    with rope_as(model, scaling):
        want = model(toks)
        want_tokens = model.generate(toks[:, :40], max_new_tokens=6, do_sample=False, stop_at_eos=False)
    assert not torch.allclose(plain, want, atol=1e-3)  # the scaling does something here
    with scaled_heads(model, _every_kv_head(model.cfg), choose(model.cfg, scaling)):
        got = model(toks)
        got_tokens = model.generate(toks[:, :40], max_new_tokens=6, do_sample=False, stop_at_eos=False)  # a KV cache
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-5)
    assert torch.equal(got_tokens, want_tokens)
    assert torch.equal(model(toks), plain)  # as loaded again after the block


def test_scaling_gemmas_local_layers_changes_nothing():
    model = build(GEMMA3_LIKE)
    toks = tokens(1, 48, seed=2)
    local = [(l, 0) for l in range(3) if GEMMA3_LIKE.local_rope(l)]
    with scaled_heads(model, local, choose(model.cfg, "yarn:2")):
        got = model(toks)
    assert torch.equal(got, model(toks))


def test_scaling_some_kv_heads_changes_those_heads_only(gqa):
    toks = tokens(1, 48, seed=4)
    name = "blocks.0.attn.hook_z"  # layer 0: the same input whatever the scaling
    _, plain = gqa.run_with_cache(toks, names_filter=name)
    with rope_as(gqa, "yarn:2"):
        _, scaled = gqa.run_with_cache(toks, names_filter=name)
    with scaled_heads(gqa, [(0, 1)], choose(gqa.cfg, "yarn:2")):  # KV head 1: query heads 3, 4, 5
        _, mixed = gqa.run_with_cache(toks, names_filter=name)
    z, zp, zs = mixed[name], plain[name], scaled[name]
    assert torch.allclose(z[:, :, :3], zp[:, :, :3], atol=1e-6) and torch.allclose(z[:, :, 3:], zs[:, :, 3:], atol=1e-6)
    assert not torch.allclose(z[:, :, 3:], zp[:, :, 3:], atol=1e-4)


def test_logn_temperature_is_the_scores_times_its_factor(gqa):
    toks = tokens(1, 80, seed=5)
    n_ctx = GQA.n_ctx
    tau = (torch.arange(80, dtype=torch.float32) + 1).log().div(math.log(n_ctx)).clamp(min=1.0)

    def sharpen(scores, hook):  # [batch, head, query, key]: every query row p times tau(p)
        return scores * tau[None, None, :, None]

    with gqa.attention("instrumented"):
        want = gqa.run_with_hooks(toks, fwd_hooks=[(lambda n: n.endswith("hook_attn_scores"), sharpen)])
    with logn_heads(gqa, [(l, h) for l in range(GQA.n_layers) for h in range(GQA.n_heads)]):
        got = gqa(toks)
        inside = gqa(toks[:, :n_ctx])
    assert torch.allclose(got, want, atol=1e-5)
    assert torch.equal(inside, gqa(toks[:, :n_ctx]))  # inside the trained context: the model itself
    assert not torch.allclose(got, gqa(toks), atol=1e-3)


def test_per_head_blocks_refuse_bad_heads_and_restore_on_error(gqa):
    with pytest.raises(BadValue, match=r"KV head \(0, 2\) is not in this model"):
        with scaled_heads(gqa, [(0, 2)], None):
            pass
    rotary, rotate = gqa.rotary, gqa.blocks[0].attn.rotate
    with pytest.raises(RuntimeError, match="inside"):
        with scaled_heads(gqa, [(0, 0)], choose(gqa.cfg, "yarn:2")):
            raise RuntimeError("inside")
    assert gqa.rotary is rotary and gqa.blocks[0].attn.rotate is rotate
    with pytest.raises(BadValue, match="needs rotary positions"):
        with logn_heads(build(small()), [(0, 0)]):
            pass


# ---- 4. the pieces by hand ----------------------------------------------------------------------------
def test_bucket_perplexity_by_hand():
    nll = torch.tensor([[1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0]])  # predicts positions 1..7
    table = bucket_perplexity(nll, 2, n_ctx=4)
    assert table[["start", "end", "tokens"]].values.tolist() == [[0, 4, 3], [4, 8, 4]]
    assert table["perplexity"].tolist() == pytest.approx([math.exp(2.0), math.exp(5.5)])
    assert table["past_context"].tolist() == [False, True]
    with pytest.raises(FloatingPointError):
        bucket_perplexity(torch.tensor([[1.0, float("nan")]]), 1, 4)


def test_changes_and_breaking_order_by_hand():
    rows = []
    for length, values in {16: (1.0, 3.0, 0.5), 24: (1.5, 7.0, 0.4), 32: (0.2, 15.0, 0.1)}.items():
        for metric, v in zip(("entropy", "distance", "sink"), values):
            rows += [{"length": length, "layer": 0, "head": 0, "metric": metric, "value": v},
                     {"length": length, "layer": 0, "head": 1, "metric": metric, "value": 2 * v}]
    changes = head_changes(pd.DataFrame(rows), n_ctx=16)
    at = changes[(changes["length"] == 32) & (changes["head"] == 1)].iloc[0]
    assert at["entropy"] == pytest.approx(0.4 - 2.0) and at["sink"] == pytest.approx(0.2 - 1.0)
    assert at["distance"] == pytest.approx(math.log2(31 / 7))
    order = breaking_order(changes, 24)
    assert order["name"].tolist() == ["L0H1", "L0H0"] and order["change"].tolist() == pytest.approx([1.0, 0.5])


def test_a_repair_changes_at_most_its_fraction():
    cfg = GQA.replace(n_layers=5)  # 30 heads in KV groups of 3
    order = pd.DataFrame({"layer": [4, 4, 1, 0, 2, 3], "head": [5, 0, 2, 3, 4, 1]})
    heads, groups = choose_repair(order, cfg, 0.2)  # at most 6 heads
    assert heads == [(4, 5), (4, 0), (1, 2), (0, 3), (2, 4), (3, 1)]
    assert groups == [(4, 1), (4, 0)]  # (1, 0) would make 9 heads
    heads, groups = choose_repair(order, cfg, 0.1)  # 3 heads: one group
    assert heads == [(4, 5), (4, 0), (1, 2)] and groups == [(4, 1)]
    gemma = GEMMA3_LIKE.replace(n_layers=6, layer_types=("sliding", "sliding", "full") * 2)  # 30 heads, 1 KV head a layer
    _, groups = choose_repair(pd.DataFrame({"layer": [0, 2, 1, 5], "head": [0, 1, 2, 3]}), gemma, 0.2)
    assert groups == [(2, 0)]  # local layers are not rescaled; a second group would make 10 heads


def test_prompts_past_the_context_only_when_asked():
    model = build(small(n_ctx=256, d_vocab=257, positional="rotary"))
    model.tokenizer = ByteTokenizer()
    with pytest.raises(BadValue, match="above this model's context"):
        retrieval_prompts(model, [400], [0.5], 1, seed=0)
    (p,) = retrieval_prompts(model, [400], [0.5], 1, seed=0, max_length=400)
    assert 380 < p.n_tokens <= 400


# ---- 5. the study ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def zoo_study(tmp_path_factory):
    out = tmp_path_factory.mktemp("extrapolate") / "zoo"
    argv = ["extrapolate", "rope-gqa-4l", "--lengths", "256,384,512", "--scalings", "none,yarn", "--depths", "0.5",
            "--buckets", "4", "--out", str(out), "--no-progress"]
    assert cli(argv) == 0
    return out


def test_the_command_writes_its_tables_settings_and_report(zoo_study):
    out = zoo_study
    for name in ("perplexity.parquet", "perplexity.csv", "passkey.csv", "heads.csv", "autopsy.parquet", "report.md",
                 "report.html", "figures/perplexity_by_position.png", "figures/change_vs_share.png"):
        assert (out / name).is_file(), name
    settings = json.loads((out / "settings.json").read_text())
    assert set(SHARED_KEYS) <= set(settings) and settings["rope_scaling"] is None  # restored after every scaling
    assert settings["scalings"] == ["none", "yarn:2"] and settings["lengths"] == [256, 384, 512]
    assert settings["scaling_parameters"]["yarn:2"]["rope_type"] == "yarn"
    assert settings["scaling_parameters"]["yarn:2"]["original_max_position_embeddings"] == 256
    assert set(settings["spearman"]) == {"entropy", "distance", "sink"}
    heads = read_table(out, "heads")
    assert len(heads) == 16 and sorted(heads["break_rank"]) == list(range(1, 17))
    assert settings["break_first"][0] == heads.loc[heads["break_rank"] == 1, "name"].item()
    assert heads["repaired_scaling"].sum() <= 3 and heads["repaired_temperature"].sum() == 3  # 20% of 16 heads
    ppl = read_table(out, "perplexity")
    assert set(ppl["scaling"]) == {"none", "yarn:2", "yarn:2 (repair)", "logn (repair)"}
    passkey = read_table(out, "passkey")
    assert len(passkey[passkey["scaling"] == "yarn:2"]) == 3 and len(passkey[passkey["repair"]]) == 2
    autopsy = read_table(out, "autopsy")
    assert len(autopsy) == 2 * 3 * 16 * len(METRICS)
    report = (out / "report.md").read_text()
    assert "The heads that break first" in report and settings["break_first"][0] in report
    assert "Repairing the heads that break" in report and "Spearman" in report


def test_without_a_repair_the_model_as_loaded_alone(tmp_path):
    out = tmp_path / "plain"
    argv = ["extrapolate", "rope-gqa-4l", "--lengths", "256,512", "--scalings", "none", "--repair", "off", "--depths",
            "0.5", "--out", str(out), "--no-progress"]
    assert cli(argv) == 0
    settings = json.loads((out / "settings.json").read_text())
    assert settings["repair"] is None and settings["scalings"] == ["none"]
    assert set(read_table(out, "perplexity")["scaling"]) == {"none"}
    heads = read_table(out, "heads")
    assert not heads["repaired_scaling"].any() and not heads["repaired_temperature"].any()
    assert "Repairing" not in (out / "report.md").read_text()


def test_without_depths_no_passkey_is_asked(tmp_path, capsys):
    out = tmp_path / "heads"
    argv = ["extrapolate", "rope-gqa-4l", "--lengths", "256,512", "--scalings", "none,yarn", "--depths", "none",
            "--out", str(out), "--no-progress"]
    assert cli(argv) == 0
    assert "passkey (" not in capsys.readouterr().out  # no stage asked one
    settings = json.loads((out / "settings.json").read_text())
    assert settings["depths"] == [] and settings["repair"]["scaling"] == "yarn:2"
    assert read_table(out, "passkey").empty and len(set(read_table(out, "perplexity")["scaling"])) == 4
    report = (out / "report.md").read_text()
    assert "## Passkey" not in report and "no passkey prompt was asked" in report and "passkey at" not in report
    assert "Repairing the heads that break" in report


def test_the_study_rows_are_the_model_run_so(zoo_study):
    """The yarn rows are the model loaded with yarn:2: perplexity past n_ctx and the heads' entropy."""
    model = interp.load("rope-gqa-4l", rope_scaling="yarn:2")
    toks = build_tokens(DataSpec(kind="corpus", n_seqs=1, seq_len=512), model)  # auto: a zoo model reads the corpus
    nll = sequence_nll(model, toks)
    ppl = read_table(zoo_study, "perplexity")
    last = ppl[(ppl["scaling"] == "yarn:2") & (ppl["bucket"] == 3)].iloc[0]
    assert last["perplexity"] == pytest.approx(math.exp(nll[0, 383:].mean().item()), rel=1e-4)
    scores = scores_by_length(model, toks, [384])
    autopsy = read_table(zoo_study, "autopsy")
    mine = autopsy[(autopsy["scaling"] == "yarn:2") & (autopsy["length"] == 384)]
    assert np.allclose(mine["value"].to_numpy(), scores["value"].to_numpy(), rtol=1e-4, atol=1e-5)


def test_a_gemma_like_model_repairs_its_global_layer_only(tmp_path):
    model = build(GEMMA3_LIKE.replace(n_ctx=256, d_vocab=257))
    model.tokenizer = ByteTokenizer()
    settings = ExtrapolateSettings(model="gemma-like", data=StudyData.of(DataSpec(kind="text", n_seqs=1, seq_len=4)),
                                   lengths=(256, 512), scalings=("none", "yarn"), depths=(0.5,), repair_fraction=0.2)
    study = ExtrapolateStudy()
    run(study, model, tmp_path / "g", study.checked(model.cfg, settings), log=lambda *a: None)
    heads = read_table(tmp_path / "g", "heads")
    assert set(heads.loc[heads["repaired_scaling"], "layer"]) <= {2}  # the one full layer
    assert (heads.loc[heads["layer"] < 2, "window"] == 4).all() and (heads.loc[heads["layer"] == 2, "window"] == 0).all()
    settings_json = json.loads((tmp_path / "g" / "settings.json").read_text())
    assert "spearman_global_layers" in settings_json and len(settings_json["rotary_tables"]) == 2


@pytest.mark.parametrize("extra, message", [
    (["--scalings", "none,wavy"], "rope_scaling type 'wavy' is not one of"),
    (["--scalings", "linear,yarn"], "--scalings must include none"),
    (["--scalings", "none,yarn,yarn:2"], "lists yarn:2 twice"),
    (["--lengths", "128,256"], "needs one length within the model's context (n_ctx=256) and one past it"),
    (["--lengths", "300,512"], "needs one length within"),
    (["--lengths", "256,100000000"], "--lengths 100000000: about"),
    (["--repair-fraction", "0.3"], "a repair changes at most 0.2 of the heads"),
    (["--repair", "ntk"], "--repair ntk:2 is compared with the same scaling on every head"),
    (["--depths", "0.5,1.5"], "--depths 1.5"),
    (["--factor", "0"], "--factor must be"),
    (["--rope-scaling", "yarn:2"], "compares RoPE scalings itself"),
])
def test_bad_input_is_one_line_before_loading(extra, message, tmp_path, capsys, monkeypatch):
    _no_loading(monkeypatch)
    out = tmp_path / "out"
    argv = ["extrapolate", "rope-gqa-4l", "--scalings", "none,yarn", "--out", str(out), "--no-progress"]
    assert cli([*argv, *extra]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and message in err, err
    assert not out.exists()


@pytest.mark.parametrize("model, extra, message", [
    ("attn-only-2l", [], "positions are learned embeddings, which end at n_ctx=256"),
    ("alibi-gqa-4l", ["--scalings", "none,yarn"], "--scalings yarn: RoPE scalings need rotary positions, and this "
                                                  "model's are alibi"),
    ("alibi-gqa-4l", ["--repair", "yarn"], "--repair yarn: a repair rescales RoPE"),
])
def test_positions_no_scaling_applies_to_are_refused_in_one_line(model, extra, message, tmp_path, capsys, monkeypatch):
    _no_loading(monkeypatch)
    assert cli(["extrapolate", model, *extra, "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err
    assert not (tmp_path / "o").exists()


def test_an_alibi_model_is_read_as_loaded(tmp_path):
    """No scaling, share, Spearman or repair: the perplexity, passkey and every head's change past n_ctx alone,
    and the losses are the model's own."""
    model = build(small(positional="alibi", n_ctx=256, d_vocab=257, n_heads=4))  # a passkey prompt: >= 246 bytes
    model.tokenizer = ByteTokenizer()
    settings = ExtrapolateSettings(model="alibi", data=StudyData.of(DataSpec(kind="text", n_seqs=2, seq_len=4)),
                                   lengths=(256, 512), depths=(0.5,), buckets=4)
    study = ExtrapolateStudy()
    run(study, model, tmp_path / "a", study.checked(model.cfg, settings), log=lambda *a: None)
    record = json.loads((tmp_path / "a" / "settings.json").read_text())
    assert record["scalings"] == ["none"] and record["repair"] is None and record["positions"] == "alibi"
    assert record["spearman"] is None and record["rotary_tables"] == []
    heads = read_table(tmp_path / "a", "heads")
    assert len(heads) == 4 * model.cfg.n_layers and heads["share"].isna().all() and heads["entropy"].notna().all()
    ppl = read_table(tmp_path / "a", "perplexity")
    assert set(ppl["scaling"]) == {"none"} and len(ppl) == 4
    toks = build_tokens(DataSpec(kind="text", n_seqs=2, seq_len=512), model)
    nll = sequence_nll(model, toks)
    assert ppl.iloc[-1]["perplexity"] == pytest.approx(math.exp(nll[:, 383:].mean().item()), rel=1e-4)
    report = (tmp_path / "a" / "report.md").read_text()
    assert "its positions are alibi" in report and "Never-completed" not in report and "Repairing" not in report
    assert not (tmp_path / "a" / "figures" / "change_vs_share.png").exists()


def test_the_controlled_case_alibi_holds_its_loss_past_the_trained_length_and_rope_does_not():
    """The zoo's twins (same data, seed, initial weights and steps; trained at 256 tokens) read to 4x on the
    held-out sources, as the literature says: ALiBi holds its perplexity past n_ctx (Press et al. 2022), plain
    RoPE fails soon past it, and YaRN at the factor 4 brings RoPE back (Peng et al. 2023). Measured on 4
    windows of the held-out Python sources: RoPE 3.11 inside / 14.25 past, ALiBi 3.01 / 3.12, RoPE with
    yarn:4 4.14 / 4.38."""
    split = {}
    for name, scaling in (("rope-gqa-4l", None), ("alibi-gqa-4l", None), ("rope-gqa-4l", "yarn:4")):
        model = interp.load(name, rope_scaling=scaling)
        assert model.cfg.n_ctx == 256
        toks = build_tokens(DataSpec(kind="corpus", n_seqs=4, seq_len=1024), model)
        split[name, scaling] = split_perplexity(sequence_nll(model, toks), 256)
    (rope_in, rope_past), (alibi_in, alibi_past) = split["rope-gqa-4l", None], split["alibi-gqa-4l", None]
    assert rope_past > 3 * rope_in and alibi_past < 1.1 * alibi_in
    assert split["rope-gqa-4l", "yarn:4"][1] < 1.5 * rope_in


def _no_loading(monkeypatch):
    import interp.loading
    import interp.models.formats.checkpoint

    def refuse(*a, **k):
        raise AssertionError("the model was loaded before the settings were checked")

    monkeypatch.setattr(interp.loading, "load_checkpoint", refuse)
    monkeypatch.setattr(interp.models.formats.checkpoint, "load_checkpoint", refuse)


def test_help_imports_no_torch_and_names_the_librarys_defaults():
    code = ("import sys; from interp.cli import main\ntry:\n    main(['extrapolate', '--help'])\nexcept SystemExit: pass\n"
            "print('TORCH' if 'torch' in sys.modules else 'NO-TORCH')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=tempfile.gettempdir()).stdout
    assert out.splitlines()[-1] == "NO-TORCH", out[-500:]
    from interp.analyses.extrapolation import extrapolate
    from interp.commands import choices

    assert choices.EXTRAPOLATE_SCALINGS == extrapolate.SCALINGS and choices.EXTRAPOLATE_FACTOR == extrapolate.FACTOR
    assert choices.EXTRAPOLATE_DEPTHS == extrapolate.DEPTHS
    assert choices.EXTRAPOLATE_REPAIR_FRACTION == extrapolate.REPAIR_FRACTION
