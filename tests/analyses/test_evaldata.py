"""The evaluation data interp ships (issue 36): pinned by sha256, read whatever Python runs, named in every
result folder; a folder never mixes rows of two data sources; a damaged install is one line.

Against what we did not write: the shipped text is CPython 3.11.7's own `pydoc_data.topics` and the held-out
files are the zoo's training Python's own sources, checked on a machine that has that Python (the corpus
hash the zoo's run.json recorded); and an analysis run in a process whose standard library and
`pydoc_data` are fakes gives the very same numbers as one run here."""

from __future__ import annotations

import gzip
import hashlib
import importlib
import json
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from interp.analyses.data import DataSpec, check_data, data_source, read_text
from interp.cli import main as cli
from interp.analyses import evaldata

ZOO_RUN = Path(importlib.import_module("interp.models.zoo").__file__).parent / "rope-gqa-4l" / "run.json"


def test_every_shipped_file_is_the_bytes_its_manifest_pins():
    entries = evaldata.manifest()
    assert set(entries) == {evaldata.LANGUAGE_REFERENCE, evaldata.HELDOUT}
    for name, e in entries.items():
        raw = gzip.decompress((evaldata.HERE / e["file"]).read_bytes())  # read here, not through the reader
        assert hashlib.sha256(raw).hexdigest() == e["sha256"] and len(raw) == e["bytes"], name
        assert "PSF" in e["licence"] and e["python"] == "3.11.7" and e["source"].startswith("CPython 3.11.7"), name
        assert (evaldata.HERE / e["file"]).stat().st_size < 400_000, name  # modest: gzip, only what is read
    assert "PYTHON SOFTWARE FOUNDATION LICENSE VERSION 2" in (evaldata.HERE / evaldata.LICENCE).read_text()
    text = evaldata.language_reference()
    assert len(text.encode()) == 466_273 and "The \"import\" statement" in text
    docs = evaldata.heldout_docs()
    assert len(docs) == 90 and sum(d.size for d in docs) == 1_514_693
    every = np.concatenate(docs)
    assert every.min() >= 0 and every.max() <= 255  # bytes (some files are empty)


def test_the_default_text_and_held_out_files_are_read_from_the_package():
    assert read_text() == evaldata.language_reference()
    assert data_source(DataSpec(kind="text"))["sha256"] == evaldata.manifest()[evaldata.LANGUAGE_REFERENCE]["sha256"]
    assert data_source(DataSpec(kind="corpus"))["sha256"] == evaldata.manifest()[evaldata.HELDOUT]["sha256"]
    assert data_source(DataSpec(kind="repeated_random")) is None


@pytest.mark.skipif(platform.python_version() != "3.11.7", reason="the shipped text is CPython 3.11.7's pydoc_data")
def test_the_shipped_text_is_cpython_3_11_7s_language_reference():
    from pydoc_data.topics import topics

    assert evaldata.language_reference() == "\n\n".join(topics[k] for k in sorted(topics))


def test_the_shipped_held_out_files_are_those_the_zoo_never_trained_on():
    from interp.models.zoo.training import load_corpus

    corpus = load_corpus()
    recorded = json.loads(ZOO_RUN.read_text())["corpus"]["sha256"]
    if corpus.sha256 != recorded:
        pytest.skip(f"this Python's standard library ({platform.python_version()}) is not the zoo's training corpus")
    shipped = evaldata.heldout_docs()
    assert len(shipped) == len(corpus.eval_docs)
    assert all((a == b).all() for a, b in zip(shipped, corpus.eval_docs))
    names = evaldata.heldout_names()
    assert names[0] == "__future__.py" and len(set(names)) == 90


