"""Position-resolved edges (`interp.analyses.circuits.positions`): exact patching at one class against the
intervention written with hooks by hand, EAP per position summing to the position-free scores, a mask over
every position of an edge being the edge's own patch, IOI's class labels decoded, bad input in one line, and
the command's position tables."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pandas as pd
import pytest
import torch

import interp
from interp.analyses.circuits import Runner
from interp.analyses.circuits import positions as P
from interp.analyses.circuits.tasks import ioi_task
from interp.analyses.store import read_table
from interp.cli import main as cli

from circuit_tasks import add_to_head, by_hand_metric, head_delta, random_task
from core_models import OWN_CONFIGS, build
from smol import needs_smol


def classed_task(model, n: int = 3, p: int = 7):
    task = random_task(model, n, p)
    # A at position 2, B at positions 4 and 5 of every prompt, the rest "other"
    task.position_classes = {"A": [2] * n, "B": [[4, 5]] * n}
    return task


@pytest.fixture(scope="module")
def two_layer():
    model = interp.load("attn-only-2l")
    return model, Runner(model, classed_task(model, n=4, p=9), batch_size=3)  # two chunks


def test_classes_are_labelled_with_the_rest_as_other(two_layer):
    _, runner = two_layer
    pos = P.task_classes(runner.task)
    assert pos.names == ("A", "B", "other")
    assert pos.labels[0].tolist() == [2, 2, 0, 2, 1, 1, 2, 2, 2]
    each = P.each_position(runner.task)
    assert each.n_classes == 9 and each.labels[3].tolist() == list(range(9))


@pytest.mark.parametrize("name", ["learned-layernorm", "rotary-rms-swiglu-gqa"])
def test_exact_position_patching_is_the_intervention_written_out_by_hand(name):
    model = build(OWN_CONFIGS[name])
    task = classed_task(model)
    runner = Runner(model, task)
    pos = P.task_classes(task)
    g = runner.graph
    last = model.cfg.n_layers - 1
    s, r, c = g.senders.index("L0H1"), g.receivers.index(f"L{last}H2"), pos.index("B")
    delta = head_delta(model, task.clean, task.corrupted, 0, 1)
    at = torch.zeros(delta.shape[:2], dtype=torch.bool)
    at[:, [4, 5]] = True  # class B's positions only
    want = by_hand_metric(model, task, [(f"blocks.{last}.hook_q_input", add_to_head(2, delta * at[..., None]))],
                          split_qkv=True)
    got = P.patch_edges(runner, pos, [(s, r, c)])[s, r, c]
    assert float(got) == pytest.approx(want - runner.clean_metric, abs=1e-4)
    assert abs(want - runner.clean_metric) > 1e-4  # the patch does something
    # into the logits at class A (position 2 is not an answer position: nothing changes) and at "other"
    r_logits = len(g.receivers) - 1
    at_a = P.patch_edges(runner, pos, [(s, r_logits, pos.index("A"))])[s, r_logits, 0]
    assert float(at_a) == pytest.approx(0, abs=1e-6)
    other = torch.ones(delta.shape[:2], dtype=torch.bool)
    other[:, [2, 4, 5]] = False
    want = by_hand_metric(model, task, [(f"blocks.{last}.hook_resid_post",
                                         lambda x, hook: x + delta * other[..., None])])
    got = P.patch_edges(runner, pos, [(s, r_logits, pos.index("other"))])[s, r_logits, pos.index("other")]
    assert float(got) == pytest.approx(want - runner.clean_metric, abs=1e-4)


@pytest.mark.parametrize("name", ["learned-layernorm", "rotary-rms-swiglu-gqa", "rotary-partial-parallel"])
def test_eap_per_position_sums_to_the_position_free_scores(name):
    model = build(OWN_CONFIGS[name])
    runner = Runner(model, classed_task(model, n=5), batch_size=2)
    for pos in (P.task_classes(runner.task), P.each_position(runner.task)):
        per = runner.eap(positions=pos)
        assert per.shape == runner.graph.allowed.shape + (pos.n_classes,)
        torch.testing.assert_close(per.sum(2), runner.eap(), rtol=1e-5, atol=1e-6)
        ig = runner.eap_ig(2, positions=pos)
        torch.testing.assert_close(ig.sum(2), runner.eap_ig(2), rtol=1e-5, atol=1e-6)
    ig = runner.eap_ig(2, "activations", positions=P.task_classes(runner.task))
    torch.testing.assert_close(ig.sum(2), runner.eap_ig(2, "activations"), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", ["learned-layernorm", "rotary-rms-swiglu-gqa", "rotary-partial-parallel"])
def test_a_mask_over_every_position_is_the_position_free_patch(name, monkeypatch):
    model = build(OWN_CONFIGS[name])
    runner = Runner(model, classed_task(model))
    g = runner.graph
    pos = P.task_classes(runner.task)
    s, r = g.senders.index("L0H1"), g.receivers.index("L1H2")
    one = torch.zeros(g.allowed.shape)
    one[s, r] = 1
    assert P.patched(runner, pos, one[..., None].expand(-1, -1, 3).clone()) == pytest.approx(runner.patched(one),
                                                                                             abs=1e-5)
    # many edges (the buffer's sum less the kept ones), and the classes adding up
    gen = torch.Generator().manual_seed(0)
    many = (torch.rand(g.allowed.shape, generator=gen) < 0.7).float()
    full = P.patched(runner, pos, many[..., None].expand(-1, -1, 3).clone())
    assert full == pytest.approx(runner.patched(many), abs=1e-5)
    each = P.each_position(runner.task)
    assert P.patched(runner, each, many[..., None].expand(-1, -1, each.n_classes).clone()) == pytest.approx(full,
                                                                                                            abs=1e-5)
    everything = P.faithfulness(runner, pos, torch.zeros(g.allowed.shape + (3,), dtype=torch.bool))
    assert everything == pytest.approx(0.0, abs=1e-4)
    assert P.faithfulness(runner, pos, g.allowed[..., None].expand(-1, -1, 3)) == pytest.approx(1.0)


def test_selection_and_curve(two_layer):
    _, runner = two_layer
    pos = P.task_classes(runner.task)
    scores = runner.eap(positions=pos)
    top = P.select_positions(runner.graph, scores, 5)
    assert int(top.sum()) <= 5 and not (top & ~runner.graph.allowed[..., None]).any()
    curve = P.faithfulness_curve(runner, pos, scores, (0.0, 0.1, 1.0))
    assert curve.faithfulness.iloc[-1] == pytest.approx(1.0) and abs(curve.faithfulness.iloc[0]) < 1e-4
    assert curve.edges.iloc[-1] == runner.graph.n_edges * 3
    frame = P.edge_frame(runner.graph, pos, scores)
    assert set(frame.position) <= {"A", "B", "other"} and list(frame.columns) == ["sender", "receiver", "input",
                                                                                  "position", "score"]


# ---- IOI's classes --------------------------------------------------------------------------------------
class WordModel:
    """A stand-in with a word-level tokenizer: enough for `ioi_task` to build prompts and labels."""

    def __init__(self):
        from interp.analyses.circuits.tasks import IOI_TEMPLATES, NAMES, OBJECTS, PLACES

        words = set(NAMES) | set(PLACES) | set(OBJECTS)
        for t in IOI_TEMPLATES:
            words |= set(t.replace(",", " ,").replace(".", " .").split())
        self.vocab = ["<bos>"] + sorted(words)
        self.ids = {w: i for i, w in enumerate(self.vocab)}
        self.cfg = SimpleNamespace(n_ctx=64, d_vocab=len(self.vocab))
        self.tokenizer = SimpleNamespace(pad_token_id=0)

    def to_tokens(self, text, prepend_bos=True, truncate=True):
        ids = [self.ids[w] for w in text.replace(",", " ,").replace(".", " .").split()]
        return torch.tensor([([0] if prepend_bos else []) + ids])

    def decode(self, i: int) -> str:
        return self.vocab[i]


def test_ioi_class_labels_point_at_the_names():
    from interp.analyses.circuits.tasks import NAMES

    model = WordModel()
    task = ioi_task(model, 16, seed=3)
    pos = P.task_classes(task)
    assert pos.names == ("S1", "S2", "IO", "END", "other")
    for i in range(16):
        words = [model.decode(t) for t in task.clean[i].tolist()]
        at = {name: (pos.labels[i] == c).nonzero().flatten().tolist() for c, name in enumerate(pos.names)}
        s1, s2, io, end = (words[at[n][0]] for n in ("S1", "S2", "IO", "END"))
        assert s1 == s2 and s1 in NAMES and io in NAMES and io != s1
        assert at["S1"][0] < at["S2"][0] and end == "to" and at["END"][0] == int(task.positions[i])
        assert model.ids[io] == int(task.answer_tokens[i]) and model.ids[s1] == int(task.wrong_tokens[i])
        assert len(at["S1"]) == len(at["S2"]) == len(at["IO"]) == len(at["END"]) == 1
        assert not any(w in NAMES for j, w in enumerate(words) if j in at["other"])


# ---- bad input --------------------------------------------------------------------------------------------
def test_bad_classes_are_one_line(two_layer):
    _, runner = two_layer
    task = runner.task
    with pytest.raises(ValueError, match=r"^unknown position class 'C': this task's are A, B$"):
        P.positions_for(task, "A,C")
    with pytest.raises(ValueError, match="unknown position class 'C'"):
        P.task_classes(task).index("C")
    bad = classed_task(runner.model, n=4, p=9)
    bad.position_classes = {"A": [2, None, 3, []], "B": [4] * 4}
    with pytest.raises(ValueError, match=r"'A' is missing from prompt\(s\) 1, 3 of 4: classes must be shared"):
        P.task_classes(bad)
    labels = torch.zeros(4, 9, dtype=torch.long)
    labels[0, 3] = 1  # class 1 in prompt 0 only
    bad.position_classes = labels
    with pytest.raises(ValueError, match=r"position class 1 is missing from prompt\(s\) 1, 2, 3 of 4"):
        P.task_classes(bad)
    bad.position_classes = {"A": [2] * 4, "B": [2] * 4}
    with pytest.raises(ValueError, match="position 2 of prompt 0 is in two classes"):
        P.task_classes(bad)
    bad.position_classes = None
    with pytest.raises(ValueError, match="names no position classes"):
        P.positions_for(bad, "classes")
    for err in (lambda: P.patched(runner, P.task_classes(task), torch.zeros(3, 3, 3)),):
        with pytest.raises(ValueError, match="a position mask is"):
            err()


def test_the_command_refuses_classes_a_task_lacks_in_one_line(tmp_path, capsys):
    code = cli(["circuit", "attn-only-2l", "--task", "induction", "--positions", "classes", "--no-progress",
                "--out", str(tmp_path / "x")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code != 0 and len(err) == 1 and "names no position classes" in err[0]
    code = cli(["circuit", "attn-only-2l", "--task", "ioi", "--positions", "S2,XX", "--no-progress",
                "--out", str(tmp_path / "y")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code != 0 and len(err) == 1 and "unknown position class 'XX'" in err[0]


def test_the_command_writes_the_position_curve_beside_the_plain_one(tmp_path):
    out = tmp_path / "ind"
    assert cli(["circuit", "attn-only-2l", "--task", "induction", "--prompts", "4", "--method", "eap",
                "--positions", "each", "--no-progress", "--out", str(out)]) == 0
    plain = pd.read_csv(out / "faithfulness.csv")
    curve = pd.read_csv(out / "position_faithfulness.csv")
    assert list(curve.columns) == ["fraction", "edges", "faithfulness"] and len(curve) == len(plain)
    assert curve.faithfulness.iloc[-1] == pytest.approx(1.0)
    edges = read_table(out, "position_edges")
    assert {"sender", "receiver", "position", "score"} <= set(edges.columns)
    record = json.loads((out / "settings.json").read_text())
    assert record["positions"]["mode"] == "each" and record["positions"]["classes"] == 41
    assert "Position-resolved" in (out / "report.html").read_text()


@pytest.mark.slow
@needs_smol
def test_smollm2_ioi_classes_decode_to_the_names(smollm2):
    model = smollm2  # the suite's one SmolLM2 (tests/conftest.py)
    task = ioi_task(model, 8)
    pos = P.task_classes(task)
    for i in range(8):
        ids = task.clean[i].tolist()
        word = {name: model.to_string(torch.tensor([ids[int((pos.labels[i] == c).nonzero()[0])]]))
                for c, name in enumerate(pos.names[:4])}
        assert word["S1"] == word["S2"] != word["IO"] and word["END"] == " to"
        assert model.to_tokens(word["IO"], prepend_bos=False)[0].tolist() == [int(task.answer_tokens[i])]
