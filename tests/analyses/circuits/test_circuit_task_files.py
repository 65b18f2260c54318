"""A user's own circuit task, as researchers write them (issue 57, part 5): prompts as token ids, answers at
several positions (negative from the end), the logit, prob, logit-diff, loss and KL metrics averaged over
them, through EAP, EAP-IG, exact patching and faithfulness; the task-file format's refusals; the Python
example of docs/circuits.md."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

import interp
from interp.analyses.circuits import Runner
from interp.analyses.circuits.tasks import file_task, read_task_file, tensor_task
from interp.cli import main as cli

from circuit_tasks import add_to_head, head_delta, run_hooked

BOS = 256  # attn-only-2l reads bytes: one token per byte, BOS 256, a vocabulary of 257


@pytest.fixture(scope="module")
def model():
    return interp.load("attn-only-2l")


def _write(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def _ids(text: str) -> list[int]:
    return [BOS, *text.encode()]


def _random(n: int = 4, p: int = 9, k: int = 3, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    clean, corrupted = torch.randint(256, (n, p), generator=g), torch.randint(256, (n, p), generator=g)
    answers, wrongs = torch.randint(256, (n, k), generator=g), torch.randint(256, (n, k), generator=g)
    return clean, corrupted, answers, wrongs


# ---- token ids equal text ------------------------------------------------------------------------------
def test_a_task_file_of_token_ids_is_the_same_task_as_from_text(model, tmp_path):
    texts = [("When Mary and John", "When Anna and Paul", " Mary", " John"),
             ("abcabcab", "abcxyzab", "c", "z")]
    text = _write(tmp_path / "text.jsonl", [{"clean": c, "corrupted": x, "answer": a[-1], "wrong": w[-1]}
                                            for c, x, a, w in texts])
    ids = _write(tmp_path / "ids.jsonl", [{"clean_ids": _ids(c), "corrupted_ids": _ids(x),
                                           "answer_ids": ord(a[-1]), "wrong_ids": [ord(w[-1])]}
                                          for c, x, a, w in texts])
    for metric in (None, "logit", "prob", "loss", "kl"):
        a, b = (file_task(model, read_task_file(f), metric=metric) for f in (text, ids))
        assert a.metric_name == b.metric_name == (metric or "logit-diff")
        for key in ("clean", "corrupted", "rows", "positions", "answer_tokens", "wrong_tokens"):
            assert torch.equal(getattr(a, key), getattr(b, key)), key
        ra, rb = Runner(model, a), Runner(model, b)
        assert (ra.clean_metric, ra.corrupted_metric) == (rb.clean_metric, rb.corrupted_metric)


def test_ids_are_taken_as_they_are_and_text_answers_may_sit_beside_them(model):
    # no BOS is prepended to ids; a text answer is tokenised as with text prompts
    t = file_task(model, [{"clean_ids": [97, 98, 99, 97], "corrupted_ids": [120, 121, 122, 120],
                           "answers": [{"position": -1, "answer": "b"}, {"position": 0, "answer_ids": [98, 99]}]}],
                  metric="prob")
    assert t.clean.tolist() == [[97, 98, 99, 97]] and t.positions.tolist() == [3, 0]
    logits = torch.randn(2, model.cfg.d_vocab)
    p = logits.softmax(-1)
    torch.testing.assert_close(t.metric(logits, torch.arange(2)), torch.stack([p[0, 98], p[1, 98] + p[1, 99]]))


# ---- several positions: the metric from a plain forward ------------------------------------------------
@pytest.mark.parametrize("metric", ["logit", "prob", "logit-diff", "loss", "kl"])
def test_a_multi_position_metric_is_the_mean_written_out_from_the_logits(model, tmp_path, metric):
    # prompts of different lengths (right-padded): a negative position counts from each prompt's own end
    rows = [{"clean": "abcdabcd", "corrupted": "abcdwxyz",
             "answers": [{"position": 4, "answer": "b", "wrong": "x"}, {"position": -2, "answer": "d", "wrong": "z"},
                         {"position": -1, "answer_ids": [97, 98], "wrong_ids": 120}]},
            {"clean_ids": _ids("hello hello"), "corrupted_ids": _ids("hello jelly"),
             "answers": [{"position": 7, "answer": "e", "wrong": "j"}, {"position": -3, "answer": "l", "wrong": "y"}]}]
    task = file_task(model, read_task_file(_write(tmp_path / "multi.jsonl", rows)), metric=metric)
    spots = [(0, 4, [98], [120]), (0, 7, [100], [122]), (0, 8, [97, 98], [120]),
             (1, 7, [101], [106]), (1, 9, [108], [121])]
    assert list(zip(task.rows.tolist(), task.positions.tolist())) == [(r, p) for r, p, _, _ in spots]
    with torch.no_grad():
        clean = [model(torch.tensor([_ids("abcdabcd")]))[0], model(torch.tensor([_ids("hello hello")]))[0]]
        corrupt = [model(torch.tensor([_ids("abcdwxyz")]))[0], model(torch.tensor([_ids("hello jelly")]))[0]]

    def by_hand(logits) -> float:
        values = []
        for r, p, a, w in spots:
            z, ref = logits[r][p].double(), clean[r][p].double()
            if metric == "logit":
                values.append(z[a].mean())
            elif metric == "prob":
                values.append(z.softmax(-1)[a].sum())
            elif metric == "logit-diff":
                values.append(z[a].mean() - z[w].mean())
            elif metric == "loss":
                values.append(-z.softmax(-1)[a].sum().log())
            else:
                values.append((ref.softmax(-1) * (ref.log_softmax(-1) - z.log_softmax(-1))).sum())
        return float(torch.stack(values).mean())

    runner = Runner(model, task)
    assert runner.clean_metric == pytest.approx(by_hand(clean), abs=1e-5)
    assert runner.corrupted_metric == pytest.approx(by_hand(corrupt), abs=1e-5)
    assert runner.patched(runner.graph.allowed.float()) == pytest.approx(runner.corrupted_metric, abs=1e-4)


def test_kl_is_zero_on_the_clean_run_and_needs_no_answers(model, tmp_path):
    f = _write(tmp_path / "kl.jsonl", [{"clean_ids": _ids("abcabcabc"), "corrupted_ids": _ids("abcxyzxyz"),
                                        "answers": [{"position": p} for p in (5, 6, -1)]}])
    task = file_task(model, read_task_file(f))  # no answers anywhere: kl by default
    assert task.metric_name == "kl" and task.answer_tokens is None
    with torch.no_grad():
        logits = model(task.clean)
    assert task.metric(logits[task.rows, task.positions], torch.arange(3)).abs().max() < 1e-6
    runner = Runner(model, task)
    assert abs(runner.clean_metric) < 1e-6 and runner.corrupted_metric > 0.1
    g = runner.graph
    assert runner.faithfulness(g.allowed) == pytest.approx(1.0, abs=1e-5)
    assert runner.faithfulness(torch.zeros_like(g.allowed)) == pytest.approx(0.0, abs=1e-5)
    with pytest.raises(ValueError, match="EAP takes the metric's gradient at the clean run"):
        runner.eap()
    assert runner.eap_ig(2).abs().sum() > 0


# ---- the pipeline: linear in the positions -------------------------------------------------------------
@pytest.mark.parametrize("metric", ["logit-diff", "prob"])
def test_scores_of_a_multi_position_task_are_the_mean_of_its_single_position_tasks(model, metric):
    """The metric is a mean over answers; k positions per prompt with n prompts each, so the task's metric is
    the mean of the k one-position tasks' metrics, and so is every score (EAP and EAP-IG are linear in the
    metric; exact patching's metric(patched) - metric(clean) is the same mean)."""
    clean, corrupted, answers, wrongs = _random()
    positions = [2, 5, -1]
    multi = Runner(model, tensor_task(model, clean, corrupted, positions, answers, wrongs, metric=metric))
    singles = [Runner(model, tensor_task(model, clean, corrupted, [p], answers[:, j:j + 1], wrongs[:, j:j + 1],
                                         metric=metric)) for j, p in enumerate(positions)]
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    assert multi.clean_metric == pytest.approx(mean([r.clean_metric for r in singles]), abs=1e-6)
    tol = dict(atol=1e-6, rtol=1e-4)
    torch.testing.assert_close(multi.eap(), mean([r.eap() for r in singles]), **tol)
    torch.testing.assert_close(multi.eap_ig(2), mean([r.eap_ig(2) for r in singles]), **tol)
    g = multi.graph
    edges = [(g.senders.index("L0H1"), g.receivers.index("L1H0")), (0, len(g.receivers) - 1)]
    torch.testing.assert_close(multi.patch_edges(edges), mean([r.patch_edges(edges) for r in singles]), **tol)


