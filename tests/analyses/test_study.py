"""`interp.analyses.study`: a study defined here, in the test, writes a complete folder through `run`, with
and without pyarrow; the folder rules (another study's results refused, a rerun replaces, --force), the
same settings.json keys for every study, and a declared table that is missing or lacks a column."""

from __future__ import annotations

import json
import sys

import pandas as pd
import pytest
import torch
from core_models import build, small

from interp.analyses.document import Section
from interp.analyses.store import OutputError, read_table
from interp.analyses.study import SHARED_KEYS, Study, StudyData, StudySettings, Table, fit_default, run
from interp.analyses.data import DataSpec


class Norms(Study):
    """Per head: the mean norm of its output z over the tokens, and the token count (a table per head
    and a table of one row, so a study writes two tables)."""

    name, title = "norms", "Head output norms"
    tables = (Table("norms", ("layer", "head", "norm")), Table("count", ("tokens",)),
              Table("extra", ("x",), optional=True))

    def measure(self, model, settings, stage):
        tokens = settings.data.tokens(model)

        def norms():
            _, cache = model.run_with_cache(tokens, names_filter=lambda n: n.endswith("hook_z"))
            rows = [dict(layer=l, head=h, norm=float(cache["z", l][:, :, h].norm(dim=-1).mean()))
                    for l in range(model.cfg.n_layers) for h in range(model.cfg.n_heads)]
            return pd.DataFrame(rows)

        frame = stage("norms", norms)
        return {"norms": frame, "count": pd.DataFrame({"tokens": [tokens.numel()]})}

    def record(self, settings, measured):
        return {"heads": len(measured["norms"])}

    def sections(self, settings, measured, record):
        return [Section("summary", "Summary").add(f"The largest mean norm: {measured['norms']['norm'].max():.4f}.")]


@pytest.fixture(scope="module")
def model():
    return build(small())


def settings(**changes):
    data = StudyData.given(torch.randint(0, 53, (2, 16), generator=torch.Generator().manual_seed(0)),
                           "2 x 16 random tokens")
    return StudySettings(**{"model": "tiny", "data": data, **changes})


def test_a_study_defined_here_writes_a_complete_folder(model, tmp_path):
    out = tmp_path / "norms"
    report = run(Norms(), model, out, settings(), log=lambda *_: None)
    assert report == out / "report.html" and report.is_file()
    listed = set(json.loads((out / ".interp-manifest.json").read_text())["paths"])
    assert {"norms.parquet", "count.parquet", "settings.json", "report.html", "report.md"} <= listed
    assert not (out / "extra.parquet").exists() and not (out / "norms.csv").exists()
    norms = read_table(out, "norms")
    assert len(norms) == 2 * 5 and list(norms.columns) == ["layer", "head", "norm"]
    record = json.loads((out / "settings.json").read_text())
    assert list(record)[:4] == ["study", "model", "data_description", "data_source"]
    assert set(SHARED_KEYS) <= set(record) and record["heads"] == 10 and record["study"] == "norms"
    assert record["data_description"] == "2 x 16 random tokens" and set(record["seconds"]) == {"norms"}
    assert record["compute"]["device"] == "cpu" and "torch" in record["versions"]
    md = (out / "report.md").read_text()
    assert md.startswith("# Head output norms: tiny") and f"The largest mean norm: {norms['norm'].max():.4f}." in md
    assert "Time: norms " in md and "Data source" not in md  # given tokens without a source name none


def test_without_pyarrow_every_table_is_csv_and_the_study_still_completes(model, tmp_path, monkeypatch):
    want = run(Norms(), model, tmp_path / "with", settings(), log=lambda *_: None)
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # `import pyarrow` now raises ImportError
    with pytest.raises(ImportError):
        pd.DataFrame({"a": [1]}).to_parquet(tmp_path / "x.parquet")  # as on a machine without it
    out = tmp_path / "without"
    run(Norms(), model, out, settings(), log=lambda *_: None)
    assert sorted(p.name for p in out.glob("*.csv")) == ["count.csv", "norms.csv"] and not list(out.glob("*.parquet"))
    monkeypatch.undo()
    pd.testing.assert_frame_equal(read_table(out, "norms"), read_table(want.parent, "norms"))


def test_another_studys_folder_is_refused_a_rerun_replaces_and_force_discards(model, tmp_path):
    out = tmp_path / "out"
    run(Norms(), model, out, settings(), log=lambda *_: None)
    (out / "figures").mkdir(exist_ok=True)
    mine = out / "figures" / "mine.png"
    mine.write_bytes(b"a user's file")

    class Other(Norms):
        name = "other"

    with pytest.raises(OutputError, match="holds the results of the norms study: .* --force"):
        run(Other(), model, out, settings(), log=lambda *_: None)
    run(Norms(), model, out, settings(model="again"), log=lambda *_: None)  # the same study: replaced whole
    assert json.loads((out / "settings.json").read_text())["model"] == "again"
    run(Other(), model, out, settings(), log=lambda *_: None, force=True)
    assert json.loads((out / "settings.json").read_text())["study"] == "other"
    assert mine.read_bytes() == b"a user's file"  # never interp's to remove


def test_a_user_file_is_never_replaced(model, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "norms.parquet").write_text("mine")
    with pytest.raises(OutputError, match="already holds files interp did not write"):
        run(Norms(), model, out, settings(), log=lambda *_: None)
    assert (out / "norms.parquet").read_text() == "mine"


def test_a_declared_table_must_be_measured_with_its_columns(model, tmp_path):
    class Lacking(Norms):
        def measure(self, model, settings, stage):
            got = super().measure(model, settings, stage)
            return {**got, "norms": got["norms"].drop(columns="norm")}

    class Missing(Norms):
        def measure(self, model, settings, stage):
            return {"norms": super().measure(model, settings, stage)["norms"]}

    class Stray(Norms):
        def measure(self, model, settings, stage):
            return {**super().measure(model, settings, stage), "loose": pd.DataFrame()}

    for study, message in ((Lacking(), r"lacks its columns \['norm'\]"), (Missing(), "did not measure its table count"),
                           (Stray(), r"undeclared tables \['loose'\]")):
        with pytest.raises(ValueError, match=message):
            run(study, model, tmp_path / study.__class__.__name__, settings(), log=lambda *_: None)
        assert not (tmp_path / study.__class__.__name__).exists()  # nothing written


def test_a_default_length_is_fitted_and_an_asked_one_is_not():
    spec = DataSpec(kind="text", n_seqs=1, seq_len=2048)
    fitted, note = fit_default(StudyData.of(spec, default_length=True), 256)
    assert fitted.length == 256 and note == ("note: --seq-len 2048 (the default) does not fit this model's context "
                                             "(n_ctx=256): --seq-len 256 used")
    asked, note = fit_default(StudyData.of(spec), 256)
    assert asked.length == 2048 and note is None
