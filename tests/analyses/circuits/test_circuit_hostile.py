"""`interp circuit` under hostile input (issue 65): --qk-keys past the keys a query sees (the last key was repeated
to fill them, and qk.parquet's means were averages over its copies), an answer id listed twice (prob past 1), two
answer entries at one position (weighed double), a head named twice in --qk, --metric kl on the induction task (a
Python instruction), --offload with EAP / EAP-IG (refused only after the clean and corrupted runs), a done line that
named files not written, and a passkey --length checked against n_ctx whatever --rope-scaling stretched it to."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import interp
from interp.analyses.circuits import Runner
from interp.analyses.circuits.head_names import parse_heads
from interp.analyses.circuits.qk import qk_attribution
from interp.analyses.circuits.tasks import file_task, induction_task, read_task_file, tensor_task
from interp.cli import main as cli

BOS = 256  # attn-only-2l reads bytes: one token per byte, BOS 256, a vocabulary of 257


@pytest.fixture(scope="module")
def model():
    return interp.load("attn-only-2l")


def _write(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _refused_naming_the_line(tmp_path: Path, row: dict, says: str) -> None:
    """A task file of the one line `row` is refused by read_task_file, before any model, in one line: the file,
    then `says` (which starts with the line number)."""
    f = _write(tmp_path / "t.jsonl", [row])
    with pytest.raises(ValueError) as e:
        read_task_file(f)
    assert str(e.value).startswith(f"{f}{says}") and "\n" not in str(e.value), str(e.value)  # the line named


def _one_line(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and "Traceback" not in err, err
    return err


def _no_load(monkeypatch):
    monkeypatch.setattr(interp, "load", lambda *a, **k: pytest.fail("the model loaded before the refusal"))


# ---- --qk-keys past the prompt -----------------------------------------------------------------------------
def test_qk_keys_past_what_a_query_sees_split_each_visible_key_once(model):
    """Queries at positions 2, 5 and 9 see 3, 6 and 10 keys; 50 asked. Each is split at every key it sees, once,
    and the means are over those keys, not over copies of the least-attended one."""
    tokens = torch.randint(256, (3, 12), generator=torch.Generator().manual_seed(1))
    query = torch.tensor([2, 5, 9])
    qk = qk_attribution(model, tokens, 1, 0, query, top_keys=50)
    assert qk.terms.shape[1] == 10  # the most any query sees, not 50: memory bounded by the prompt
    assert qk.keys_seen() == (3, 10)
    for n, i in enumerate(query.tolist()):
        keys = qk.key_pos[n][qk.on[n]].tolist()
        assert sorted(keys) == list(range(i + 1))  # every visible key, each once
        assert (qk.key_pos[n][~qk.on[n]] == -1).all()
    frame = qk.frame
    assert not frame.duplicated(["prompt", "query_pos", "key_pos", "query_sender", "key_sender"]).any()
    assert len(frame) == (3 + 6 + 10) * len(qk.query_senders) * len(qk.key_senders)
    by_hand = frame.assign(term=frame.term.astype("float64")).groupby(["query_sender", "key_sender"],
                                                                      observed=True).term.mean()
    pairs = qk.pairs().set_index(["query_sender", "key_sender"]).mean_term
    torch.testing.assert_close(torch.tensor(pairs.loc[by_hand.index].to_numpy()), torch.tensor(by_hand.to_numpy()),
                               rtol=1e-6, atol=1e-9)
    # the sums still add up to the model's scores at the keys that are on
    total = qk.terms.double().sum((-1, -2))[qk.on]
    torch.testing.assert_close(total, qk.score.double()[qk.on], atol=1e-4, rtol=1e-4)


def test_the_command_says_the_keys_were_capped_and_lists_only_what_it_wrote(tmp_path, capsys):
    out = tmp_path / "out"
    assert cli(["circuit", "attn-only-2l", "--task", "induction", "--prompts", "2", "--method", "eap", "--qk", "1.0",
                "--qk-keys", "50", "--no-progress", "--out", str(out)]) == 0
    said = capsys.readouterr().out
    notes = [line for line in said.splitlines() if line.startswith("note: --qk-keys 50")]
    assert len(notes) == 1 and "L1H0 22 to 40 keys" in notes[0], said
    rec = json.loads((out / "settings.json").read_text())["qk"][0]
    assert (rec["keys_asked"], rec["fewest_keys_per_query"], rec["keys_per_query"]) == (50, 22, 40)
    assert len(rec["mean_weight_at_keys"]) == 40 and all(w > 0 for w in rec["mean_weight_at_keys"])
    assert "never more than a query sees: 22 to 40 keys" in (out / "report.md").read_text()
    done = [line for line in said.splitlines() if line.startswith("done in")][-1]
    assert "qk.*" in done and "position_" not in done, done  # --positions none: no position_* written
    assert not list(out.glob("position_*"))


# ---- answers listed twice -----------------------------------------------------------------------------------
@pytest.mark.parametrize("row, says", [
    ({"clean_ids": [BOS, 97, 98], "corrupted_ids": [BOS, 97, 99], "answer_ids": [101, 101]},
     ':1: "answer_ids": 101 is listed 2 times: give each token once'),
    ({"clean_ids": [BOS, 97, 98], "corrupted_ids": [BOS, 97, 99], "answers": [{"position": -1, "answer_ids": [7] * 100}]},
     ':1: answers[0]: "answer_ids": 7 is listed 100 times'),
    ({"clean": "ab", "corrupted": "ac", "answer": ["e", "f", "e"], "wrong": "g"},
     ":1: \"answer\": 'e' is listed 2 times"),
    ({"clean": "ab", "corrupted": "ac", "answer": "e", "wrong_ids": [5, 6, 5]},
     ':1: "wrong_ids": 5 is listed 2 times'),
])
def test_an_answer_listed_twice_is_refused_before_any_model(tmp_path, row, says):
    _refused_naming_the_line(tmp_path, row, says)


def test_an_answer_listed_twice_in_tensors_is_refused(model):
    clean, corrupted = torch.randint(256, (2, 6)), torch.randint(256, (2, 6))
    answers = torch.tensor([[[3, 4]], [[5, 5]]])  # [batch, k=1, a=2]: row 1 lists 5 twice
    with pytest.raises(ValueError, match=r"^row 1: the answer ids at position -1: 5 is listed 2 times"):
        tensor_task(model, clean, corrupted, [-1], answers, metric="prob")


def test_the_command_refuses_a_repeated_answer_id_before_loading(tmp_path, capsys, monkeypatch):
    """Before: prob 2x the answer's (past 1 with enough copies) and loss -4.6 at 100 copies, written as the clean metric."""
    f = _write(tmp_path / "dup.jsonl", [{"clean_ids": [BOS, 97, 98, 99], "corrupted_ids": [BOS, 97, 98, 100],
                                         "answer_ids": [101] * 100}])
    _no_load(monkeypatch)
    assert cli(["circuit", "attn-only-2l", "--task", str(f), "--metric", "loss", "--out", str(tmp_path / "o")]) == 2
    assert '"answer_ids": 101 is listed 100 times' in _one_line(capsys)