def test_exact_patching_of_one_edge_on_several_positions_is_the_intervention_written_with_hooks(model):
    clean, corrupted, answers, _ = _random(seed=1)
    task = tensor_task(model, clean, corrupted, [3, -2, -1], answers, metric="logit")
    runner = Runner(model, task)
    g = runner.graph
    s = g.senders.index("L0H2")  # layer-0 head 2 into the key of L1H0
    r = next(i for i, (name, kind) in enumerate(zip(g.receivers, g.inputs)) if name == "L1H0" and kind == "k")
    delta = head_delta(model, clean, corrupted, 0, 2)
    logits = run_hooked(model, clean, [("blocks.1.hook_k_input", add_to_head(0, delta))], split_qkv=True)
    p = clean.shape[1]
    want = float(torch.stack([logits[i, q % p, answers[i, j]] for i in range(clean.shape[0])
                              for j, q in enumerate([3, -2, -1])]).double().mean())
    assert float(runner.patch_edges([(s, r)])[s, r]) == pytest.approx(want - runner.clean_metric, abs=1e-4)


# ---- refusals: one line naming the line ----------------------------------------------------------------
GOOD = {"clean": "abc", "corrupted": "abd", "answer": "e", "wrong": "f"}


@pytest.mark.parametrize("row, says", [
    ({"clean_ids": [256, 97, 98], "corrupted_ids": [256, 97], "answer_ids": 1},
     "t.jsonl:2: the corrupted prompt is 2 tokens and the clean one 3;"),
    ({"clean_ids": [256, 97, 98], "corrupted_ids": [256, 97, 99], "answers": [{"position": 3, "answer_ids": 1}]},
     "t.jsonl:2: position 3 is outside the prompt of 3 tokens (0 to 2, or -3 to -1 from the end)"),
    ({"clean_ids": [256, 97, 98], "corrupted_ids": [256, 97, 99], "position": -4, "answer_ids": 1},
     "t.jsonl:2: position -4 is outside the prompt of 3 tokens"),
    ({"clean": "ab", "clean_ids": [97], "corrupted": "ac", "answer": "e"},
     't.jsonl:2: give "clean" (text) or "clean_ids" (token ids), not both'),
    ({"clean_ids": [97, "b"], "corrupted_ids": [97, 98], "answer": "e"},
     't.jsonl:2: "clean_ids" must be a non-empty list of token ids'),
    ({"clean_ids": [97, True], "corrupted_ids": [97, 98], "answer": "e"},
     't.jsonl:2: "clean_ids" must be a non-empty list of token ids'),
    ({"clean": "ab", "corrupted": "ac", "answer_ids": [-1]}, 't.jsonl:2: "answer_ids" must be a token id'),
    ({"clean": "ab", "corrupted": "ac", "answer": "e", "answers": [{"position": 1}]},
     't.jsonl:2: give "answers" (several positions) or "answer" at one "position", not both'),
    ({"clean": "ab", "corrupted": "ac", "answers": [{"answer": "e"}]}, 't.jsonl:2: answers[0]: each of "answers" '
                                                                       'needs a "position"'),
    ({"clean": "ab", "corrupted": "ac", "answers": [{"position": "1", "answer": "e"}]},
     't.jsonl:2: answers[0]: "position" must be an integer'),
    ({"clean": "ab", "corrupted": "ac", "answers": []}, 't.jsonl:2: "answers" must be a non-empty list'),
    ({"clean": "ab", "corrupted": "ac"}, 't.jsonl:2: each line needs "clean", "corrupted" and "answer"'),
    ({"clean": "ab", "corrupted": "ac", "answers": [{"position": 1, "answer": "e", "wrong": "f"}, {"position": 2,
                                                                                                "answer": "e"}]},
     't.jsonl:2: a position without a wrong answer, where the first has one: give "wrong" at every position or at '
     'none'),
])
def test_bad_lines_are_refused_in_one_line_before_any_model(tmp_path, row, says):
    f = _write(tmp_path / "t.jsonl", [GOOD, row])
    with pytest.raises(ValueError) as e:
        read_task_file(f)
    assert says in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("row, metric, says", [
    ({"clean_ids": [256, 300], "corrupted_ids": [256, 97], "answer_ids": 1}, None,
     "t.jsonl:2: the clean prompt's token id 300 is outside the model's vocabulary (ids 0 to 256)"),
    ({"clean": "ab", "corrupted": "ac", "answer_ids": 257}, None,
     "t.jsonl:2: the answer id 257 at position -1 is outside the model's vocabulary"),
    ({"clean": "ab", "corrupted": "ac", "position": -4, "answer": "e"}, None,
     "t.jsonl:2: position -4 is outside the prompt of 3 tokens"),
    ({"clean": "ab", "corrupted": "ac", "answers": [{"position": 1, "answer": "e"}, {"position": 2}]}, "logit",
     "t.jsonl:2: position 2 has no answer; the logit metric needs one at every position (kl alone reads none)"),
    ({"clean": "ab", "corrupted": "ac", "answer": "e"}, "logit-diff",  # the first line has none either
     "t.jsonl:1: position -1 has no wrong answer; the logit-diff metric needs one"),
    ({"clean": "ab", "corrupted": "ac", "answer": "ef"}, None, "t.jsonl:2: the answer 'ef' is 2 tokens"),
])
def test_lines_the_model_cannot_read_are_refused_in_one_line_naming_it(model, tmp_path, row, metric, says):
    f = _write(tmp_path / "t.jsonl", [{k: v for k, v in GOOD.items() if k != "wrong"}, row])
    with pytest.raises(ValueError) as e:
        file_task(model, read_task_file(f), metric=metric)
    assert says in str(e.value) and "\n" not in str(e.value)


