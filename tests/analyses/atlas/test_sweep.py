"""Sweeps: discovery, resumption after a kill, corrupt checkpoints, settings, HF run folders, the CLI."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pandas as pd
import pytest
import torch
import torch.nn.functional as F

import interp
from interp.models.runs.discover import discover, parse_step
from interp.analyses.store import COLUMNS
from interp.analyses.atlas.sweep import SettingsMismatch, sweep
from interp.analyses.data import DataSpec, build_tokens
from interp.cli import main as cli

from sweep_fixtures import CFG, CHEAP, DATA, STEPS, count_calls, make_run, settings


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    return make_run(tmp_path_factory.mktemp("runs"))


@pytest.fixture(scope="module")
def reference(run_dir, tmp_path_factory):
    """An uninterrupted sweep: the table every other way of running must reproduce."""
    out = tmp_path_factory.mktemp("ref")
    result = sweep([str(run_dir)], out, settings(), progress=False, report=False, log=lambda *_: None)
    assert not result.errors
    return result.table


def _part_mtimes(out) -> dict:
    return {p.relative_to(out): p.stat().st_mtime_ns for p in (out / "parts").glob("*/*/*.json")
            if not p.name.endswith(".error.json")}


# ---- discovery -----------------------------------------------------------------------------------
@pytest.mark.parametrize("name, step", [("step1000", 1000), ("step_00300", 300), ("checkpoint-500", 500),
                                        ("ckpt_20", 20), ("global_step7", 7), ("final", None), ("run-v2-12", 12)])
def test_parse_step(name, step):
    assert parse_step(name) == step


def test_discover_orders_by_step_from_meta_then_name(run_dir, tmp_path):
    run = discover(str(run_dir))
    assert run.name == "run" and [c.step for c in run.checkpoints] == sorted(STEPS)
    # run.json (the zoo's layout) lists folders; meta.json's step wins over the folder name
    model = interp.HookedTransformer(interp.ModelConfig(n_layers=1, d_model=8, n_heads=2, d_vocab=11, n_ctx=8))
    interp.save_model(model, tmp_path / "r" / "late", meta={"step": 900})
    interp.save_model(model, tmp_path / "r" / "step5")
    (tmp_path / "r" / "run.json").write_text(json.dumps({"checkpoints": [{"dir": "late"}, {"dir": "step5"}]}))
    assert [(c.name, c.step) for c in discover(str(tmp_path / "r")).checkpoints] == [("step5", 5), ("late", 900)]
    # one checkpoint folder is a run of one checkpoint
    one = discover(str(run_dir / "step50"))
    assert [(c.name, c.step) for c in one.checkpoints] == [("step50", 50)]
    with pytest.raises(FileNotFoundError, match="neither a folder nor a zoo run"):
        discover(str(tmp_path / "missing"))


def test_discover_zoo_names(tmp_path, monkeypatch):
    import functools

    from interp.models import zoo

    model = interp.HookedTransformer(interp.ModelConfig(n_layers=1, d_model=8, n_heads=2, d_vocab=11, n_ctx=8))
    for step in (0, 100):
        interp.save_model(model, tmp_path / "tiny-zoo" / f"step_{step:05d}", meta={"step": step})
    (tmp_path / "tiny-zoo" / "run.json").write_text(json.dumps(
        {"name": "tiny-zoo", "checkpoints": [{"dir": "step_00000", "step": 0}, {"dir": "step_00100", "step": 100},
                                             {"dir": "step_00200", "step": 200}]}))  # 200: listed, not shipped
    monkeypatch.setattr(zoo, "resolve", functools.partial(zoo.resolve, root=tmp_path))
    whole = discover("tiny-zoo")  # a bare run name: every checkpoint, not only the last
    assert whole.name == "tiny-zoo" and [c.step for c in whole.checkpoints] == [0, 100]
    assert [c.step for c in discover("tiny-zoo/100").checkpoints] == [100]
    with pytest.raises(FileNotFoundError, match="steps are"):
        discover("tiny-zoo/5")


def test_repeated_random_data_is_reproducible_and_repeats():
    model = interp.HookedTransformer(interp.ModelConfig(n_layers=1, d_model=8, n_heads=2, d_vocab=29, n_ctx=64))
    a, b = build_tokens(DATA, model), build_tokens(DataSpec(**DATA.to_dict()), model)
    assert torch.equal(a, b) and a.shape == (DATA.n_seqs, DATA.seq_len)
    half = DATA.seq_len // 2
    assert torch.equal(a[:, :half], a[:, half:]) and int(a.max()) < 29
    assert not torch.equal(a, build_tokens(DataSpec(kind="repeated_random", n_seqs=4, seq_len=24, seed=4), model))


def test_token_file_data(run_dir, tmp_path):
    """--data file: the saved ids, cut into n_seqs x seq_len, are what every checkpoint sees."""
    ids = torch.randint(0, CFG.d_vocab, (50,), generator=torch.Generator().manual_seed(1))
    torch.save(ids, tmp_path / "ids.pt")
    data = DataSpec(kind="file", n_seqs=3, seq_len=16, path=str(tmp_path / "ids.pt"))
    result = sweep([str(run_dir)], tmp_path / "out", settings(["loss"], data=data), progress=False, report=False,
                   log=lambda *_: None)
    model = interp.load(run_dir / "step0")
    tokens = ids[:48].reshape(3, 16)
    expected = model(tokens, return_type="loss").item()
    got = result.table[(result.table.checkpoint == "step0")]["value"].item()
    assert got == pytest.approx(expected, rel=1e-6)
    with pytest.raises(ValueError, match="needs 4 x 16"):
        sweep([str(run_dir)], tmp_path / "out2", settings(["loss"], data=DataSpec(kind="file", n_seqs=4, seq_len=16,
              path=str(tmp_path / "ids.pt"))), progress=False, report=False, log=lambda *_: None)


# ---- the table ----------------------------------------------------------------------------------
def test_table_schema_and_values_match_direct_calls(run_dir, reference):
    from interp.analyses import detect_heads

    assert list(reference.columns) == list(COLUMNS)
    assert str(reference["layer"].dtype) == "Int64" and str(reference["step"].dtype) == "Int64"
    n_ckpt, n_heads = len(STEPS), CFG.n_layers * CFG.n_heads
    counts = reference.groupby("metric").size()
    assert counts["previous_token"] == n_ckpt * n_heads and counts["loss"] == n_ckpt
    assert counts["delta_loss/mean"] == n_ckpt * n_heads
    assert reference.loc[reference.metric == "loss", "layer"].isna().all()

    # the loss row is the mean next-token cross-entropy, recomputed here by hand from the logits
    model = interp.load(run_dir / "step50")
    tokens = build_tokens(DATA, model)
    logits = model(tokens)
    manual = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1)).item()
    row = reference[(reference.checkpoint == "step50") & (reference.metric == "loss")]
    assert row["value"].item() == pytest.approx(manual, rel=1e-5)
    # head scores are the analyzer's own, on the same tokens
    direct = detect_heads(model, tokens, kinds=["previous_token"])
    got = reference[(reference.checkpoint == "step50") & (reference.metric == "previous_token")]
    assert got["value"].to_numpy() == pytest.approx(direct["score"].to_numpy(), abs=1e-6)


# ---- resumption -----------------------------------------------------------------------------------
def test_interrupted_sweep_resumes_without_recomputing(run_dir, reference, tmp_path, monkeypatch):
    out = tmp_path / "out"
    class Killed(RuntimeError):
        pass

    def kill_after_4(n_written: int) -> None:
        if n_written >= 4:
            raise Killed(f"stopping after {n_written} parts, as if the sweep had been killed")

    with pytest.raises(Killed):
        sweep([str(run_dir)], out, settings(), progress=False, report=False, log=lambda *_: None, on_part=kill_after_4)
    before = _part_mtimes(out)
    assert len(before) == 4
    finished = {(p.parent.name, p.stem) for p in before}

    calls = count_calls(monkeypatch)
    result = sweep([str(run_dir)], out, settings(), progress=False, report=False, log=lambda *_: None)
    total = len(STEPS) * len(CHEAP)
    assert sum(calls.values()) == total - 4 and set(calls.values()) == {1}
    assert not finished & set(calls), "a finished (checkpoint, analysis) was recomputed"
    assert result.n_skipped == 4 and result.n_run == total - 4
    assert all(_part_mtimes(out)[k] == t for k, t in before.items()), "a finished part was rewritten"
    pd.testing.assert_frame_equal(result.table, reference)
    pd.testing.assert_frame_equal(pd.read_parquet(out / "results.parquet"), reference)

    calls.clear()  # a third run does nothing at all
    again = sweep([str(run_dir)], out, settings(), progress=False, report=False, log=lambda *_: None)
    assert not calls and again.n_run == 0 and again.n_skipped == total


@pytest.mark.slow
def test_killed_sweep_process_loses_nothing(run_dir, reference, tmp_path, monkeypatch):
    """SIGKILL a real `interp sweep` process once its first parts exist, then finish in-process."""
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "interp", "sweep", str(run_dir), "--out", str(out), "--analyses", ",".join(CHEAP),
           "--expensive-on", "all", "--data", DATA.kind, "--n-seqs", str(DATA.n_seqs), "--seq-len", str(DATA.seq_len),
           "--seed", str(DATA.seed), "--no-report", "--no-progress"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=tmp_path)
    try:
        deadline = time.time() + 120
        while not list((out / "parts").glob("*/*/*.json")) and proc.poll() is None and time.time() < deadline:
            time.sleep(0.02)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait()
    assert proc.returncode == -signal.SIGKILL, "the sweep finished before it could be killed"
    before = _part_mtimes(out)
    assert before
    for part in (out / "parts").glob("*/*/*.json"):
        json.loads(part.read_text())  # every part on disk is whole

    calls = count_calls(monkeypatch)
    result = sweep([str(run_dir)], out, settings(), progress=False, report=False, log=lambda *_: None)
    assert sum(calls.values()) == len(STEPS) * len(CHEAP) - len(before)
    assert not {(p.parent.name, p.stem) for p in before} & set(calls)
    pd.testing.assert_frame_equal(result.table, reference)


def test_changed_settings_are_refused_unless_forced(run_dir, tmp_path):
    quiet = dict(progress=False, report=False, log=lambda *_: None)
    sweep([str(run_dir)], tmp_path, settings(["loss"]), **quiet)
    other = settings(["loss"], data=DataSpec(kind="repeated_random", n_seqs=4, seq_len=24, seed=99))
    with pytest.raises(SettingsMismatch, match="seed.*--force"):
        sweep([str(run_dir)], tmp_path, other, **quiet)
    forced = sweep([str(run_dir)], tmp_path, other, force=True, **quiet)
    assert forced.n_run == len(STEPS) and forced.n_skipped == 0
    # adding an analysis to the same data is not a change of meaning: the old parts are kept
    more = sweep([str(run_dir)], tmp_path, settings(["loss", "previous_token"], data=other.data), **quiet)
    assert more.n_skipped == len(STEPS) and more.n_run == len(STEPS)


# ---- failures ---------------------------------------------------------------------------------------
def test_truncated_checkpoint_is_reported_and_skipped(tmp_path, capsys):
    run = make_run(tmp_path, name="broken")
    weights = run / "step50" / "model.safetensors"
    good = weights.read_bytes()
    weights.write_bytes(good[: len(good) // 2])
    out = tmp_path / "out"
    code = cli(["sweep", str(run), "--out", str(out), "--analyses", "loss,previous_token", "--data", "repeated_random",
                "--n-seqs", "2", "--seq-len", "16", "--no-progress"])
    printed = capsys.readouterr().out
    assert code == 1  # finished, with errors
    errors = json.loads((out / "errors.json").read_text())
    assert [(e["checkpoint"], e["analysis"], e["error"]) for e in errors] == [("step50", "load", "CheckpointError")]
    assert "model.safetensors" in errors[0]["message"] and "step50" in printed and "CheckpointError" in printed
    table = pd.read_parquet(out / "results.parquet")
    assert sorted(table["checkpoint"].unique()) == ["step0", "step200"]
    assert "step50" in (out / "report.html").read_text()  # the report's error section names it

    weights.write_bytes(good)  # repaired: the next sweep retries it and clears the error
    assert cli(["sweep", str(run), "--out", str(out), "--analyses", "loss,previous_token", "--data", "repeated_random",
                "--n-seqs", "2", "--seq-len", "16", "--no-progress", "--no-report"]) == 0
    assert json.loads((out / "errors.json").read_text()) == []
    assert sorted(pd.read_parquet(out / "results.parquet")["checkpoint"].unique()) == ["step0", "step200", "step50"]


def test_failing_analysis_is_reported_and_others_go_on(run_dir, tmp_path, monkeypatch):
    import dataclasses

    from interp.analyses.atlas import registry

    def boom(ctx):
        raise RuntimeError("deliberate failure")

    monkeypatch.setitem(registry.ANALYSES, "sinks", dataclasses.replace(registry.ANALYSES["sinks"], run=boom))
    result = sweep([str(run_dir)], tmp_path, settings(["sinks", "loss"]), progress=False, report=False, log=lambda *_: None)
    assert {(e["analysis"], e["error"]) for e in result.errors} == {("sinks", "RuntimeError")}
    assert len(result.errors) == len(STEPS) and set(result.table["analysis"]) == {"loss"}


def test_data_longer_than_the_context_is_refused_clearly(run_dir, tmp_path):
    """Refused once, up front, from the checkpoints' configs: nothing loaded, nothing written."""
    long = settings(["loss"], data=DataSpec(kind="repeated_random", n_seqs=2, seq_len=CFG.n_ctx + 1))
    with pytest.raises(ValueError, match=f"pass --seq-len {CFG.n_ctx} or less"):
        sweep([str(run_dir)], tmp_path / "out", long, progress=False, report=False, log=lambda *_: None)
    assert not (tmp_path / "out").exists()