# ---- two answer entries at one position -----------------------------------------------------------------------
@pytest.mark.parametrize("row, says", [
    ({"clean_ids": [BOS, 97, 98, 99], "corrupted_ids": [BOS, 97, 98, 100],
      "answers": [{"position": -1, "answer_ids": 101}, {"position": 3, "answer_ids": 102}]},
     ":1: answers[0] and answers[1] are both at positions -1 and 3 (one token of this 4-token prompt)"),
    ({"clean": "abc", "corrupted": "abd", "answers": [{"position": 1, "answer": "e"}, {"position": 2, "answer": "f"},
                                                      {"position": 1, "answer": "g"}]},
     ":1: answers[0] and answers[2] are both at position 1: give each position once"),
])
def test_two_answers_at_one_position_are_refused_before_any_model(tmp_path, row, says):
    _refused_naming_the_line(tmp_path, row, says)


def test_two_answers_at_one_position_are_refused_once_text_is_tokenised(model, tmp_path):
    """Text prompts resolve -1 only with the tokenizer: "abc" is BOS + 3 bytes, so -1 is position 3."""
    f = _write(tmp_path / "t.jsonl", [{"clean": "abc", "corrupted": "abd",
                                       "answers": [{"position": 3, "answer": "e"}, {"position": -1, "answer": "f"}]}])
    with pytest.raises(ValueError, match=r"^t.jsonl:1: answers\[0\] and answers\[1\] are both at positions 3 and -1"):
        file_task(model, read_task_file(f), metric="logit")
    clean, corrupted = torch.randint(256, (2, 6)), torch.randint(256, (2, 6))
    with pytest.raises(ValueError, match=r"^row 0: answers\[0\] and answers\[1\] are both at positions 5 and -1"):
        tensor_task(model, clean, corrupted, [5, -1], torch.randint(256, (2, 2)), metric="logit")


