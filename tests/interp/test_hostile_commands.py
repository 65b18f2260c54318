"""Command lines a careless or hostile user writes (issue 56, the minor cases): each is one line naming
what was wrong, before any model loads, and never advice that would run a file's code."""

from __future__ import annotations

import os
import pickle

import pytest

import interp
from interp.cli import main as cli


@pytest.fixture
def no_loading(monkeypatch):
    monkeypatch.setattr(interp, "load", lambda *a, **k: pytest.fail("a model was loaded"))


def _one_line(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and "Traceback" not in err, err
    return err


def test_a_window_that_keeps_everything_is_blamed_on_the_window(no_loading, tmp_path, capsys):
    """`kv select --window 100000` said "--loss-tokens must be >= 100006"."""
    assert cli(["kv", "select", "rope-gqa-4l", "--window", "100000", "--out", str(tmp_path / "o")]) == 2
    err = _one_line(capsys)
    assert "streaming(4,100000): the window must be between 1 and 256" in err and "--loss-tokens" not in err


@pytest.mark.parametrize("command", [["lengths", "rope-gqa-4l", "--lengths", "32"],
                                     ["extrapolate", "rope-gqa-4l", "--lengths", "256,512"]])
def test_corpus_and_a_text_file_together_are_refused(command, no_loading, tmp_path, capsys):
    """`--data corpus --text-file X` read the file and said nothing."""
    text = tmp_path / "mine.txt"
    text.write_text("some text " * 100)
    assert cli([*command, "--data", "corpus", "--text-file", str(text), "--out", str(tmp_path / "o")]) == 2
    assert f"--data corpus reads the zoo's held-out corpus and --text-file {text} is other text" in _one_line(capsys)


class _Evil:
    def __reduce__(self):
        return (os.system, ("touch PWNED",))


@pytest.mark.parametrize("content", ["garbage", "pickle"])
def test_a_data_file_that_is_not_tensors_never_suggests_running_it(content, no_loading, tmp_path, capsys,
                                                                     monkeypatch):
    """torch's message for such a file advises weights_only=False, which would run the pickle's code."""
    monkeypatch.chdir(tmp_path)
    bad = tmp_path / "ids.pt"
    if content == "garbage":
        bad.write_bytes(os.urandom(3000))
    else:
        with open(bad, "wb") as f:
            pickle.dump(_Evil(), f)
    assert cli(["kv", "precision", "rope-gqa-4l", "--data-file", str(bad), "--out", str(tmp_path / "o")]) == 2
    err = _one_line(capsys)
    assert f"cannot read token ids from {bad}" in err and "weights_only" not in err
    assert not (tmp_path / "PWNED").exists()