# ---- Hugging Face run folders ------------------------------------------------------------------------
def test_hf_run_of_checkpoint_folders(tmp_path):
    transformers = pytest.importorskip("transformers")
    run = tmp_path / "pythia-like"
    hf = {}
    for step in (200, 100):
        torch.manual_seed(step)
        config = transformers.GPTNeoXConfig(vocab_size=37, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                                            intermediate_size=32, max_position_embeddings=64)
        hf[step] = transformers.GPTNeoXForCausalLM(config).eval()
        hf[step].save_pretrained(run / f"step{step}")
    out = tmp_path / "out"
    data = DataSpec(kind="repeated_random", n_seqs=3, seq_len=20, seed=0)
    result = sweep([str(run)], out, settings(["loss", "previous_token"], data=data), progress=False, log=lambda *_: None)
    assert not result.errors
    assert list(result.table.drop_duplicates("checkpoint")["step"]) == [100, 200]
    model = interp.load(run / "step100")
    tokens = build_tokens(data, model)
    with torch.no_grad():  # transformers' own loss on the same tokens: an independent implementation
        expected = hf[100](tokens, labels=tokens).loss.item()
    got = result.table[(result.table.checkpoint == "step100") & (result.table.metric == "loss")]["value"].item()
    assert got == pytest.approx(expected, rel=1e-4)
    assert (out / "report.html").is_file()


# ---- CLI ------------------------------------------------------------------------------------------------
def test_cli_analyze_single_model(run_dir, tmp_path):
    """`interp analyze RUN_FOLDER` analyses the run's last checkpoint only, with the sweep's outputs."""
    out = tmp_path / "one"
    assert cli(["analyze", str(run_dir), "--out", str(out), "--analyses", "loss,previous_token,ablation",
                "--data", "repeated_random", "--n-seqs", "2", "--seq-len", "16", "--no-progress"]) == 0
    table = pd.read_csv(out / "results.csv")
    assert set(table["checkpoint"]) == {"step200"} and set(table["analysis"]) == {"loss", "previous_token", "ablation"}
    assert (out / "report.html").is_file() and (out / "report.md").is_file()
    settings_json = json.loads((out / "settings.json").read_text())
    assert settings_json["data"]["seq_len"] == 16 and "torch" in settings_json["versions"]


def test_cli_rejects_unknown_analysis(run_dir, tmp_path, capsys):
    assert cli(["sweep", str(run_dir), "--out", str(tmp_path), "--analyses", "loss,nonsense"]) == 2
    assert "nonsense" in capsys.readouterr().err
