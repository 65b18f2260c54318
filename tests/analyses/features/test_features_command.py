"""`interp features` on attn-only-2l with a tiny random SAE written here as SAELens writes one: every table with
its columns, the split's check in settings.json and the report, the feature view in report.html; an SAE on the
residual stream gets contexts and logit effects only; and each input that cannot work is one line before the
model loads."""

from __future__ import annotations

import json

import pytest

from interp.analyses.features.study import FEATURE_COLUMNS, FeaturesStudy
from interp.analyses.store import read_table
from interp.cli import main as cli

SMALL = ["--n-seqs", "4", "--seq-len", "64", "--top-k", "3", "--features", "5", "--batch-size", "3", "--no-progress"]


def test_the_command_writes_its_tables_and_report(sae_folder, tmp_path, capsys):
    sae = sae_folder("z", d_sae=40)
    out = tmp_path / "out"
    assert cli(["features", "attn-only-2l", "--sae", str(sae), *SMALL, "--out", str(out)]) == 0, capsys.readouterr().err
    for table in FeaturesStudy.tables:
        frame = read_table(out, table.name)
        assert set(table.columns) <= set(frame.columns), table.name
    features = read_table(out, "features")
    assert list(features.columns) == list(FEATURE_COLUMNS) and len(features) == 40
    assert features["shown"].sum() == 5 and (features["positions"] == 4 * 64).all()
    norms, top = read_table(out, "decoder_norms"), read_table(out, "head_features")
    assert len(norms) == 40 * 4 and set(top["by"]) == {"attribution", "share"} and set(top["head"]) == {0, 1, 2, 3}
    contexts = read_table(out, "contexts")
    assert contexts.groupby("feature")["rank"].max().max() == 2  # --top-k 3
    assert set(contexts["offset"]) <= set(range(-12, 5))
    record = json.loads((out / "settings.json").read_text())
    assert record["study"] == "features" and record["sae"]["hook_name"] == "blocks.1.attn.hook_z"
    assert record["site"] == "z" and record["n_sequences"] == 4 and record["seq_len"] == 64
    assert record["split_residual"]["largest"] < 1e-5 * record["split_residual"]["of"] * 10
    assert len(record["shown"]) == 5 and record["alive_features"] > 5
    report = (out / "report.md").read_text()
    assert report.startswith("# What the heads move: SAE features: attn-only-2l")
    for title in ("## Summary", "## What each head moves", "## The features", "## Direct effect on the logits"):
        assert title in report
    page = (out / "report.html").read_text()
    assert page.count('class="interp-view feature-view"') == 1 and "Kissane et al. 2024" in page
    assert (out / "figures" / "head_shares.png").is_file()


def test_a_residual_sae_gets_contexts_and_logit_effects_only(sae_folder, tmp_path, capsys):
    sae = sae_folder("resid", hook="blocks.0.hook_resid_post", d_sae=24)
    out = tmp_path / "out"
    assert cli(["features", "attn-only-2l", "--sae", str(sae), *SMALL, "--out", str(out)]) == 0
    assert "contexts and logit effects only" in capsys.readouterr().out
    written = sorted(p.stem for p in out.glob("*.parquet")) or sorted(p.stem for p in out.glob("*.csv"))
    assert written == ["contexts", "features", "logit_effects"]
    assert (read_table(out, "features")["top_head"] == -1).all()
    assert "is not split by head" in (out / "report.md").read_text()


@pytest.mark.parametrize("make, args, says", [
    (None, [], "no SAE at"),
    (dict(hook="blocks.1.attn.hook_q"), [], "the features study reads an attention output"),
    (dict(d_in=96), [], "d_in is 96 and blocks.1.attn.hook_z of this model is 128 wide"),
    (dict(hook="blocks.3.attn.hook_z"), [], "this model has 2 layers"),
    (dict(hook="blocks.1.hook_mlp_out"), [], "this model is attention-only: it has no hook_mlp_out"),
    (dict(normalize_activations="layer_norm"), [], "does not split by head"),
    (dict(), ["--top-k", "0"], "--top-k"),
    (dict(), ["--seq-len", "300"], "past this model's context"),
])
def test_an_input_that_cannot_work_is_one_line_before_the_model_loads(make, args, says, sae_folder, tmp_path, capsys,
                                                                      monkeypatch):
    import interp

    monkeypatch.setattr(interp, "load", lambda *a, **k: pytest.fail("refused before the model loads"))
    sae = tmp_path / "missing" if make is None else sae_folder("bad", **make)
    assert cli(["features", "attn-only-2l", "--sae", str(sae), "--no-progress", *args,
                "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and says in err, err
    assert not (tmp_path / "out").exists()


def test_from_python_as_the_command_runs_it(model, sae_folder, tmp_path):
    from interp.analyses.data import DataSpec
    from interp.analyses.features.study import FeaturesSettings
    from interp.analyses.study import StudyData, run

    settings = FeaturesSettings(model="attn-only-2l", sae=str(sae_folder("py", arch="topk", d_sae=32)),
                                data=StudyData.of(DataSpec(kind="corpus", n_seqs=2, seq_len=32)), top_k=2, features=3)
    report = run(FeaturesStudy(), model, tmp_path / "out", FeaturesStudy().checked(model.cfg, settings))
    assert report.is_file() and len(read_table(tmp_path / "out", "attribution")) > 0


def test_the_commands_defaults_are_the_studys_and_its_help_imports_no_torch():
    import subprocess
    import sys
    import tempfile

    from interp.analyses.features import study
    from interp.commands import features as command

    assert (command.TOP_K, command.SHOWN, command.BATCH) == (study.TOP_K, study.SHOWN, study.BATCH)
    code = ("import sys\nfrom interp.cli import main\ntry:\n    main(['features', '--help'])\nexcept SystemExit: pass\n"
            "print('TORCH' if 'torch' in sys.modules else 'NO-TORCH')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         cwd=tempfile.gettempdir()).stdout
    assert out.splitlines()[-1] == "NO-TORCH" and "--sae" in out


def test_a_wrapped_model_gets_every_table_but_the_logit_effects(sae_folder, tmp_path):
    """transformers runs a wrapped model: hook_z is there (the head tables are made), the weight views are not (the
    logit effects are left out, said in the report)."""
    transformers = pytest.importorskip("transformers")
    import torch

    import interp
    from interp.analyses.features.study import FeaturesSettings
    from interp.analyses.study import StudyData, run

    torch.manual_seed(0)
    config = transformers.GemmaConfig(vocab_size=97, hidden_size=48, num_attention_heads=6, num_key_value_heads=2,
                                      num_hidden_layers=2, intermediate_size=72, head_dim=8, pad_token_id=0,
                                      bos_token_id=1, eos_token_id=2)
    transformers.GemmaForCausalLM(config).eval().save_pretrained(tmp_path / "gemma")
    model = interp.load(str(tmp_path / "gemma"))
    assert not model.native
    ids = torch.randint(3, 97, (3, 12), generator=torch.Generator().manual_seed(0))
    settings = FeaturesSettings(model="gemma", sae=str(sae_folder("sae", d_in=48, d_sae=20)), top_k=2, features=3,
                                data=StudyData.given(ids, "3 x 12 ids"))
    run(FeaturesStudy(), model, tmp_path / "out", FeaturesStudy().checked(model.cfg, settings))
    assert not list((tmp_path / "out").glob("logit_effects.*")) and len(read_table(tmp_path / "out", "attribution"))
    assert "the model is wrapped" in (tmp_path / "out" / "report.md").read_text()
