"""Hostile and careless input around a sweep's output (issue 24): `--out` pointed at a folder the user
cares about, at a file or a read-only folder, two sweeps into one folder, damaged files, checkpoints
whose numbers are NaN, and run names that are markup. Only interp's own files are ever written or
removed, NaN is an error and never a finding, and no name is read as HTML or Markdown."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from sweep_fixtures import CFG, make_run, settings

import interp
from interp.analyses.atlas import registry
from interp.analyses.store import LOCK, MANIFEST, NonFiniteResult, OutputError, OutputFolder, ResultStore
from interp.analyses.atlas.sweep import sweep
from interp.analyses.data import DataSpec, build_tokens
from interp.cli import main as cli

DATA = ["--data", "repeated_random", "--n-seqs", "2", "--seq-len", "16", "--no-progress"]
QUIET = dict(progress=False, report=False, log=lambda *_: None)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    return make_run(tmp_path_factory.mktemp("runs"), steps=(0, 50))


def _analyze(run_dir, out, *extra) -> list[str]:
    return ["analyze", str(run_dir), "--out", str(out), "--analyses", "loss,previous_token", *DATA, *extra]


def _snapshot(folder: Path) -> dict:
    """Every file under `folder` and its bytes."""
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def _one_line_error(capsys, *needles) -> str:
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and "Traceback" not in err, err
    for needle in needles:
        assert needle in err, err
    return err


# ---- only our own files ------------------------------------------------------------------------
def test_a_folder_interp_did_not_create_is_refused_even_with_force(run_dir, tmp_path, capsys):
    """The user's figures/, parts/ and results.csv were deleted by --force, and results.csv overwritten
    without it; now the folder is refused in one line and every byte stays."""
    mine = tmp_path / "mine"
    for name, text in (("results.csv", "my,own\n1,2\n"), ("figures/plot.png", "png"), ("parts/notes.json", "{}"),
                       ("settings.json", '{"lr": 0.1}'), ("paper.tex", "\\section{}")):
        (mine / name).parent.mkdir(parents=True, exist_ok=True)
        (mine / name).write_text(text)
    before = _snapshot(mine)
    for extra in ((), ("--force",)):
        assert cli(_analyze(run_dir, mine, *extra)) == 2
        _one_line_error(capsys, str(mine), "did not write", "pick another --out folder")
        assert _snapshot(mine) == before


def test_force_discards_only_the_files_interp_wrote(run_dir, tmp_path):
    out = tmp_path / "out"
    assert cli(_analyze(run_dir, out)) == 0
    listed = json.loads((out / MANIFEST).read_text())["paths"]
    assert {"settings.json", "results.csv", "report.html", "parts/"} <= set(listed)
    assert (out / "figures").is_dir() and "figures/" in listed
    # the user keeps notes beside the results and drops a figure of their own into interp's figures/
    (out / "notes.txt").write_text("mine")
    (out / "figures" / "mine.png").write_text("mine")
    ours = out / "results.csv"
    ours.write_text("stale")
    assert cli(_analyze(run_dir, out, "--force", "--no-report")) == 0
    assert (out / "notes.txt").read_text() == "mine" and (out / "figures" / "mine.png").read_text() == "mine"
    assert ours.read_text() != "stale" and not (out / "report.html").exists()  # interp's own: discarded, rewritten
    assert not [p for p in (out / "figures").iterdir() if p.name != "mine.png"]


def test_a_sweep_folder_from_before_manifests_is_resumed_and_adopted(run_dir, tmp_path):
    """A folder with interp's settings.json and parts/ but no manifest (earlier versions) resumes; only
    files of interp's layout are adopted, so --force still keeps the user's."""
    out = tmp_path / "old"
    sweep([str(run_dir)], out, settings(["loss"]), **QUIET)
    (out / MANIFEST).unlink()
    (out / LOCK).unlink()
    (out / "figures").mkdir()
    (out / "figures" / "mine.png").write_text("mine")
    (out / "parts" / "mine.txt").write_text("mine")
    again = sweep([str(run_dir)], out, settings(["loss"]), **QUIET)
    assert again.n_run == 0 and again.n_skipped == 2  # resumed: nothing recomputed
    listed = set(json.loads((out / MANIFEST).read_text())["paths"])
    assert "parts/run/step0/loss.json" in listed and "settings.json" in listed
    assert "figures/mine.png" not in listed and "parts/mine.txt" not in listed
    sweep([str(run_dir)], out, settings(["loss"]), force=True, **QUIET)
    assert (out / "figures" / "mine.png").read_text() == "mine" and (out / "parts" / "mine.txt").read_text() == "mine"


def test_a_user_file_named_like_ours_is_not_overwritten(run_dir, tmp_path, capsys):
    """In a folder interp created, a file it did not write (a report of the user's own) is refused up front."""
    out = tmp_path / "out"
    sweep([str(run_dir)], out, settings(["loss"]), **QUIET)
    (out / "report.md").write_text("my own report")
    assert cli(_analyze(run_dir, out)) == 2
    _one_line_error(capsys, "report.md", "not written by interp")
    assert (out / "report.md").read_text() == "my own report"


def test_damaged_files_are_named_in_one_line(run_dir, tmp_path, capsys):
    out = tmp_path / "out"
    assert cli(_analyze(run_dir, out, "--no-report")) == 0
    settings_json = out / "settings.json"
    good = settings_json.read_text()
    settings_json.write_text("")
    assert cli(_analyze(run_dir, out)) == 2
    _one_line_error(capsys, str(settings_json), "--force")
    settings_json.write_text(good)

    part = next((out / "parts").glob("*/*/loss.json"))
    part.write_text('{"run": ')
    assert cli(_analyze(run_dir, out)) == 2
    _one_line_error(capsys, str(part))
    part.unlink()
    assert cli(_analyze(run_dir, out, "--no-report")) == 0  # recomputed

    (out / "results.parquet").write_bytes(b"PAR1 not really")
    assert cli(["report", str(out)]) == 2
    _one_line_error(capsys, str(out / "results.parquet"))


# ---- nothing outside --out (issue 56, S1 and S2) -------------------------------------------------
CIRCUIT = ["circuit", "attn-only-2l", "--task", "induction", "--prompts", "4"]


def _manifest(folder: Path, *paths: str) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / MANIFEST).write_text(json.dumps({"written_by": "interp", "paths": list(paths)}))


