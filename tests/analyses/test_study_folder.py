"""Two studies into one folder, and a user's file under a study's name (issue 56, D3). A circuit and a kv
study started together into one new folder both said "done", and the first one's results were gone; a
user's file named like a study's table was refused only after the work, with the old results already
deleted. Ownership is now checked again under the folder's lock when a study writes, and every fixed name a
study writes is checked against the folder before the work."""

from __future__ import annotations

import json

import pandas as pd
import pytest
import torch

import interp
from interp.analyses import study as S
from interp.analyses.document import Section
from interp.analyses.store import OutputError


class Tiny(S.Study):
    """A study whose table is one number computed by hand: the model's mean logit on one token."""

    name, title = "tiny", "Tiny"
    tables = (S.Table("numbers", ("what", "value")),)

    def measure(self, model, settings, stage):
        with torch.no_grad():
            logits = model(model.to_tokens("ab"))
        return {"numbers": pd.DataFrame({"what": ["mean logit"], "value": [float(logits.mean())]})}

    def sections(self, settings, measured, record):
        return [Section("summary", "Summary").add(f"{len(measured['numbers'])} number(s).")]


class Other(Tiny):
    name, title = "other", "Other"
    measure = Tiny.measure  # its own, whatever a test does to Tiny's


@pytest.fixture(scope="module")
def model():
    return interp.load("attn-only-2l")


def test_a_study_that_wrote_while_this_one_ran_keeps_its_results(model, tmp_path, monkeypatch):
    out = tmp_path / "shared"
    real_measure = Tiny.measure

    def measure_while_another_writes(self, model, settings, stage):
        S.run(Other(), model, out, S.StudySettings(), log=lambda *a: None)  # started beside this one, done first
        return real_measure(self, model, settings, stage)

    monkeypatch.setattr(Tiny, "measure", measure_while_another_writes)
    with pytest.raises(OutputError, match=r"now holds the results of the other study, written there while this tiny "
                                          r"study ran: nothing of this run was written"):
        S.run(Tiny(), model, out, S.StudySettings(), log=lambda *a: None)
    assert json.loads((out / "settings.json").read_text())["study"] == "other"  # the first to finish keeps its folder
    assert (out / "report.md").is_file() and (out / "numbers.parquet").is_file() or (out / "numbers.csv").is_file()


def test_a_user_file_under_a_study_name_is_refused_before_the_work(model, tmp_path, monkeypatch):
    out = tmp_path / "out"
    S.run(Tiny(), model, out, S.StudySettings(), log=lambda *a: None)
    old = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    for name in ("numbers.csv", "numbers.parquet"):
        (out / name).unlink(missing_ok=True)
    (out / "numbers.csv").write_text("my own numbers\n")
    monkeypatch.setattr(Tiny, "measure", lambda *a: pytest.fail("the work ran before the refusal"))
    with pytest.raises(OutputError, match="numbers.csv exists and was not written by interp"):
        S.run(Tiny(), model, out, S.StudySettings(), log=lambda *a: None)
    assert (out / "numbers.csv").read_text() == "my own numbers\n"
    assert (out / "settings.json").read_bytes() == old["settings.json"]  # the old results were not discarded