# ---- whatever Python runs ----------------------------------------------------------------------------
RUNNER = """
import sys, sysconfig
fake = sys.argv[1]
if fake != "-":  # this process's standard library is elsewhere, and pydoc_data (first on sys.path) is a fake
    sysconfig.get_paths = lambda *a, **k: {"stdlib": fake, "platstdlib": fake, "purelib": fake, "platlib": fake}
    import pydoc_data.topics
    assert pydoc_data.topics.topics == {"fake": "Not the reference. " * 4000}, pydoc_data.topics.__file__
import torch
torch.set_num_threads(1)
if sys.argv[2] == "needle":  # a byte-level model with room for 3,000 tokens of haystack (its weights never run)
    import dataclasses, interp
    from interp.analyses.kv.tasks import retrieval_prompts
    from interp.models.formats.tokenizer import ByteTokenizer
    from interp.models.native.transformer import HookedTransformer
    cfg = dataclasses.replace(interp.load("rope-gqa-4l").cfg, n_ctx=4096)
    model = HookedTransformer(cfg, seed=0, tokenizer=ByteTokenizer())
    p = retrieval_prompts(model, [3000], [0.5], 1, seed=3, variant="needle")[0]
    print(p.tokens.tolist())
else:
    from interp.cli import main
    sys.exit(main(sys.argv[2:]))
"""


