"""A new study is one file plus its test: a `Study` defined here, outside interp (its settings, its tables,
what only its report reads as a typed `Measured` subclass), runs through `study.run` on a tiny model, and
its tables, settings.json and report hold the numbers computed here by hand from the model's logits. A
name that is not a declared table is refused, an underscore or not: what only the report reads is typed."""

from __future__ import annotations

import json
from dataclasses import dataclass

import pandas as pd
import pytest
import torch
from core_models import build, small

from interp.analyses.document import Section
from interp.analyses.store import read_table
from interp.analyses.study import SHARED_KEYS, Measured, Study, StudyData, StudySettings, Table, run
from interp.errors import UserError


@dataclass(frozen=True, kw_only=True, eq=False)
class LossSettings(StudySettings):
    """skip: the first predictions of each sequence left out of the loss (they have little context)."""

    skip: int = 1


@dataclass(frozen=True, kw_only=True, eq=False)
class LossMeasured(Measured):
    """What only the report reads: the sequence with the largest mean loss, and the mean over every sequence."""

    worst: int
    mean: float


class SequenceLoss(Study):
    """Per sequence, the mean next-token loss past its first `skip` predictions; per position, the mean over
    the sequences."""

    name, title = "sequence-loss", "Loss per sequence"
    tables = (Table("sequences", ("sequence", "loss")), Table("positions", ("position", "loss")))

    def check(self, cfg, s: LossSettings):
        if not 0 <= s.skip < s.data.length - 1:
            raise ValueError(f"skip {s.skip}: leaves no prediction in sequences of {s.data.length} tokens")
        return s, []

    def measure(self, model, s: LossSettings, stage):
        tokens = s.data.tokens(model)
        nll = stage("loss", lambda: model(tokens, return_type="loss", loss_per_token=True))[:, s.skip:].detach()
        per_sequence = nll.mean(1)
        sequences = pd.DataFrame({"sequence": range(len(per_sequence)), "loss": per_sequence.tolist()})
        positions = pd.DataFrame({"position": range(s.skip + 1, s.skip + 1 + nll.shape[1]), "loss": nll.mean(0).tolist()})
        return LossMeasured(tables={"sequences": sequences, "positions": positions}, worst=int(per_sequence.argmax()),
                            mean=float(nll.mean()))

    def record(self, s: LossSettings, m: LossMeasured) -> dict:
        return {"skip": s.skip, "worst": m.worst}

    def sections(self, s: LossSettings, m: LossMeasured, record) -> list[Section]:
        return [Section("summary", "Summary").add(
            f"Mean loss {m.mean:.4f} past the first {s.skip} predictions; the worst sequence is {m.worst} "
            f"({m['sequences']['loss'].max():.4f}).")]


@pytest.fixture(scope="module")
def model():
    return build(small())


def settings(**changes) -> LossSettings:
    ids = torch.randint(0, 53, (3, 12), generator=torch.Generator().manual_seed(1))
    return LossSettings(**{"model": "tiny", "data": StudyData.given(ids, "3 x 12 random tokens"), "skip": 2, **changes})


def by_hand(model, ids: torch.Tensor, skip: int) -> torch.Tensor:
    """[sequences, predictions past skip]: -log softmax(logits at p)[token p + 1], in float64."""
    with torch.no_grad():
        logits = model(ids).double()
    logp = torch.log_softmax(logits[:, :-1], dim=-1)
    return -logp.gather(-1, ids[:, 1:, None])[..., 0][:, skip:]


def test_a_study_defined_in_a_test_runs_through_study_run(model, tmp_path):
    study, s = SequenceLoss(), settings()
    out = tmp_path / "loss"
    run(study, model, out, study.checked(model.cfg, s), log=lambda *_: None)
    nll = by_hand(model, s.data.ids, 2)  # [3, 9]

    sequences = read_table(out, "sequences")
    assert list(sequences["sequence"]) == [0, 1, 2]
    assert torch.allclose(torch.tensor(sequences["loss"].to_numpy()), nll.mean(1), rtol=1e-5)
    positions = read_table(out, "positions")
    assert list(positions["position"]) == list(range(3, 12))  # the tokens predicted: 3 .. 11
    assert torch.allclose(torch.tensor(positions["loss"].to_numpy()), nll.mean(0), rtol=1e-5)

    record = json.loads((out / "settings.json").read_text())
    worst = int(nll.mean(1).argmax())
    assert set(SHARED_KEYS) <= set(record) and record["study"] == "sequence-loss" and record["model"] == "tiny"
    assert record["skip"] == 2 and record["worst"] == worst and set(record["seconds"]) == {"loss"}
    md = (out / "report.md").read_text()
    assert md.startswith("# Loss per sequence: tiny")
    assert (f"Mean loss {float(nll.mean()):.4f} past the first 2 predictions; the worst sequence is {worst} "
            f"({float(nll.mean(1).max()):.4f})." in md)


def test_its_check_refuses_before_any_work(model, tmp_path):
    with pytest.raises(ValueError, match="skip 11: leaves no prediction in sequences of 12 tokens"):
        SequenceLoss().check(model.cfg, settings(skip=11))
    with pytest.raises(UserError, match="skip 11"):  # from Python: one line, as a command says it
        SequenceLoss().checked(model.cfg, settings(skip=11))


def test_what_only_the_report_reads_is_typed_never_a_table(model, tmp_path):
    class Keyed(SequenceLoss):
        def measure(self, model, s, stage):
            m = super().measure(model, s, stage)
            return {**m.tables, "_worst": m.worst}  # the old way: a name with an underscore

    with pytest.raises(ValueError, match=r"undeclared tables \['_worst'\]"):
        run(Keyed(), model, tmp_path / "keyed", settings(), log=lambda *_: None)
    assert not (tmp_path / "keyed").exists()
