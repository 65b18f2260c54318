"""One command per study (`interp kv precision|passkey|select`, `interp lengths`, `interp circuit`, `interp
extrapolate`, `interp features`, beside `interp analyze` and `interp sweep`): every `Study` subclass under
`interp.analyses`, found by importing each of its modules, has a command here and writes its declared tables with
their columns, its settings.json with the same keys as every study, and its report (so a new study cannot skip the
contract); a default length fitted to the model in one note (an explicit one past n_ctx still refused), the old
spellings with one deprecation note, at most 12 options of its own per `interp kv` subcommand, a study that completes
without pyarrow, and one study's folder refused to another without --force."""

from __future__ import annotations

import argparse
import importlib
import json
import pkgutil
import sys
from pathlib import Path

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
    "onset": ["sinks", "rope-gqa-4l", "--over-checkpoints", "--n-seqs", "1", "--seq-len", "32", "--no-progress"],
    "features": ["features", "attn-only-2l", "--sae", "attn-only-2l/blocks.1.attn.hook_z", "--n-seqs", "2", "--seq-len", "32", "--top-k", "2",
                 "--features", "3", "--no-progress"],
    "sweep": ["analyze", "attn-only-2l", "--analyses", "sinks", "--n-seqs", "2", "--seq-len", "32", "--no-progress",
              "--no-report"],
}


# the study each command writes (its settings.json "study")
STUDY = {"precision": "kv-precision", "passkey": "kv-policies", "select": "kv-roles", "lengths": "lengths",
         "circuit": "circuit", "extrapolate": "extrapolate", "sinks": "sinks", "onset": "sink-onset",
         "features": "features", "sweep": "sweep"}


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


# ---- every command writes through the one output folder (issue 65, security 1) ----------------------------------
def _leaves(parser, path=()):
    """(subcommand path, its parser) for every command the CLI has, kv's subcommands included."""
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not subs:
        yield path, parser
    for action in subs:
        for name, sub in action.choices.items():
            yield from _leaves(sub, (*path, name))


# what each command that writes runs here: the study commands above (their folders, `folders`), and these
OTHER_WRITERS = {
    ("train",): ["train", "attn-only-2l", "--steps", "2", "--no-progress"],
    ("bench",): ["bench", "--quick", "--sections", "forward", "--seqs", "16", "--shapes", "llama-small"],
    ("report",): ["report"],  # into a sweep's folder: `folders / "sweep"`
    ("sweep",): ["sweep", "rope-gqa-4l", "--analyses", "previous_token", "--n-seqs", "1", "--seq-len", "16",
                 "--no-progress"],
}
# the commands that write no file at all (checked in an empty working folder)
WRITES_NOTHING = {("demo",): ["demo", "--seq", "16"], ("info",): ["info", "attn-only-2l"], ("zoo",): ["zoo"],
                  ("generate",): ["generate", "attn-only-2l", "def f", "--max-new-tokens", "2"],
                  ("doctor",): ["doctor"], ("kv", "static"): ["kv", "static", "rope-gqa-4l", "--top", "3"]}


def _walked(argv) -> tuple[str, ...]:
    return tuple(argv[:2]) if argv[0] == "kv" else (argv[0],)


def test_every_command_of_the_cli_is_walked_here():
    """A new command that writes must say here how it writes, so that the tests below hold it to the folder."""
    every = {path for path, _ in _leaves(build_parser())}
    walked = {_walked(argv) for argv in COMMANDS.values()} | set(OTHER_WRITERS) | set(WRITES_NOTHING)
    assert every == walked, f"walk these commands here: {sorted(every - walked)}; gone: {sorted(walked - every)}"
    for path, parser in _leaves(build_parser()):
        takes_out = any(a.dest == "out" for a in parser._actions)
        assert takes_out == (path not in WRITES_NOTHING), path


def _outside_the_manifest(folder) -> list[str]:
    from interp.analyses.store import LOCK, MANIFEST

    listed = set(json.loads((folder / MANIFEST).read_text())["paths"])
    files = {p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file() or p.is_symlink()}
    return sorted(files - listed - {MANIFEST, LOCK})


def test_every_file_a_study_command_writes_is_listed_in_its_folder(folders, tmp_path):
    assert cli(["report", str(folders / "sweep")]) == 0  # `interp report` writes into the sweep's folder
    for name in COMMANDS:
        assert not _outside_the_manifest(folders / name), (name, _outside_the_manifest(folders / name))
    assert cli([*OTHER_WRITERS[("sweep",)], "--out", str(tmp_path / "sweep")]) == 0  # a run of two checkpoints
    assert not _outside_the_manifest(tmp_path / "sweep")