# ---- --qk naming a head twice ---------------------------------------------------------------------------------
@pytest.mark.parametrize("heads, says", [
    ("L1H0,L1H0", "--qk L1H0,L1H0: 'L1H0' names L1H0 twice: give each head once"),
    ("1.0,0.1,L1H0", "--qk 1.0,0.1,L1H0: '1.0' and 'L1H0' both name L1H0: give each head once"),
])
def test_a_head_named_twice_in_qk_is_refused_before_loading(heads, says, tmp_path, capsys, monkeypatch):
    with pytest.raises(ValueError, match="^" + says.replace(".", r"\.")):
        parse_heads(heads)
    _no_load(monkeypatch)
    assert cli(["circuit", "attn-only-2l", "--task", "induction", "--qk", heads, "--out", str(tmp_path / "o")]) == 2
    assert _one_line(capsys) == f"error: {says}"


# ---- --metric kl on the induction task -------------------------------------------------------------------------
def test_kl_on_the_induction_task_is_measured(model):
    """Before: "build it with kl_metric(model, clean, rows, positions)", a Python instruction, from the command."""
    runner = Runner(model, induction_task(model, 3, metric="kl"))
    assert runner.task.metric_name == "kl"
    assert abs(runner.clean_metric) < 1e-4 and runner.corrupted_metric > 0.1


# ---- --offload with gradients ------------------------------------------------------------------------------------
@pytest.mark.parametrize("offload, method", [("disk", "eap-ig"), ("cpu", "eap")])
def test_offload_with_a_gradient_method_is_refused_before_loading(offload, method, tmp_path, capsys, monkeypatch):
    _no_load(monkeypatch)
    assert cli(["circuit", "attn-only-2l", "--task", "induction", "--method", method, "--offload", offload,
                "--out", str(tmp_path / "o")]) == 2
    err = _one_line(capsys)
    assert err.startswith(f"error: --offload {offload} with --method {method}: ") and "--method patching" in err, err
    assert not (tmp_path / "o").exists()


# ---- the passkey length under --rope-scaling ----------------------------------------------------------------------
class Loaded(Exception):
    pass


def _loaded(monkeypatch):
    def load(*a, **k):
        raise Loaded(k.get("rope_scaling"))
    monkeypatch.setattr(interp, "load", load)


def test_a_passkey_length_is_checked_against_the_context_the_rope_scaling_gives(tmp_path, capsys, monkeypatch):
    """rope-gqa-4l: rotary, n_ctx 256; yarn:2 stretches it to 512."""
    _loaded(monkeypatch)
    argv = ["circuit", "rope-gqa-4l", "--task", "passkey", "--method", "eap", "--no-progress"]
    with pytest.raises(Loaded):  # past the checks, to the load (with the scaling)
        cli([*argv, "--length", "400", "--rope-scaling", "yarn:2", "--out", str(tmp_path / "a")])
    assert cli([*argv, "--length", "400", "--out", str(tmp_path / "b")]) == 2
    assert _one_line(capsys) == ("error: --length 400: the passkey prompts need 128 .. 256 tokens (the model's context; "
                                 "a --rope-scaling such as yarn:2 stretches a rotary model's)")
    assert cli([*argv, "--length", "600", "--rope-scaling", "yarn:2", "--out", str(tmp_path / "c")]) == 2
    assert _one_line(capsys) == ("error: --length 600: the passkey prompts need 128 .. 512 tokens (the context "
                                 "--rope-scaling yarn:2 gives this model: 2 x 256)")


def test_the_passkey_task_reads_past_n_ctx_under_a_scaling_that_stretches_it():
    from interp.analyses.circuits.passkey import passkey_task

    scaled = interp.load("rope-gqa-4l", rope_scaling="yarn:2")
    task = passkey_task(scaled, 400, 1)
    assert 256 < task.clean.shape[1] <= 400
