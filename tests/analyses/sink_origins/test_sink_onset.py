"""`interp sinks RUN --over-checkpoints` as a study of its own (issue 65: security 1 and defect 7).

Before, it wrote onset.csv, onset_steps.csv and onset.png straight into --out: through a link (overwriting what it
pointed at), over a user's own onset.csv, and into another study's folder, unlisted; and it ignored --seq-len,
--text-file (even a missing one), --rope-scaling and --offload, always read the zoo's byte text whatever the run's
tokenizer, and stopped at the first bad checkpoint. Now it goes through the one output folder, honours or refuses
every option in one line, and skips (and names) a checkpoint it cannot read, as a sweep does."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pandas as pd
import pytest
import torch

import interp
from interp.analyses.sink_origins.onset import checkpoint_row
from interp.analyses.store import MANIFEST
from interp.cli import main as cli
from interp.models.formats.tokenizer import ByteTokenizer
from interp.models.zoo.training import eval_windows

CFG = interp.ModelConfig(n_layers=2, d_model=32, n_heads=4, d_vocab=257, n_ctx=48, d_mlp=64, positional="rotary")
STEPS = (0, 10, 20)
QUICK = ["--n-seqs", "2", "--seq-len", "24", "--no-progress"]


def _run(root: Path, tokenizer=True, name="run") -> Path:
    run = root / name
    for step in STEPS:
        model = interp.HookedTransformer(CFG, seed=100 + step, tokenizer=ByteTokenizer() if tokenizer else None)
        interp.save_model(model, run / f"step_{step:05d}", meta={"step": step})
    return run


@pytest.fixture(scope="module")
def byte_run(tmp_path_factory):
    return _run(tmp_path_factory.mktemp("onset"))


def _listed(out: Path) -> set[str]:
    return set(json.loads((out / MANIFEST).read_text())["paths"])


def _error(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and "Traceback" not in err, err
    return err


def test_the_onset_equals_each_checkpoints_row_and_every_file_is_the_folders(byte_run, tmp_path):
    out = tmp_path / "out"
    assert cli(["sinks", str(byte_run), "--over-checkpoints", "--out", str(out), *QUICK]) == 0
    got = pd.read_csv(out / "onset.csv")
    assert got["step"].tolist() == list(STEPS)
    # the oracle: each checkpoint loaded on its own, on the zoo's held-out windows (seed 1) the study reads
    from interp.analyses.evaldata import heldout_docs

    tokens = eval_windows(heldout_docs(), 24, 2, seed=1)
    for step, row in zip(STEPS, got.itertuples()):
        want = checkpoint_row(interp.load(str(byte_run / f"step_{step:05d}")).eval(), tokens)
        for key, value in want.items():
            assert getattr(row, key) == pytest.approx(value, rel=1e-5, abs=1e-6), (step, key)
    files = {p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file()} - {MANIFEST, ".interp-lock"}
    assert files and files <= _listed(out), files - _listed(out)
    record = json.loads((out / "settings.json").read_text())
    assert record["study"] == "sink-onset" and record["seq_len"] == 24 and record["n_sequences"] == 2
    assert record["data_source"] is not None  # the held-out text, named by sha256


def test_a_link_in_out_is_never_written_through(byte_run, tmp_path, capsys):
    notes = tmp_path / "notes.txt"
    notes.write_text("mine\n")
    out = tmp_path / "out"
    out.mkdir()
    (out / "onset_steps.csv").symlink_to(notes)
    assert cli(["sinks", str(byte_run), "--over-checkpoints", "--out", str(out), *QUICK]) == 2
    assert "did not write" in _error(capsys)
    assert notes.read_text() == "mine\n" and sorted(p.name for p in out.iterdir()) == ["onset_steps.csv"]


def test_a_users_own_onset_csv_is_never_overwritten(byte_run, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "onset.csv").write_text("my,own\n")
    for extra in ([], ["--force"]):
        assert cli(["sinks", str(byte_run), "--over-checkpoints", "--out", str(out), *QUICK, *extra]) == 2
        _error(capsys)
    assert (out / "onset.csv").read_text() == "my,own\n"


def test_another_studys_folder_is_refused_and_force_replaces_only_what_interp_wrote(byte_run, tmp_path, capsys):
    out = tmp_path / "out"
    last = str(byte_run / "step_00020")
    assert cli(["sinks", last, "--out", str(out), "--interventions", "early_mlp", "--mlp-layers", "0", *QUICK]) == 0
    before = _listed(out)
    assert cli(["sinks", str(byte_run), "--over-checkpoints", "--out", str(out), *QUICK]) == 2
    assert "sinks study" in _error(capsys) and _listed(out) == before
    assert cli(["sinks", str(byte_run), "--over-checkpoints", "--out", str(out), *QUICK, "--force"]) == 0
    assert json.loads((out / "settings.json").read_text())["study"] == "sink-onset"
    assert not (out / "heads.csv").exists()


@pytest.mark.parametrize("flags, needle", [
    (["--interventions", "early_mlp"], "--interventions"),
    (["--mlp-layers", "0"], "--mlp-layers"),
    (["--top-k", "2"], "--top-k"),
    (["--text-file", "/no/such/text.txt"], "/no/such/text.txt"),
    (["--seq-len", "4096"], "--seq-len 4096"),
    (["--rope-scaling", "linear:0"], "factor"),
])
def test_every_option_is_honoured_or_refused_in_one_line(byte_run, tmp_path, capsys, flags, needle):
    out = tmp_path / "out"
    assert cli(["sinks", str(byte_run), "--over-checkpoints", "--out", str(out), "--no-progress", *flags]) == 2
    assert needle in _error(capsys)
    assert not out.exists()


def test_text_length_rope_scaling_and_offload_are_honoured(byte_run, tmp_path):
    text = tmp_path / "mine.txt"
    text.write_text("def f(x):\n    return x + 1\n" * 40)
    plain, other = tmp_path / "plain", tmp_path / "other"
    assert cli(["sinks", str(byte_run), "--over-checkpoints", "--out", str(plain), *QUICK]) == 0
    assert cli(["sinks", str(byte_run), "--over-checkpoints", "--out", str(other), "--n-seqs", "2", "--seq-len", "32",
                "--text-file", str(text), "--rope-scaling", "linear:2", "--offload", "disk", "--no-progress"]) == 0
    record = json.loads((other / "settings.json").read_text())
    assert record["seq_len"] == 32 and str(text) in json.dumps(record["data_source"])
    assert record["rope_scaling"]["rope_type"] == "linear" and record["rope_scaling"]["factor"] == 2
    a, b = pd.read_csv(plain / "onset.csv"), pd.read_csv(other / "onset.csv")
    assert not a["loss"].equals(b["loss"])  # other text, length and scaling: other numbers


def test_a_model_without_a_tokenizer_is_refused_on_text_and_reads_token_ids(tmp_path, capsys):
    run = _run(tmp_path, tokenizer=False, name="bare")
    out = tmp_path / "out"
    assert cli(["sinks", str(run), "--over-checkpoints", "--out", str(out), *QUICK]) == 2
    assert "tokenizer" in _error(capsys)
    ids = tmp_path / "ids.pt"
    torch.save(torch.randint(0, 257, (2, 24)), ids)
    assert cli(["sinks", str(run), "--over-checkpoints", "--out", str(out), "--data-file", str(ids),
                "--no-progress"]) == 0
    assert len(pd.read_csv(out / "onset.csv")) == len(STEPS)


def test_a_checkpoint_that_cannot_be_read_is_skipped_and_named(byte_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(byte_run, run)
    (run / "step_00010" / "model.safetensors").write_bytes(b"\x00" * 10)
    out = tmp_path / "out"
    assert cli(["sinks", str(run), "--over-checkpoints", "--out", str(out), *QUICK]) == 0
    assert pd.read_csv(out / "onset.csv")["step"].tolist() == [0, 20]
    skipped = pd.read_csv(out / "skipped.csv")
    assert skipped["checkpoint"].tolist() == ["step_00010"] and "model.safetensors" in skipped["reason"][0]
    report = (out / "report.md").read_text()
    assert "1 checkpoint(s) could not be read" in report and "step\\_00010" in report