def test_tensor_tasks_name_the_row(model):
    clean, corrupted, answers, _ = _random(n=2, p=5, k=1)
    with pytest.raises(ValueError, match=r"^row 0: position 5 is outside the prompt of 5 tokens"):
        tensor_task(model, clean, corrupted, [5], answers)
    with pytest.raises(ValueError, match=r"answers \(2, 2\): give \[batch, k\]"):
        tensor_task(model, clean, corrupted, [1], torch.zeros(2, 2, dtype=torch.long))
    bad = clean.clone()
    bad[1, 2] = 999
    with pytest.raises(ValueError, match="^row 1: the clean prompt's token id 999 is outside"):
        tensor_task(model, bad, corrupted, [-1], answers)


# ---- the command ---------------------------------------------------------------------------------------
def test_the_command_runs_a_task_file_of_ids_at_several_positions(tmp_path):
    g = torch.Generator().manual_seed(0)
    rows = []
    for _ in range(4):
        seq = torch.randint(256, (6,), generator=g).tolist()
        other = torch.randint(256, (6,), generator=g).tolist()
        rows.append({"clean_ids": [BOS, *seq, *seq], "corrupted_ids": [BOS, *seq, *other],
                     "answers": [{"position": 6 + i, "answer_ids": seq[i]} for i in range(1, 6)]})
    f = _write(tmp_path / "ind.jsonl", rows)
    out = tmp_path / "out"
    assert cli(["circuit", "attn-only-2l", "--task", str(f), "--metric", "logit", "--method", "eap-ig", "--steps",
                "2", "--no-progress", "--out", str(out)]) == 0
    record = json.loads((out / "settings.json").read_text())
    assert record["metric"] == "logit" and record["answers"] == 20 and record["prompts"] == 4
    assert record["clean_metric"] > record["corrupted_metric"]


def test_eap_with_kl_is_one_line_before_loading(tmp_path, capsys, monkeypatch):
    f = _write(tmp_path / "kl.jsonl", [{"clean": "abc", "corrupted": "abd", "answers": [{"position": -1}]}])
    monkeypatch.setattr(interp, "load", lambda *a, **k: pytest.fail("loaded"))
    for extra in ([], ["--metric", "kl"]):
        assert cli(["circuit", "attn-only-2l", "--task", str(f), "--method", "eap", *extra,
                    "--out", str(tmp_path / "x")]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("error: EAP takes the metric's gradient") and "\n" not in err


# ---- the documentation's example -----------------------------------------------------------------------
def test_the_python_example_in_the_docs_runs():
    page = (Path(__file__).parents[3] / "docs" / "circuits.md").read_text()
    block = re.search(r"<!-- a task from tensors -->\s*```python\n(.*?)```", page, re.S)
    assert block, "docs/circuits.md has no example of a task from tensors"
    scope: dict = {}
    exec(compile(block.group(1), "docs/circuits.md", "exec"), scope)
    runner = scope["runner"]
    assert runner.clean_metric > runner.corrupted_metric
