"""One command per study (`interp kv precision|passkey|select`, `interp lengths`, `interp circuit`, `interp
extrapolate`, beside `interp analyze` and `interp sweep`): every `Study` subclass under `interp.analyses`, found
by importing each of its modules, has a command here and writes its declared tables with their columns, its
settings.json with the same keys as every study, and its report (so a new study cannot skip the contract); a
default length fitted to the model in one note (an explicit one past n_ctx still refused), the old spellings
with one deprecation note, at most 12 options of its own per `interp kv` subcommand, a study that completes
without pyarrow, and one study's folder refused to another without --force."""

from __future__ import annotations

import argparse
import importlib
import json
import pkgutil
import sys

import pandas as pd
import pytest

import interp.analyses
from interp.analyses.store import read_table
from interp.analyses.study import SHARED_KEYS, Study
from interp.cli import build_parser
from interp.cli import main as cli

PASSKEY = ["--lengths", "248", "--depths", "0.5", "--prompts", "1", "--seq-len", "200", "--no-progress"]
COMMANDS = {
    "precision": ["kv", "precision", "attn-only-2l", "--seq-len", "96", "--sensitivity-tokens", "64", "--seeds", "1",
                  "--no-progress"],
    "passkey": ["kv", "passkey", "attn-only-2l", "--policies", "full,streaming(4,32)", *PASSKEY],
    "select": ["kv", "select", "attn-only-2l", "--rankings", "retrieval,random", "--fractions", "0.5", "--window", "32",
               "--scoring-prompts", "1", "--selection-seeds", "1", *PASSKEY],
    "lengths": ["lengths", "rope-gqa-4l", "--lengths", "32,64", "--no-progress"],
    "circuit": ["circuit", "attn-only-2l", "--task", "induction", "--prompts", "4", "--method", "eap", "--no-progress"],
    "extrapolate": ["extrapolate", "rope-gqa-4l", "--lengths", "256,320", "--scalings", "none,yarn", "--depths", "0.5",
                    "--buckets", "2", "--no-progress"],
    "sinks": ["sinks", "rope-gqa-4l", "--n-seqs", "2", "--seq-len", "32", "--interventions", "massive_dims,early_mlp",
              "--mlp-layers", "0", "--no-progress"],
    "sweep": ["analyze", "attn-only-2l", "--analyses", "sinks", "--n-seqs", "2", "--seq-len", "32", "--no-progress",
              "--no-report"],
}


# the study each command writes (its settings.json "study")
STUDY = {"precision": "kv-precision", "passkey": "kv-policies", "select": "kv-roles", "lengths": "lengths",
         "circuit": "circuit", "extrapolate": "extrapolate", "sinks": "sinks",
         "sweep": "sweep"}


def every_study() -> list[type[Study]]:
    """Every `Study` subclass interp defines: each module under `interp.analyses` imported (pkgutil), then the
    subclasses of `Study` walked, at any depth."""
    for module in pkgutil.walk_packages(interp.analyses.__path__, "interp.analyses."):
        importlib.import_module(module.name)

    def below(cls):
        for sub in cls.__subclasses__():
            yield sub
            yield from below(sub)

    return sorted({c for c in below(Study) if c.__module__.startswith("interp.analyses.")}, key=lambda c: c.name)


STUDIES = every_study()


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """Every study (and the sweep) run once, on the zoo, by today's spelling."""
    root = tmp_path_factory.mktemp("studies")
    for name, argv in COMMANDS.items():
        assert cli([*argv, "--out", str(root / name)]) == 0, name
    return root


def test_every_studys_settings_json_has_the_same_keys(folders):
    for name in COMMANDS:
        record = json.loads((folders / name / "settings.json").read_text())
        assert set(SHARED_KEYS) <= set(record), (name, set(SHARED_KEYS) - set(record))
        assert record["study"] == STUDY[name]
        assert record["compute"]["device"] == "cpu" and "torch" in record["versions"]
        assert all(isinstance(v, float) for v in record["seconds"].values()) and record["seconds"], name


def test_every_study_is_found_and_has_a_command_here():
    names = [c.name for c in STUDIES]
    assert {"kv-precision", "kv-policies", "kv-roles", "lengths", "circuit", "extrapolate"} <= set(names)  # found
    assert len(names) == len(set(names)), names  # settings.json names one study
    missing = sorted(set(names) - set(STUDY.values()))
    assert not missing, f"add a command for each study to COMMANDS and STUDY: {missing}"


