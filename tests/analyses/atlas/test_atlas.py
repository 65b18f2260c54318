"""The head atlas (`interp analyze`) on a real model and real text: the default text, the scores in
the results against patterns materialised here, StreamingLLM as published on a zoo model, Michel
et al.'s pruning protocol, and bad input refused before any model is loaded."""

from __future__ import annotations

import json
import math

import pandas as pd
import pytest
import torch
from analyses_fixtures import build, tokens  # noqa: F401
from smol import SMOL, needs_smol, smollm2_atlas

import interp
from interp.analyses import window_eval
from interp.analyses.pruning import prunable_fractions, pruning_curve, pruning_study
from interp.analyses.data import DataSpec, build_tokens, check_data, read_text
from interp.cli import main as cli


def test_default_text_is_the_language_reference():
    text = read_text()
    assert len(text) > 400_000 and "The \"import\" statement" in text  # pydoc_data.topics, ~465 KB of prose


@needs_smol
def test_text_windows_on_smollm2(smollm2):
    model = smollm2  # the suite's one SmolLM2 (tests/conftest.py)
    spec = DataSpec(kind="text", n_seqs=3, seq_len=64, seed=2)
    a, b = build_tokens(spec, model), build_tokens(spec, model)
    assert a.shape == (3, 64) and torch.equal(a, b)
    assert (a[:, 0] == model.tokenizer.bos_token_id).all()  # BOS first, as TransformerLens prepends it
    body = model.tokenizer.encode(read_text(), add_special_tokens=False)
    row = a[0, 1:].tolist()  # each window is a consecutive stretch of the tokenized text
    starts = [i for i in range(0, len(body) - 63, 63) if body[i : i + 63] == row]
    assert starts


def test_bad_data_is_refused_before_any_model_is_loaded(tmp_path, capsys):
    short = tmp_path / "short.txt"
    short.write_text("too short " * 10)
    with pytest.raises(ValueError, match="too short for 16 sequences of 256"):
        check_data(DataSpec(kind="text", path=str(short)))
    out = tmp_path / "out"
    # a model name that does not exist: the data error comes first, before any name is resolved
    assert cli(["analyze", "no-such-model", "--out", str(out), "--text-file", str(short)]) == 2
    assert "too short" in capsys.readouterr().err and not out.exists()
    assert cli(["analyze", "attn-only-2l", "--out", str(out), "--text-file", str(tmp_path / "missing.txt")]) == 2
    assert "does not exist" in capsys.readouterr().err and not out.exists()
    assert cli(["analyze", "attn-only-2l", "--out", str(out), "--analyses", "induction,atlas"]) == 2
    assert "unknown analyses ['atlas']" in capsys.readouterr().err and not out.exists()


def test_window_larger_than_the_sequence_is_refused():
    with pytest.raises(ValueError, match="not smaller than the 16-token sequences"):
        window_eval(build("rotary-gqa"), tokens(1, 16), window=[4, 32])


# ---- StreamingLLM as published, on a trained model beyond its context --------------------------------
def test_streaming_llm_beyond_the_context_on_the_zoo():
    """rope-gqa-4l at 4x its n_ctx: with the original positions the sinks sit > n_ctx away and window +
    sinks is worse than the window alone; renumbered in the cache, window + sinks is as good as full
    attention inside n_ctx (measured: 1.129 vs 1.143; original 1.59, window alone 1.134)."""
    from interp.analyses import evaldata
    from interp.models.zoo.training import eval_windows

    model = interp.load("rope-gqa-4l")
    n, w = model.cfg.n_ctx, 64
    stream = eval_windows(evaldata.heldout_docs(), 4 * n, 4, seed=0)  # the shipped held-out files, on any Python
    late = lambda f, s: f[(f.setting == s) & (f.position >= n)].loss.mean()  # noqa: E731
    cache = window_eval(model, stream, window=w, n_sink=4, per_position=True)
    original = window_eval(model, stream, window=w, n_sink=4, per_position=True, positions="original")
    inside = window_eval(model, stream[:, :n], window=w, n_sink=4, per_position=True)
    full_inside = inside[(inside.setting == "full") & (inside.position >= w)].loss.mean()
    assert late(original, "window+sink") > late(original, "window") + 0.2
    assert late(cache, "window+sink") <= late(cache, "window") + 0.01
    assert abs(late(cache, "window+sink") - full_inside) < 0.05
    assert late(cache, "full") > full_inside + 0.5  # full attention itself breaks past n_ctx