def _run(tmp_path: Path, fake: bool, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    if fake:
        stdlib, shadow = tmp_path / "stdlib", tmp_path / "shadow" / "pydoc_data"
        for folder in (stdlib, shadow):
            folder.mkdir(parents=True, exist_ok=True)
        (stdlib / "a.py").write_text("x = 1\n" * 5000)  # a held-out file, were the standard library read
        (shadow / "__init__.py").write_text("")
        (shadow / "topics.py").write_text("topics = {'fake': 'Not the reference. ' * 4000}\n")
        env["PYTHONPATH"] = os.pathsep.join([str(shadow.parent), env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, "-c", RUNNER, str(tmp_path / "stdlib") if fake else "-", *args],
                          capture_output=True, text=True, env=env, stdin=subprocess.DEVNULL, timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


@pytest.mark.parametrize("kind", ["corpus", "text"])
def test_analyses_give_the_same_numbers_whatever_stdlib_and_pydoc_data(tmp_path, kind):
    tables = []
    for fake in (False, True):
        out = tmp_path / f"out-{fake}"
        _run(tmp_path, fake, "analyze", "attn-only-2l", "--out", str(out), "--data", kind, "--n-seqs", "3",
             "--seq-len", "96", "--analyses", "induction,previous_token,sinks", "--no-progress", "--no-report")
        tables.append(pd.read_parquet(out / "results.parquet"))
        settings = json.loads((out / "settings.json").read_text())
        name = evaldata.HELDOUT if kind == "corpus" else evaldata.LANGUAGE_REFERENCE
        assert settings["data_source"]["sha256"] == evaldata.manifest()[name]["sha256"]
    assert len(tables[0]) > 50
    pd.testing.assert_frame_equal(tables[0], tables[1], check_exact=True)


def test_the_needle_haystack_is_the_same_whatever_pydoc_data(tmp_path):
    here, fake = (_run(tmp_path, f, "needle").stdout for f in (False, True))
    assert here == fake and len(json.loads(here)[0]) > 2900


# ---- named by sha256; never two sources in one folder ----------------------------------------------------
def test_settings_and_report_name_the_data_and_a_folder_refuses_other_data(tmp_path, capsys):
    text = tmp_path / "mine.txt"
    text.write_text(read_text()[:30_000])
    out = tmp_path / "out"
    args = ["analyze", "attn-only-2l", "--out", str(out), "--data", "text", "--text-file", str(text),
            "--analyses", "previous_token", "--n-seqs", "2", "--seq-len", "64", "--no-progress"]
    assert cli(args) == 0
    first = hashlib.sha256(text.read_bytes()).hexdigest()
    settings = json.loads((out / "settings.json").read_text())
    assert settings["data_source"] == {"name": str(text), "sha256": first}
    assert f"sha256 {first}" in (out / "report.md").read_text()
    before = pd.read_parquet(out / "results.parquet")
    assert cli(args) == 0  # the same bytes: resumed (nothing to do)

    text.write_text(read_text()[30_000:60_000])  # the same path and settings, other bytes
    second = hashlib.sha256(text.read_bytes()).hexdigest()
    capsys.readouterr()
    assert cli(args) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and first in err and second in err and "--force" in err
    pd.testing.assert_frame_equal(pd.read_parquet(out / "results.parquet"), before)  # nothing mixed in
    assert cli([*args, "--force"]) == 0
    assert json.loads((out / "settings.json").read_text())["data_source"]["sha256"] == second
    after = pd.read_parquet(out / "results.parquet")  # computed on the new bytes, not tokens cached from the old
    assert len(after) == len(before) and not np.allclose(after["value"], before["value"])


def test_a_folder_from_before_data_was_named_is_refused(tmp_path, capsys):
    out = tmp_path / "out"
    args = ["analyze", "attn-only-2l", "--out", str(out), "--analyses", "previous_token", "--n-seqs", "2",
            "--seq-len", "64", "--no-progress", "--no-report"]
    assert cli(args) == 0
    settings = json.loads((out / "settings.json").read_text())
    assert settings["data"]["kind"] == "corpus"
    del settings["data_source"]
    (out / "settings.json").write_text(json.dumps(settings))
    capsys.readouterr()
    assert cli(args) == 2
    err = capsys.readouterr().err
    assert "sha256 unrecorded" in err and evaldata.manifest()[evaldata.HELDOUT]["sha256"] in err


# ---- a damaged install --------------------------------------------------------------------------------
@pytest.fixture
def damaged(tmp_path, monkeypatch):
    """A copy of the shipped data whose held-out file holds other bytes."""
    copy = tmp_path / "evaldata"
    shutil.copytree(evaldata.HERE, copy, ignore=shutil.ignore_patterns("*.py", "__pycache__"))
    entry = evaldata.manifest()[evaldata.HELDOUT]
    raw = gzip.decompress((copy / entry["file"]).read_bytes())
    (copy / entry["file"]).write_bytes(gzip.compress(raw[:-1] + b"!"))  # one byte off
    for cached in (evaldata.manifest, evaldata.read_bytes, evaldata.heldout_docs, evaldata._text):
        cached.cache_clear()
    monkeypatch.setattr(evaldata, "HERE", copy)
    yield copy / entry["file"]
    monkeypatch.undo()
    for cached in (evaldata.manifest, evaldata.read_bytes, evaldata.heldout_docs, evaldata._text):
        cached.cache_clear()


def test_a_damaged_data_file_is_one_line_before_any_model_loads(damaged, tmp_path, capsys):
    with pytest.raises(evaldata.BrokenInstall, match="reinstall"):
        check_data(DataSpec(kind="corpus"))
    assert evaldata.language_reference()  # the other file is whole, and still reads
    out = tmp_path / "out"
    assert cli(["analyze", "no-such-model", "--out", str(out), "--data", "corpus", "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and str(damaged) in err and "reinstall" in err and not out.exists()
    (damaged).write_bytes(b"not gzip")
    evaldata.read_bytes.cache_clear()
    with pytest.raises(evaldata.BrokenInstall, match="cannot be read"):
        evaldata.heldout_docs.__wrapped__()


# ---- bad --text-file: one line, before any model loads ----------------------------------------------------
@pytest.mark.parametrize("content, message", [
    (b"", "too short"),
    (b"\x00" * 20_000, "binary file"),
    (b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 40, "not UTF-8"),
    ("caf\u00e9 ".encode("latin-1") * 4000, "not UTF-8"),
    (b"short text " * 10, "too short"),
])
@pytest.mark.parametrize("command", [["analyze", "attn-only-2l"], ["kv", "precision", "attn-only-2l", "--seq-len", "200"],
                                     ["kv", "passkey", "attn-only-2l", "--lengths", "248", "--seq-len", "200"]])
def test_a_bad_text_file_is_one_line_before_the_model_loads(tmp_path, capsys, monkeypatch, content, message, command):
    import interp

    monkeypatch.setattr(interp, "load", lambda *a, **k: pytest.fail("the model must not load"))
    monkeypatch.setattr("interp.models.formats.checkpoint.load_checkpoint", lambda *a, **k: pytest.fail("no checkpoint loads"))
    bad = tmp_path / "bad.txt"
    bad.write_bytes(content)
    out = tmp_path / "out"
    assert cli([*command, "--out", str(out), "--text-file", str(bad), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err
    assert not out.exists()