def test_train_writes_through_its_folder_and_adopts_a_run_folder_from_before_manifests(tmp_path, capsys):
    import shutil

    out = tmp_path / "run"
    assert cli([*OTHER_WRITERS[("train",)], "--out", str(out)]) == 0
    assert (out / "step_00002" / "model.safetensors").is_file() and not _outside_the_manifest(out)
    shipped = tmp_path / "shipped"  # the zoo's own run folder, written before manifests existed
    shutil.copytree(Path(interp.analyses.__file__).parents[2] / "models" / "src" / "zoo" / "attn-only-2l", shipped)
    mine = shipped / "notes.txt"
    mine.write_text("mine")
    assert cli([*OTHER_WRITERS[("train",)], "--out", str(shipped)]) == 0
    assert mine.read_text() == "mine" and not (set(_outside_the_manifest(shipped)) - {"notes.txt"})


def test_bench_writes_its_page_and_never_a_file_it_did_not_write(tmp_path, capsys):
    page = tmp_path / "bench.md"
    assert cli([*OTHER_WRITERS[("bench",)], "--out", str(page)]) == 0
    assert "Written by `interp bench`" in page.read_text()
    assert cli([*OTHER_WRITERS[("bench",)], "--out", str(page)]) == 0  # its own page: written again
    mine = tmp_path / "mine.md"
    mine.write_text("my notes")
    assert cli([*OTHER_WRITERS[("bench",)], "--out", str(mine)]) == 2
    assert "was not written by interp bench" in capsys.readouterr().err and mine.read_text() == "my notes"


def _planted(tmp_path):
    """A folder holding only a link named like a file commands write, pointing at a user's notes."""
    notes = tmp_path / "notes.txt"
    notes.write_text("mine\n")
    out = tmp_path / "out"
    out.mkdir()
    for name in ("settings.json", "onset_steps.csv", "run.json"):
        (out / name).symlink_to(notes)
    return notes, out


@pytest.mark.parametrize("argv", [*COMMANDS.values(), OTHER_WRITERS[("train",)], OTHER_WRITERS[("sweep",)]],
                         ids=lambda a: " ".join(a[:3]))
def test_no_command_writes_through_a_link_in_its_folder(argv, tmp_path, capsys, monkeypatch):
    import interp

    monkeypatch.setattr(interp, "load", lambda *a, **k: pytest.fail("refused before the model loads"))
    notes, out = _planted(tmp_path)
    assert cli([*argv, "--out", str(out)]) == 2
    assert capsys.readouterr().err.count("\n") == 1
    assert notes.read_text() == "mine\n" and sorted(p.name for p in out.iterdir()) == [
        "onset_steps.csv", "run.json", "settings.json"]


def test_bench_never_writes_through_a_link(tmp_path, capsys):
    notes = tmp_path / "notes.md"
    notes.write_text("Written by `interp bench` -- but a link to it is still refused")
    (tmp_path / "page.md").symlink_to(notes)
    assert cli([*OTHER_WRITERS[("bench",)], "--out", str(tmp_path / "page.md")]) == 2
    assert "symbolic link" in capsys.readouterr().err and notes.read_text().startswith("Written")


@pytest.mark.slow
def test_the_commands_that_write_nothing_write_nothing(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for argv in WRITES_NOTHING.values():
        assert cli(argv) == 0, argv
        assert not list(tmp_path.iterdir()), (argv, list(tmp_path.iterdir()))


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


# ---- the old spellings are gone (CHANGELOG.md: no compatibility layer before a release) -------------------------
@pytest.mark.parametrize("old, today", [
    (["kv", "attn-only-2l", "--seq-len", "96"], "interp kv precision"),
    (["kv", "attn-only-2l", "--task", "needle", "--lengths", "248"], "interp kv passkey"),
    (["analyze", "rope-gqa-4l", "--lengths", "64,128", "--no-report"], "interp lengths"),
])
def test_an_old_spelling_is_refused_and_the_changelog_gives_todays(old, today, tmp_path, capsys, monkeypatch):
    import interp

    monkeypatch.setattr(interp, "load", lambda *a, **k: pytest.fail("refused before loading"))
    with pytest.raises(SystemExit) as e:  # argparse's usage line, exit 2
        cli([*old, "--out", str(tmp_path / "out")])
    assert e.value.code == 2 and not (tmp_path / "out").exists()
    changelog = (Path(__file__).resolve().parents[2] / "CHANGELOG.md").read_text()
    assert f"| `interp {' '.join(old[:1])} MODEL" in changelog and f"`{today} MODEL" in changelog


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
    assert sorted(subs) == ["passkey", "precision", "select", "static"]
    counts = {name: options(p) for name, p in subs.items()}
    for name, (own, every) in counts.items():
        assert len(own) <= 12, (name, own)
    assert counts["precision"][0] == ["--precisions", "--seeds", "--sensitivity-tokens"]
    assert counts["passkey"][0] == ["--policies"]
    # select: + --loss-tokens, --equal-bytes; precision's every option: + --rope-scaling, --offload and --device-map (every study's,
    # in the shared group)
    assert len(counts["select"][0]) == 10 and len(counts["precision"][1]) == 14
