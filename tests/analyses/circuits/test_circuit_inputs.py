"""A circuit task file as users write them (issue 56, D2 and the minor cases): a prompt longer than the model's
context was cut silently and its metric read at token 255; a file nested too deeply or not UTF-8 was a
traceback or did not name the file. Each is now one line, naming the line of the file."""

from __future__ import annotations

import json

import pytest

import interp
from interp.analyses.circuits.tasks import file_task, read_task_file
from interp.cli import main as cli


def _pair(clean: str, corrupted: str, answer: str = "e") -> str:
    return json.dumps({"clean": clean, "corrupted": corrupted, "answer": answer}) + "\n"


def _one_line(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and "Traceback" not in err, err
    return err


@pytest.mark.parametrize("lengths, says", [
    ((400, 400), "pairs.jsonl:3: the clean prompt is 401 tokens, longer than the model's context of 256 tokens"),
    ((301, 400), "pairs.jsonl:3: the corrupted prompt is 401 tokens, longer than the model's context of 256 tokens"),
])
def test_a_prompt_longer_than_the_context_is_refused_naming_its_line(lengths, says, tmp_path, capsys):
    """attn-only-2l reads bytes (one token each, BOS first) and has 256 positions."""
    f = tmp_path / "pairs.jsonl"
    f.write_text(_pair("abc", "abd") + "\n" + _pair("x" * lengths[0], "y" * lengths[1]))
    out = tmp_path / "out"
    assert cli(["circuit", "attn-only-2l", "--task", str(f), "--no-progress", "--out", str(out)]) == 2
    assert says in _one_line(capsys)
    assert not out.exists()


def test_a_prompt_that_fits_is_kept_whole():
    model = interp.load("attn-only-2l")
    task = file_task(model, [{"clean": "x" * 255, "corrupted": "y" * 255, "answer": ["e"]}])
    assert task.clean.shape[1] == 256 and int(task.positions[0]) == 255  # BOS + 255 bytes: the last position


def test_a_task_file_nested_too_deeply_or_not_utf8_is_one_line(tmp_path, capsys):
    deep = tmp_path / "deep.jsonl"
    deep.write_text("[" * 200_000 + "]" * 200_000 + "\n")
    with pytest.raises(ValueError, match="deep.jsonl:1: JSON nested too deeply"):
        read_task_file(deep)
    latin = tmp_path / "latin.jsonl"
    latin.write_bytes('{"clean": "caf\u00e9", "corrupted": "cafe", "answer": "e"}\n'.encode("latin-1"))
    with pytest.raises(ValueError, match=r"latin.jsonl: not UTF-8 text \(byte \d+"):
        read_task_file(latin)
    for f in (deep, latin):
        assert cli(["circuit", "attn-only-2l", "--task", str(f), "--out", str(tmp_path / "out")]) == 2
        assert f.name in _one_line(capsys)


# ---- memory (issue 56, D4): 100,000 pairs reached 14 GB, and under a cap a raw MemoryError traceback ----------
def test_prompts_that_would_not_fit_are_refused_with_the_most_that_do(monkeypatch):
    from interp.analyses.circuits import study as circuit_study
    from interp.analyses.circuits.tasks import induction_task
    from interp.models.placement.memory import FIXED_BYTES, GiB

    model = interp.load("attn-only-2l")
    task = induction_task(model, 64)
    available = FIXED_BYTES + GiB // 2  # room for about a thousand prompts of attn-only-2l's induction
    with pytest.raises(ValueError) as e:
        circuit_study.check_memory(model, induction_task(model, 5_000), 16, available=available)
    said = str(e.value)
    assert said.startswith("--prompts 5000: about ") and "prompts of 41 tokens" in said and "\n" not in said, said
    most = int(said.rsplit("at most about ", 1)[1].split(" ")[0].replace(",", ""))
    assert 100 < most < 5_000
    circuit_study.check_memory(model, induction_task(model, most), 16, available=available)  # that many do fit
    circuit_study.check_memory(model, task, 16, available=available)


def test_the_command_refuses_before_any_run_and_out_of_memory_is_one_line(monkeypatch, tmp_path, capsys):
    from interp.analyses.circuits import runner, study as circuit_study
    from interp.models.placement.memory import FIXED_BYTES, GiB

    monkeypatch.setattr(circuit_study, "available_bytes", lambda device: FIXED_BYTES + GiB // 2)
    monkeypatch.setattr(runner.Runner, "__init__", lambda *a, **k: pytest.fail("a run started"))
    argv = ["circuit", "attn-only-2l", "--task", "induction", "--no-progress"]
    assert cli([*argv, "--prompts", "5000", "--out", str(tmp_path / "a")]) == 2
    assert "at most about" in _one_line(capsys)
    assert not (tmp_path / "a").exists()

    def exhausted(*a, **k):
        raise MemoryError

    monkeypatch.setattr(runner.Runner, "__init__", exhausted)
    assert cli([*argv, "--prompts", "8", "--out", str(tmp_path / "b")]) == 2
    assert "out of memory on this machine" in _one_line(capsys)