def test_a_manifest_listing_paths_outside_the_folder_deletes_nothing(run_dir, tmp_path, capsys):
    """S1: a shared results folder whose manifest lists `../victim.txt` or an absolute path made every study
    command (and `sweep --force`) delete them and exit 0. Now the entry is named in one line and every
    file, inside and outside, stays."""
    victim, far = tmp_path / "victim.txt", tmp_path / "elsewhere" / "thesis.tex"
    far.parent.mkdir()
    victim.write_text("precious")
    far.write_text("\\section{}")
    shared = tmp_path / "shared"
    for entry in ("../victim.txt", str(far), "parts/../../victim.txt"):
        _manifest(shared, "settings.json", entry)
        before = _snapshot(tmp_path)
        for argv in ([*CIRCUIT, "--out", str(shared)], [*CIRCUIT, "--out", str(shared), "--force"],
                     ["sweep", str(run_dir), "--out", str(shared), "--force", "--analyses", "loss", *DATA]):
            assert cli(argv) == 2
            _one_line_error(capsys, f"lists {entry!r}", "outside", "touched nothing")
            assert _snapshot(tmp_path) == before


def test_a_link_out_of_the_folder_is_never_followed(run_dir, tmp_path, capsys):
    """S1, through a link: interp's own `figures/` replaced by a link to another folder, or a link standing
    where interp writes its temporary file. Neither is removed, written through, nor followed."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "loss.png").write_text("theirs")
    out = tmp_path / "out"
    _manifest(out, "figures/", "figures/loss.png")
    (out / "figures").symlink_to(outside)
    before = _snapshot(tmp_path)
    for argv in ([*CIRCUIT, "--out", str(out), "--force"], _analyze(run_dir, out, "--force")):
        assert cli(argv) == 2
        _one_line_error(capsys, "'figures/'", "outside", "symbolic link")
        assert _snapshot(tmp_path) == before

    # a folder interp did write into, and a link planted under the temporary name of its next write
    fresh = tmp_path / "fresh"
    folder = OutputFolder(fresh)
    with folder.writing():
        folder.write_text("notes.md", "ours")
    target = tmp_path / "victim.txt"
    target.write_text("precious")
    (fresh / f".notes.md.{os.getpid()}.tmp").symlink_to(target)
    with pytest.raises(OutputError, match="symbolic link where interp writes a temporary file"):
        with folder.writing():
            folder.write_text("notes.md", "again")
    assert target.read_text() == "precious" and (fresh / "notes.md").read_text() == "ours"

    # a new path whose folder is a link out of --out is refused before it is written
    (fresh / "parts").symlink_to(outside)
    with pytest.raises(OutputError, match="outside"):
        with folder.writing():
            folder.write_text("parts/new.json", "{}")
    assert sorted(p.name for p in outside.iterdir()) == ["loss.png"]


@pytest.mark.parametrize("own", [LOCK, MANIFEST])
def test_a_lock_or_manifest_that_is_a_link_is_refused(run_dir, tmp_path, capsys, own):
    """S2: a folder whose only entry was a link named `.interp-lock` counted as empty, and interp wrote its
    process id through the link, over the target. Now a lock or manifest that is a link is one line."""
    target = tmp_path / "victim.txt"
    target.write_text('{"written_by": "interp", "paths": []}')  # what a manifest link would read, too
    out = tmp_path / "out"
    out.mkdir()
    (out / own).symlink_to(target)
    before = _snapshot(tmp_path)
    for argv in ([*CIRCUIT, "--out", str(out)], _analyze(run_dir, out), _analyze(run_dir, out, "--force")):
        assert cli(argv) == 2
        _one_line_error(capsys, str(out / own), "symbolic link", "touched nothing")
        assert _snapshot(tmp_path) == before and (out / own).is_symlink()
    if own == LOCK:
        with pytest.raises(OutputError, match="symbolic link"):  # the lock taken directly, as a sweep's report does
            with OutputFolder(out).lock():
                pass
    assert target.read_text() == before["victim.txt"].decode()


# ---- one sweep at a time -----------------------------------------------------------------------
def test_a_second_sweep_into_the_same_folder_is_refused_and_a_killed_one_leaves_no_lock(run_dir, tmp_path, capsys):
    out = tmp_path / "out"
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time\nfrom interp.analyses.store import OutputFolder\n"
         f"with OutputFolder({str(out)!r}).writing():\n    print('held', flush=True)\n    time.sleep(120)"],
        stdout=subprocess.PIPE, text=True, cwd=tmp_path)
    try:
        assert holder.stdout.readline().strip() == "held"
        assert cli(_analyze(run_dir, out)) == 2
        _one_line_error(capsys, f"another sweep (pid {holder.pid}) is writing to {out}")
        assert not (out / "parts").exists() and not (out / "settings.json").exists()
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    assert cli(_analyze(run_dir, out, "--no-report")) == 0  # the OS released the dead process's lock


# ---- --out that cannot be written --------------------------------------------------------------
def test_out_that_is_a_file_is_refused_in_one_line(run_dir, tmp_path, capsys):
    f = tmp_path / "results.txt"
    f.write_text("keep me")
    for out in (f, f / "sub"):
        assert cli(_analyze(run_dir, out)) == 2
        _one_line_error(capsys, "is a file, not a folder")
    assert f.read_text() == "keep me" and sorted(os.listdir(tmp_path)) == ["results.txt"]


def test_out_in_a_read_only_folder_is_refused_in_one_line(run_dir, tmp_path, capsys, monkeypatch):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o555)
    try:
        if os.access(locked, os.W_OK):  # root writes through file modes: show it the folder as a user sees it
            real = os.access
            monkeypatch.setattr(os, "access", lambda p, mode, **kw: False if Path(p) == locked and mode & os.W_OK
                                else real(p, mode, **kw))
        for out in (locked, locked / "new"):
            assert cli(_analyze(run_dir, out)) == 2
            _one_line_error(capsys, f"cannot write to {locked}")
            assert os.listdir(locked) == []
    finally:
        locked.chmod(0o755)


# ---- NaN is an error, never a finding -----------------------------------------------------------
def _nan_model() -> interp.HookedTransformer:
    model = interp.HookedTransformer(CFG, seed=1)
    with torch.no_grad():
        model.blocks[0].attn.W_Q[0, 0, 0] = float("nan")
    return model


def test_no_analysis_turns_nan_weights_into_finite_numbers():
    """NaN in one head's W_Q: every analysis either raises NonFiniteResult or returns rows that hold NaN
    (which the sweep refuses). None may rank around the NaN head (composition) or draw it as zeros (viewer)."""
    model = _nan_model()
    data = DataSpec(kind="repeated_random", n_seqs=2, seq_len=16, seed=0)
    ctx = registry.Context(model=model, tokens=build_tokens(data, model), data=data)
    quiet = []
    for name, analysis in registry.ANALYSES.items():
        try:
            rows = analysis.run(ctx)
        except NonFiniteResult as e:
            assert "L0H0" in str(e), (name, str(e))
            continue
        if np.isfinite(rows["value"].to_numpy(dtype=float, na_value=np.nan)).all():
            quiet.append(name)
    assert quiet == []


def test_non_finite_rows_are_an_error_naming_checkpoint_analysis_and_rows(run_dir, tmp_path, monkeypatch):
    real = registry.ANALYSES["previous_token"].run

    def nan_at_step50(ctx):
        rows = real(ctx)
        if ctx.checkpoint.name == "step50":
            rows.loc[(rows["layer"] == 1) & (rows["head"] == 2), "value"] = float("nan")
            rows.loc[(rows["layer"] == 0) & (rows["head"] == 1), "value"] = float("inf")
        return rows

    monkeypatch.setitem(registry.ANALYSES, "previous_token",
                        dataclasses.replace(registry.ANALYSES["previous_token"], run=nan_at_step50))
    result = sweep([str(run_dir)], tmp_path / "out", settings(["previous_token", "loss"]), **QUIET)
    [error] = result.errors
    assert (error["checkpoint"], error["analysis"], error["error"]) == ("step50", "previous_token", "NonFiniteResult")
    for needle in ("run/step50", "previous_token", "L1H2 previous_token=nan", "L0H1 previous_token=inf"):
        assert needle in error["message"]
    t = result.table
    assert set(t.loc[t.checkpoint == "step50", "analysis"]) == {"loss"}  # nothing of it stored
    assert np.isfinite(t["value"]).all()
    assert json.loads((tmp_path / "out" / "errors.json").read_text())[0]["error"] == "NonFiniteResult"


@pytest.mark.parametrize("weight", [float("nan"), 3e38], ids=["nan-weight", "overflowing-weight"])
def test_a_checkpoint_with_nan_weights_is_failed_and_the_headline_is_finite(tmp_path, capsys, weight):
    """One checkpoint of four is broken: a NaN weight (refused when loaded) or finite weights so large
    that the forward overflows to inf and NaN (which only the results show). It is listed as failed, the
    others are analysed, and the headline and report are made from finite numbers only; exit status 1."""
    from safetensors.torch import load_file, save_file

    run = make_run(tmp_path, steps=(0, 50, 100, 150))
    weights = run / "step100" / "model.safetensors"
    tensors = load_file(weights)
    tensors["blocks.0.attn.W_qkv"][:, :8] = weight  # one head's query weights
    save_file(tensors, weights)
    out = tmp_path / "out"
    assert cli(["sweep", str(run), "--out", str(out), "--analyses", "induction,previous_token,loss", *DATA]) == 1
    errors = json.loads((out / "errors.json").read_text())
    assert errors and {e["checkpoint"] for e in errors} == {"step100"}
    table = pd.read_csv(out / "results.csv")
    assert sorted(table["checkpoint"].unique()) == ["step0", "step150", "step50"]
    assert np.isfinite(table["value"]).all()
    capsys.readouterr()
    assert cli(["report", str(out), "--headline"]) == 0
    line = capsys.readouterr().out
    assert "best heads" in line and not re.search(r"\b(nan|inf)\b", line, re.I), line
    md = (out / "report.md").read_text()
    assert "step100" in md.split("## Errors")[1].split("\n## ")[0]
    outside_errors = re.sub(r"## Errors.*?\n(?=## )", "", md, flags=re.S)  # error messages may say "NaN or inf"
    assert not re.search(r"\b(nan|inf)\b", outside_errors, re.I)


def test_undefined_metrics_are_left_out_not_nan(tmp_path):
    """Composition of a one-layer model (no pair of layers) and the attribution correlation over one head
    are undefined: no row, no error, and their report sections say so."""
    one = interp.ModelConfig(n_layers=1, d_model=8, n_heads=1, d_vocab=29, n_ctx=64, d_mlp=None)
    run = make_run(tmp_path, steps=(0,), cfg=one, name="one")
    result = sweep([str(run)], tmp_path / "out", settings(["composition", "importance"]), progress=False,
                   log=lambda *_: None)
    assert result.errors == [] and np.isfinite(result.table["value"]).all()
    assert not result.table["metric"].str.startswith(("composition_mean", "attribution_")).any()
    md = (tmp_path / "out" / "report.md").read_text()
    assert "nothing to compose" in md and "undefined here" in md


def test_nan_written_by_an_earlier_version_is_recomputed_and_never_reported(run_dir, tmp_path, capsys):
    """Earlier versions stored NaN (as null): such a part is listed as an error, left out of the table and
    the headline, and recomputed by the next sweep."""
    out = tmp_path / "out"
    sweep([str(run_dir)], out, settings(["induction"]), **QUIET)
    part = out / "parts" / "run" / "step50" / "induction.json"
    record = json.loads(part.read_text())
    icl = record["rows"]["metric"].index("icl_score")
    record["rows"]["value"][icl] = None
    part.write_text(json.dumps(record))
    ResultStore(out).merge()
    capsys.readouterr()
    assert cli(["report", str(out), "--headline"]) == 0
    line = capsys.readouterr().out
    assert "ICL score" in line and "at step 0" in line and "nan" not in line, line
    assert [e["error"] for e in ResultStore(out).errors()] == ["NonFiniteResult"]
    again = sweep([str(run_dir)], out, settings(["induction"]), **QUIET)
    assert again.n_run == 1 and again.errors == [] and np.isfinite(again.table["value"]).all()


# ---- names are never markup ----------------------------------------------------------------------
def test_a_run_named_like_markup_cannot_break_out_of_the_viewer_script(tmp_path):
    """A run named `r<!--<script>` used to swallow the viewer's code (the inline JSON escaped `</` only)."""
    name = "r<!--<script>"
    run = make_run(tmp_path, steps=(0,), name=name)
    out = tmp_path / "out"
    sweep([str(run)], out, settings(["previous_token", "viewer"]), progress=False, log=lambda *_: None)
    page = (out / "report.html").read_text()
    blocks = re.findall(r'<script type="application/json" class="data">(.*?)</script>', page, re.S)
    assert len(blocks) == 1
    data = blocks[0]
    for bad in ("<!--", "<script", "</", "<", ">", "&"):
        assert bad not in data
    payload = json.loads(data)
    assert payload["run"] == name
    grid = next(iter(payload["scores"].values()))
    assert len(grid) == CFG.n_layers and all(len(row) == CFG.n_heads for row in grid)  # the grid's cells
    assert "r&lt;!--&lt;script&gt;" in page and name not in page.replace(data, "")
    md = re.sub(r"\n```.*?\n```\n", "\n", (out / "report.md").read_text(), flags=re.S)  # code is literal
    assert "r\\<\\!--\\<script\\>" in md and not re.search(r"(?<!\\)[<>]", md)  # names escaped, no raw tag


def test_tables_never_print_nan_or_inf_and_escape_their_cells():
    from interp.analyses.document import Section, md_table, render_html

    frame = pd.DataFrame({"checkpoint": ["a|b", "<b>x</b>"], "loss": [float("inf"), float("nan")], "ok": [1.5, 2.0]})
    md = md_table(frame)
    page = render_html("t", [Section("s", "S").add(frame)])
    for text in (md, page):
        assert not re.search(r"\b(nan|inf)\b", text, re.I), text
    assert "a\\|b" in md and "\\<b\\>x\\</b\\>" in md and "<b>x" not in page