@pytest.mark.parametrize("study", STUDIES, ids=lambda c: c.name)
def test_every_study_writes_its_declared_tables_settings_and_report(study, folders):
    """The contract, for every `Study` subclass found: its own measure and report, declared tables with distinct
    names, each written with its columns (an optional one may be absent) and nothing undeclared; settings.json
    with the shared keys; the report under its title."""
    assert study.measure is not Study.measure and study.sections is not Study.sections, study
    declared = [t.name for t in study.tables]
    assert declared and len(declared) == len(set(declared)), declared
    commands = [key for key, name in STUDY.items() if name == study.name]
    assert commands, f"study {study.name} has no command in COMMANDS and STUDY"
    folder = folders / commands[0]
    record = json.loads((folder / "settings.json").read_text())
    assert record["study"] == study.name and set(SHARED_KEYS) <= set(record)
    for table in study.tables:
        if table.optional and not list(folder.glob(f"{table.name}.*")):
            continue
        frame = read_table(folder, table.name)
        assert set(table.columns) <= set(frame.columns), (table.name, set(table.columns) - set(frame.columns))
    written = {p.stem for p in folder.glob("*.parquet")} | {p.stem for p in folder.glob("*.csv")}
    assert written <= set(declared), written - set(declared)
    assert (folder / "report.md").read_text().startswith(f"# {study.title}: ") and (folder / "report.html").is_file()


def test_the_tables_are_the_declared_ones(folders):
    assert set(read_table(folders / "passkey", "kv_policies")["policy"]) == {"full", "streaming(4,32)"}
    assert {"retrieval", "random"} <= set(read_table(folders / "select", "kv_policies")["selection"])
    assert sorted(read_table(folders / "lengths", "lengths")["length"].unique()) == [32, 64]
    assert (folders / "lengths" / "lengths.csv").is_file()  # the lengths table: a .csv beside the parquet, as before


