"""Boundary protection in the studies (issue 68, part 1): `+protect(...)` passes through `interp kv passkey` into
the labels, settings.json and the report; `interp kv select --equal-bytes 'h2o+protect(10%)'` compares the
selections against a protected policy at their bytes; bad protection is one line before the model loads."""

from __future__ import annotations

import json

import pandas as pd
import pytest

import interp
from interp.analyses.kv.policies import policy_runs, protect_sentence, protected_counts
from interp.analyses.kv.roles import equal_bytes_budget, equal_bytes_name, equal_bytes_runs
from interp.cli import main as cli
from interp.models.kv.policies import parse_policy

from spies import refuse_loading


def test_runs_carry_the_protection_in_label_budget_and_record():
    runs = policy_runs("full,h2o(132),h2o(132)+protect(10%),random(132)+protect(0,13),streaming(4,128)")
    assert [r.label for r in runs] == ["full", "h2o(132)", "h2o(132)+protect(10%)", "random(132)+protect(0,13)",
                                       "streaming(4,128)"]
    assert [r.tokens_per_head for r in runs] == [None, 132, 132, 132, 132]  # protection is inside the budget
    assert protected_counts(runs) == {"h2o(132)+protect(10%)": [4, 9], "random(132)+protect(0,13)": [0, 13]}
    line = protect_sentence([r.label for r in runs] + ["razor 9/90"])
    assert line == ("Boundary protection (arXiv 2605.18053): h2o(132) protects nothing; h2o(132)+protect(10%) never "
                    "evicts its first 4 and last 9 tokens (inside its 132); random(132)+protect(0,13) never evicts its "
                    "first 0 and last 13 tokens (inside its 132).")
    assert protect_sentence(["full", "h2o(132)"]) is None


def test_equal_bytes_runs_pass_the_protection_through():
    b = equal_bytes_budget(0.1, 1024, 4, 128)
    assert equal_bytes_name("h2o+protect(10%)", b) == f"h2o({b})+protect(10%)"
    assert equal_bytes_name("snapkv", b) == f"snapkv({b})"
    runs = equal_bytes_runs([0.1], [1024], method="tova + protect(4,9)")
    assert [r.label for r in runs] == [f"tova({b})+protect(4,9) ~0.1@1024"]
    assert parse_policy(runs[0].policy).protected == (4, 9) and runs[0].tokens_per_head == b


def test_the_cli_writes_protection_into_settings_and_report(tmp_path, capsys):
    out = tmp_path / "study"
    policies = ["full", "h2o(48)", "h2o(48)+protect(2,4)", "random(48)+protect(10%)"]
    argv = ["kv", "passkey", "attn-only-2l", "--lengths", "248", "--depths", "0.5", "--prompts", "1",
            "--policies", ",".join(policies), "--seq-len", "128", "--new-tokens", "4", "--out", str(out),
            "--no-progress"]
    assert cli(argv) == 0, capsys.readouterr().err
    cells = pd.read_parquet(out / "kv_policies.parquet")
    assert cells["policy"].unique().tolist() == policies
    same = cells.set_index("policy")["bytes_per_token"]
    assert same["h2o(48)"] == same["h2o(48)+protect(2,4)"]  # the same bytes held
    settings = json.loads((out / "settings.json").read_text())
    assert settings["policies"] == policies
    assert settings["protected"] == {"h2o(48)+protect(2,4)": [2, 4], "random(48)+protect(10%)": [1, 4]}
    report = (out / "report.md").read_text()
    assert "h2o(48)+protect(2,4) never evicts its first 2 and last 4 tokens (inside its 48)" in report


@pytest.mark.parametrize("argv, message", [
    (["passkey", "--policies", "full,h2o(48)+protect(40,9)"], "protects 40 + 9 = 49 tokens, more than its budget of 48"),
    (["passkey", "--policies", "h2o(48)+protect(-1,9)"], "cannot be negative"),
    (["passkey", "--policies", "h2o(48)+protect(1.2)"], "between 0 and 1"),
    (["passkey", "--policies", "kivi4+protect(4,9)"], "kivi4 keeps every token and evicts nothing"),
    (["passkey", "--policies", "streaming(4,32)+protect(10%)"], "keeps only its first and last tokens already"),
    (["select", "--rankings", "random", "--fractions", "0.5", "--equal-bytes", "h2o+protect(0%)"], "between 0 and 1"),
    (["select", "--rankings", "random", "--fractions", "0.5", "--equal-bytes", "full+protect(4,9)"], "takes no arguments"),
])
def test_bad_protection_is_one_line_before_the_model_loads(tmp_path, capsys, monkeypatch, argv, message):
    refuse_loading(monkeypatch)
    out = tmp_path / "out"
    cmd, *rest = argv
    common = ["--lengths", "248", "--depths", "0.5", "--prompts", "1", "--seq-len", "256", "--out", str(out),
              "--no-progress"]
    assert cli(["kv", cmd, "attn-only-2l", *rest, *common]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    assert message in err, err
    assert not out.exists()


def test_the_roles_report_names_the_policy_it_compares_at_the_same_bytes():
    """`kv select --equal-bytes 'tova+protect(10%)'`: the summary and the selections' table name TOVA, protected, and
    its count beside the rankings at each share (it said "SnapKV" whatever was compared)."""
    from interp.analyses.kv.roles_study import roles_headline, roles_sections

    def cell(policy, selection, share, correct):
        return dict(policy=policy, selection=selection, full_fraction=share, length=1024, correct=correct, n=4,
                    bytes_per_token=100.0)

    cells = pd.DataFrame([cell("full", "full", 1.0, 4), cell("streaming(4,128)", "streaming", 0.0, 0),
                          cell("razor 9/90", "razor", 0.1, 1), cell("random#0 9/90", "random", 0.1, 0),
                          cell("tova(529)+protect(10%) ~0.1@1024", "tova+protect(10%)", 0.1, 3)])
    query = pd.DataFrame(dict(layer=[0, 0, 1], head=[0, 1, 0], kv_head=[0, 0, 0], retrieval=[0.5, 0.0, 0.2],
                              induction=[0.1, 0.9, 0.3]))
    lines = roles_headline("m", cells, query, query, 4, 128, "tova+protect(10%)")
    assert "10%: razor 1 of 4; random 0-0; tova+protect(10%) on every head at the same bytes 3 of 4" in lines[0]
    assert "same bytes" not in roles_headline("m", cells, query, query, 4, 128, None)[0]
    summary, table = roles_sections("m", cells, None, query, query, None, 4, 128, equal_bytes="tova+protect(10%)")[:2]
    text = " ".join(b for b in table.blocks if isinstance(b, str))
    assert "tova+protect(10%) on every head" in text and "SnapKV" not in text