# ---- Michel et al.'s pruning protocol ------------------------------------------------------------------
def test_prunable_fraction_reads_the_curve():
    curves = pd.DataFrame({"order": ["a"] * 4 + ["random"] * 6, "seed": [0] * 4 + [0, 0, 0, 1, 1, 1],
                           "fraction_pruned": [0, .1, .2, .3, 0, .1, .2, 0, .1, .2],
                           "loss": [2.0, 2.05, 2.2, 2.01, 2.0, 2.2, 2.3, 2.0, 2.09, 2.3]})
    got = prunable_fractions(curves, clean=2.0, tolerance=0.05)
    assert got["a"] == pytest.approx(0.1)  # the first point above 2.1 ends it, a later dip does not count
    assert got["random"] == pytest.approx((0.0 + 0.1) / 2)


def test_pruning_study_splits_the_data_and_orders_both_ways():
    model = build("rotary-gqa")
    toks = tokens(6, 20, seed=9)
    study = pruning_study(model, toks, split=0.5, seeds=(0, 1, 2), step=2, max_fraction=0.5, progress_bar=False)
    assert set(study.groupby("order")["seed"].nunique().items()) == {("importance", 1), ("reverse", 1), ("random", 3)}
    with torch.no_grad():  # the curve is measured on the held-out half
        assert study.attrs["clean_loss"] == pytest.approx(float(model(toks[3:], return_type="loss")), abs=1e-5)
    imp = pruning_curve(model, toks[:3], order="importance", step=2, progress_bar=False)
    rev = study[(study.order == "reverse") & (study.step == 1)]["pruned"].iloc[0].split(",")
    first_imp = imp[imp.step == 1]["pruned"].iloc[0].split(",")
    assert not set(rev) & set(first_imp)  # the most important heads go first, not the least
    assert set(study.attrs["prunable"]) == {"importance", "reverse", "random"}


# ---- the atlas on SmolLM2: the report's numbers against patterns materialised here ---------------------
@needs_smol
@pytest.mark.slow
def test_analyze_smollm2_scores_equal_materialised_patterns(tmp_path, smollm2):
    out = smollm2_atlas(tmp_path / "atlas", seq_len=96, analyses="previous_token,induction,sinks,composition")
    settings = json.loads((out / "settings.json").read_text())
    assert settings["data"]["kind"] == "text"  # real text by default for a real model
    table = pd.read_parquet(out / "results.parquet")
    model = smollm2  # the suite's one SmolLM2 (tests/conftest.py)
    toks = build_tokens(DataSpec.from_dict(settings["data"]), model)
    _, cache = model.run_with_cache(toks, names_filter=lambda n: n.endswith("hook_pattern"))
    get = lambda metric, l, h: float(table[(table.metric == metric) & (table.layer == l) & (table["head"] == h)].value.iloc[0])  # noqa: E731
    n = toks.shape[1]
    for l, h in [(0, 0), (3, 5), (17, 2), (29, 8)]:
        a = cache["pattern", l][:, h].double()  # [batch, q, k]
        # Gu et al.'s alpha_0: mean attention to token 0 over the queries that see it (all of them)
        assert get("sink_alpha", l, h) == pytest.approx(float(a[:, :, 0].mean()), abs=1e-4)
        # detect_head ("mul", TransformerLens's defaults): the pattern's mass on j = p - 1 over its total
        # mass (n rows of 1), per prompt, then the mean over prompts
        want = (a.diagonal(offset=-1, dim1=1, dim2=2).sum(-1) / n).mean()
        assert get("previous_token", l, h) == pytest.approx(float(want), abs=1e-4), (l, h)
    icl = table[table.metric == "icl_late_position"].value.iloc[0]
    assert icl == n - 1  # stated, not clipped
    html = (out / "report.html").read_text()
    assert "L" in html and "Composition" in html and "random" in html
    assert not math.isnan(table[table.metric == "composition_baseline"].value.iloc[0])