def test_another_studys_folder_is_refused_in_one_line_before_loading(folders, tmp_path, capsys, monkeypatch):
    import interp

    monkeypatch.setattr(interp, "load", lambda *a, **k: pytest.fail("the model must not load"))
    assert cli([*COMMANDS["precision"], "--out", str(folders / "passkey")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "holds the results of the kv-policies study" in err and "--force" in err
    assert cli([*COMMANDS["precision"], "--out", str(folders / "sweep")]) == 2
    assert "holds a sweep's results" in capsys.readouterr().err


def test_force_replaces_another_studys_results(tmp_path):
    out = tmp_path / "out"
    assert cli([*COMMANDS["passkey"], "--out", str(out)]) == 0
    assert cli([*COMMANDS["precision"], "--out", str(out), "--force"]) == 0
    assert not (out / "kv_policies.parquet").exists() and (out / "kv.parquet").is_file()
    assert json.loads((out / "settings.json").read_text())["study"] == "kv-precision"


def test_passkey_without_pyarrow_writes_csv_tables(tmp_path, monkeypatch):
    """It used to fail after the whole study had run (`to_parquet` called directly)."""
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    out = tmp_path / "out"
    assert cli([*COMMANDS["passkey"], "--out", str(out)]) == 0
    monkeypatch.undo()  # (this pandas reads strings from CSV with pyarrow when it can)
    assert sorted(p.name for p in out.glob("*.csv")) == ["kv_passkey_answers.csv", "kv_policies.csv"]
    assert not list(out.glob("*.parquet")) and len(pd.read_csv(out / "kv_policies.csv")) == 2


# ---- defaults that fit the model -----------------------------------------------------------------------------
def test_default_lengths_fit_the_model_in_one_note(tmp_path, capsys):
    assert cli(["kv", "passkey", "attn-only-2l", "--policies", "full", "--depths", "0.5", "--prompts", "1",
                "--out", str(tmp_path / "p"), "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert ("note: --lengths 1024,2048 (the default) does not fit this model's context (n_ctx=256): --lengths 248 used"
            in out)
    assert "note: --seq-len 2048 (the default) does not fit this model's context (n_ctx=256): --seq-len 256 used" in out
    settings = json.loads((tmp_path / "p" / "settings.json").read_text())
    assert settings["lengths"] == [248] and settings["perplexity_tokens"] == 256


def test_sweep_defaults_fit_a_hugging_face_neox_of_128_tokens(tmp_path, capsys):
    """`interp sweep` on a Hugging Face NeoX with n_ctx 128 used to fail with its own defaults."""
    transformers = pytest.importorskip("transformers")
    import torch

    torch.manual_seed(0)
    config = transformers.GPTNeoXConfig(vocab_size=37, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                                        intermediate_size=32, max_position_embeddings=128)
    transformers.GPTNeoXForCausalLM(config).eval().save_pretrained(tmp_path / "neox")
    base = ["sweep", str(tmp_path / "neox"), "--analyses", "loss,previous_token", "--data", "repeated_random",
            "--n-seqs", "2", "--no-progress", "--no-report"]
    assert cli([*base, "--out", str(tmp_path / "out")]) == 0, capsys.readouterr().err
    assert "--seq-len 256 (the default) does not fit this model's context (n_ctx=128): --seq-len 128 used" in (
        capsys.readouterr().out)
    assert json.loads((tmp_path / "out" / "settings.json").read_text())["data"]["seq_len"] == 128
    assert cli([*base, "--out", str(tmp_path / "asked"), "--seq-len", "256"]) == 2  # asked for: still refused
    assert "pass --extrapolate" in capsys.readouterr().err and not (tmp_path / "asked").exists()


# ---- the old spellings, for one release -------------------------------------------------------------------------
@pytest.mark.parametrize("old, new", [
    (["kv", "attn-only-2l", "--seq-len", "96"], "`interp kv MODEL` is now `interp kv precision MODEL`"),
    (["kv", "attn-only-2l", "--task", "needle", "--lengths", "248"],
     "`interp kv MODEL --task needle` is now `interp kv passkey MODEL --needle`"),
    (["kv", "attn-only-2l", "--task", "passkey", "--select", "retrieval", "--sinks", "2"],
     "`interp kv MODEL --task passkey --select R` is now `interp kv select MODEL --rankings R`"),
    (["analyze", "rope-gqa-4l", "--lengths", "64,128", "--no-report"],
     "`interp analyze MODEL --lengths L` is now `interp lengths MODEL --lengths L`"),
])
def test_the_old_spellings_run_today_s_command_with_one_note(old, new, tmp_path, capsys, monkeypatch):
    import interp

    monkeypatch.setattr(interp, "load", lambda *a, **k: pytest.fail("stopped before loading"))
    out = tmp_path / "out"
    out.mkdir()
    (out / "mine.txt").write_text("a user's file: refused, so the command stops before loading")
    assert cli([*old, "--out", str(out)]) == 2
    captured = capsys.readouterr()
    notes = [line for line in captured.out.splitlines() if line.startswith("note:")]
    assert len(notes) == 1 and new in notes[0] and "goes in the next release" in notes[0], captured.out
    assert "already holds files interp did not write" in captured.err and captured.err.count("\n") == 1


def test_an_old_option_the_new_command_does_not_take_is_dropped_and_said(capsys):
    from interp.commands.legacy import rewrite

    argv, note = rewrite(["kv", "m", "--task", "passkey", "--precisions", "int4", "--out", "o", "--no-progress"])
    assert argv == ["kv", "passkey", "m", "--out", "o", "--no-progress"] and "--precisions ignored, as before" in note
    argv, _ = rewrite(["kv", "m", "--task", "passkey", "--select", "loss,random", "--policies", "full", "--out", "o"])
    assert argv == ["kv", "select", "m", "--rankings", "loss,random", "--out", "o"]
    assert rewrite(["kv", "passkey", "m", "--out", "o"]) is None and rewrite(["analyze", "m", "--out", "o"]) is None


# ---- options per command -----------------------------------------------------------------------------------------
SHARED_GROUPS = ("output and machine (every study)", "retrieval prompts (kv passkey and kv select)")


def options(parser: argparse.ArgumentParser) -> tuple[list[str], list[str]]:
    """(the options of the study's own groups, every option), -h left out."""
    own, every = [], []
    for group in parser._action_groups:
        for action in group._group_actions:
            if action.option_strings and "-h" not in action.option_strings:
                every.append(action.option_strings[-1])
                if group.title not in SHARED_GROUPS and not group.title.startswith("data ("):
                    own.append(action.option_strings[-1])
    return own, every


def test_each_kv_subcommand_takes_at_most_12_options_of_its_own():
    kv = build_parser()._subparsers._group_actions[0].choices["kv"]
    subs = kv._subparsers._group_actions[0].choices
    assert sorted(subs) == ["passkey", "precision", "select"]
    counts = {name: options(p) for name, p in subs.items()}
    for name, (own, every) in counts.items():
        assert len(own) <= 12, (name, own)
    assert counts["precision"][0] == ["--precisions", "--seeds", "--sensitivity-tokens"]
    assert counts["passkey"][0] == ["--policies"]
    # select: + --loss-tokens; precision's every option: + --rope-scaling, --offload and --device-map (every study's,
    # in the shared group)
    assert len(counts["select"][0]) == 9 and len(counts["precision"][1]) == 14
