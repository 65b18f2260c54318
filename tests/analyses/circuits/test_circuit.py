"""Circuits (`interp.analyses.circuits`, `interp circuit`): the graph, exact patching against the same
intervention written out by hand with the model's own hooks, EAP and EAP-IG against gradients taken by
hand, a model whose circuit is known by construction, selection and pruning, the tasks' checks, and the
command."""

from __future__ import annotations

import json

import pandas as pd
import pytest
import torch

import interp
from interp.analyses import circuits as C
from interp.analyses.circuits import runner as circuit_runner
from interp.analyses.circuits import Graph, Runner, prune_dangling, select
from interp.analyses.circuits.tasks import file_task, induction_task, read_task_file
from interp.analyses.store import read_table
from interp.cli import main as cli

from circuit_tasks import add_to_head, by_hand_metric, head_delta, random_task
from core_models import OWN_CONFIGS, build
from smol import needs_smol

NAMES = sorted(OWN_CONFIGS)


def test_the_graph_of_the_zoo_model():
    g = Graph(interp.load("attn-only-2l").cfg)  # 2 layers of 4 heads, attention only
    assert g.senders == ["embed"] + [f"L{l}H{h}" for l in range(2) for h in range(4)]
    assert len(g.receivers) == 2 * 12 + 1 and g.receivers[-1] == "logits"
    # layer 0's 12 inputs read the embeddings; layer 1's read embed + 4 heads; the logits all 9 senders
    assert g.n_edges == 12 * 1 + 12 * 5 + 9


def test_gqa_keys_and_values_are_one_receiver_per_kv_head_and_mlps_read_their_layers_heads():
    g = Graph(OWN_CONFIGS["rotary-rms-swiglu-gqa"])  # 6 query heads, 2 KV heads, MLPs
    assert [g.inputs[r] for r, n in enumerate(g.receivers) if n == "L1KV1"] == ["k", "v"]
    r = g.receivers.index("L1KV1")
    assert [g.senders[s] for s in g.receiver_senders[r]] == ["L1H3", "L1H4", "L1H5"]
    mlp1, s = g.receivers.index("MLP1"), g.senders.index("L1H0")
    assert g.allowed[s, mlp1] and not g.allowed[g.senders.index("MLP1"), mlp1]
    par = Graph(OWN_CONFIGS["rotary-partial-parallel"])  # a parallel block's MLP reads beside attention
    assert not par.allowed[par.senders.index("L1H0"), par.receivers.index("MLP1")]
    assert par.allowed[par.senders.index("MLP0"), par.receivers.index("MLP1")]


@pytest.mark.parametrize("name", NAMES)
def test_senders_add_up_to_the_stream_and_patching_everything_is_the_corrupted_run(name):
    model = build(OWN_CONFIGS[name])
    task = random_task(model)
    runner = Runner(model, task)
    values, _, final = runner._cache[0]["clean"]
    biases = sum(b.attn.b_O for b in model.blocks if getattr(b.attn, "b_O", None) is not None
                 and not model.cfg.sandwich_norms)
    torch.testing.assert_close(values.sum(0) + biases, final, atol=2e-5, rtol=1e-5)
    assert runner.clean_metric == pytest.approx(by_hand_metric(model, task), abs=1e-5)
    g = runner.graph
    assert runner.patched(g.allowed.float()) == pytest.approx(runner.corrupted_metric, abs=1e-4)
    assert runner.patched(torch.zeros(g.allowed.shape)) == runner.clean_metric


def _head_value(model, cache, layer: int, head: int):
    return cache[f"blocks.{layer}.attn.hook_result"][:, :, head]


@pytest.mark.parametrize("name", ["learned-layernorm", "rotary-rms-swiglu-gqa", "alibi-window-untied-bias"])
def test_exact_edge_patching_is_the_intervention_written_out_by_hand(name):
    model = build(OWN_CONFIGS[name])
    task = random_task(model)
    runner = Runner(model, task)
    g = runner.graph
    last = model.cfg.n_layers - 1
    s, r = g.senders.index("L0H1"), g.receivers.index(f"L{last}H2")  # a head into a later head's query
    delta = head_delta(model, task.clean, task.corrupted, 0, 1)
    want = by_hand_metric(model, task, [(f"blocks.{last}.hook_q_input", add_to_head(2, delta))], split_qkv=True)
    mask = torch.zeros(g.allowed.shape)
    mask[s, r] = 1
    assert runner.patch_edges([(s, r)])[s, r] == pytest.approx(want - runner.clean_metric, abs=1e-4)
    # into the logits: the final stream moved by the sender's change
    r_logits = len(g.receivers) - 1
    want = by_hand_metric(model, task, [(f"blocks.{last}.hook_resid_post", lambda x, hook: x + delta)])
    assert runner.patch_edges([(s, r_logits)])[s, r_logits] == pytest.approx(want - runner.clean_metric, abs=1e-4)


@pytest.mark.parametrize("name", ["learned-layernorm", "rotary-rms-swiglu-gqa"])
def test_eap_and_eap_ig_are_the_gradient_taken_by_hand(name):
    model = build(OWN_CONFIGS[name])
    task = random_task(model)
    runner = Runner(model, task)
    g = runner.graph
    s, r = g.senders.index("L0H1"), g.receivers.index("L1H2")
    names = lambda n: n.endswith("hook_result") or n == "blocks.0.hook_resid_pre"
    _, clean = model.run_with_cache(task.clean, names_filter=names)
    _, corrupt = model.run_with_cache(task.corrupted, names_filter=names)
    delta = _head_value(model, corrupt, 0, 1) - _head_value(model, clean, 0, 1)
    e_clean, e_corrupt = clean["blocks.0.hook_resid_pre"], corrupt["blocks.0.hook_resid_pre"]

    def gradient(alpha=None) -> torch.Tensor:
        seen = {}

        def embed(x, hook):
            return (x if alpha is None else e_corrupt + alpha * (e_clean - e_corrupt)).detach().requires_grad_(True)

        def keep(x, hook):
            seen["x"] = x
            return x

        model.set_use_split_qkv_input(True)
        try:
            logits = model.run_with_hooks(task.clean, fwd_hooks=[("blocks.0.hook_resid_pre", embed),
                                                                 ("blocks.1.hook_q_input", keep)])
            metric = task.metric(logits[task.rows, task.positions], torch.arange(task.n_answers)).mean()
            return torch.autograd.grad(metric, seen["x"])[0][:, :, 2]
        finally:
            model.set_use_split_qkv_input(False)

    assert float(runner.eap()[s, r]) == pytest.approx(float((delta * gradient()).sum()), rel=1e-4, abs=1e-6)
    ig = sum(gradient(a) for a in (0.25, 0.75)) / 2  # two midpoints
    assert float(runner.eap_ig(2)[s, r]) == pytest.approx(float((delta * ig).sum()), rel=1e-4, abs=1e-6)


def test_a_circuit_known_by_construction():
    """Only L1H2 writes to the stream (every other head's W_O is zero): the edges that can matter are
    embed -> logits, embed -> L1H2's q, k and v, and L1H2 -> logits. Every score elsewhere is 0 by every
    method, and those edges alone are the whole behaviour (faithfulness 1)."""
    model = build(OWN_CONFIGS["no-positions-attn-only"])
    with torch.no_grad():
        for l, block in enumerate(model.blocks):
            for h in range(model.cfg.n_heads):
                if (l, h) != (1, 2):
                    block.attn.W_O[h] = 0
    task = random_task(model, n=4, p=8)
    runner = Runner(model, task)
    g = runner.graph
    expected = {("embed", "logits"), ("embed", "L1H2"), ("L1H2", "logits")}
    exact, eap, ig = runner.patch_edges(), runner.eap(), runner.eap_ig(3)
    for scores in (exact, eap, ig):
        frame = g.edge_frame(scores)
        found = frame[frame.score.abs() > 1e-6]
        assert set(zip(found.sender, found.receiver)) <= expected
        assert len(found) >= 3
    circuit = select(g, ig, 5)
    assert {(g.senders[s], g.receivers[r]) for s, r in circuit.nonzero().tolist()} <= expected
    assert runner.faithfulness(circuit) == pytest.approx(1.0, abs=1e-4)


def test_pruning_drops_edges_without_a_path_from_the_embeddings_or_to_the_logits():
    g = Graph(interp.load("attn-only-2l").cfg)
    edge = lambda s, r, inp: (g.senders.index(s), next(i for i, n in enumerate(g.receivers) if n == r and g.inputs[i] == inp))
    c = torch.zeros(g.allowed.shape, dtype=torch.bool)
    for s, r, inp in (("embed", "L0H1", "v"), ("L0H1", "logits", "-"),  # a path: kept
                      ("L0H2", "logits", "-"),  # L0H2 receives nothing: dropped
                      ("embed", "L1H3", "q")):  # L1H3 sends nothing: dropped
        c[edge(s, r, inp)] = True
    kept = {(g.senders[s], g.receivers[r]) for s, r in prune_dangling(g, c).nonzero().tolist()}
    assert kept == {("embed", "L0H1"), ("L0H1", "logits")}


def test_greedy_grows_from_the_logits():
    g = Graph(interp.load("attn-only-2l").cfg)
    scores = torch.rand(g.allowed.shape, generator=torch.Generator().manual_seed(0)) * g.allowed
    scores[g.senders.index("embed"), g.receivers.index("L0H0")] = 100  # the largest, but not reachable first
    picked = C.greedy_edges(g, scores, 1)
    (s, r), = picked.nonzero().tolist()
    assert g.receivers[r] == "logits"
    assert C.top_edges(g, scores, 1)[g.senders.index("embed"), g.receivers.index("L0H0")]


def test_induction_on_the_zoo_model_finds_its_induction_head():
    model = interp.load("attn-only-2l")
    runner = Runner(model, induction_task(model, 16, 12))
    nodes = runner.eap_ig(3).sum(1)
    g = runner.graph
    assert g.senders[int(nodes[1:].abs().argmax()) + 1] == "L1H0"  # the atlas's induction head


# ---- the tasks' checks ------------------------------------------------------------------------------------
def test_task_files_are_checked_line_by_line(tmp_path):
    f = tmp_path / "pairs.jsonl"
    f.write_text('{"clean": "ab", "corrupted": "cd", "answer": "e"}\nnot json\n')
    with pytest.raises(ValueError, match="pairs.jsonl:2: not JSON"):
        read_task_file(f)
    f.write_text('{"clean": "ab", "answer": "e"}\n')
    with pytest.raises(ValueError, match='needs "clean", "corrupted" and "answer"'):
        read_task_file(f)


def test_bad_pairs_are_refused_in_one_line():
    model = interp.load("attn-only-2l")  # bytes: one token per character
    with pytest.raises(ValueError, match="pair 2: the corrupted prompt is 5 tokens and the clean one 4"):
        file_task(model, [{"clean": "abc", "corrupted": "abd", "answer": ["e"]},
                          {"clean": "abc", "corrupted": "abcd", "answer": ["e"]}])
    with pytest.raises(ValueError, match="pair 1: the answer 'ef' is 2 tokens"):
        file_task(model, [{"clean": "abc", "corrupted": "abd", "answer": ["ef"]}])
    same = file_task(model, [{"clean": "abc", "corrupted": "abc", "answer": ["e"]}])
    with pytest.raises(ValueError, match="does not differ between clean and corrupted"):
        Runner(model, same)


# ---- the command ----------------------------------------------------------------------------------------
def test_the_command_writes_its_tables_and_report(tmp_path):
    out = tmp_path / "ind"
    assert cli(["circuit", "attn-only-2l", "--task", "induction", "--prompts", "8", "--method", "eap-ig",
                "--steps", "2", "--oracle", "edges", "--no-progress", "--out", str(out)]) == 0
    edges, nodes = read_table(out, "edges"), read_table(out, "nodes")
    assert list(edges.columns[:5]) == ["sender", "receiver", "input", "score", "method"] and len(edges) == 81
    assert set(edges.input) == {"q", "k", "v", "-"} and "exact" in edges
    assert {"node", "layer", "head", "kind", "score", "in_circuit"} <= set(nodes.columns)
    curve = pd.read_csv(out / "faithfulness.csv")
    assert list(curve.columns) == ["fraction", "edges", "faithfulness"]
    assert curve.faithfulness.iloc[-1] == pytest.approx(1.0) and abs(curve.faithfulness.iloc[0]) < 1e-6
    record = json.loads((out / "settings.json").read_text())
    assert record["study"] == "circuit" and record["method"] == "eap-ig" and record["steps"] == 2
    assert "edges" in record["agreement_spearman"] and record["roles"]["induction"][0]["head"] == "L1H0"
    page = (out / "report.html").read_text()
    assert "<svg" in page and 'id="patterns"' in page and "L1H0" in page


@pytest.mark.parametrize("argv, says", [
    (["--task", "parity"], "unknown task 'parity'"),
    (["--task", "ioi", "--steps", "0"], "--steps must be at least 1"),
    (["--task", "ioi", "--metric", "accuracy"], "unknown metric 'accuracy'"),
    (["--task", "ioi", "--size", "0"], "--size is a fraction"),
])
def test_bad_settings_are_one_line_before_loading(tmp_path, capsys, monkeypatch, argv, says):
    monkeypatch.setattr(interp, "load", lambda *a, **k: pytest.fail("loaded"))
    assert cli(["circuit", "attn-only-2l", *argv, "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and says in err and "\n" not in err
    assert not (tmp_path / "x").exists()


def test_exact_edge_patching_past_its_limit_says_what_to_use(tmp_path, capsys, monkeypatch):
    from interp.analyses.circuits import study as circuit_study

    monkeypatch.setattr(circuit_study, "MAX_PATCHED_EDGES", 50)
    monkeypatch.setattr(interp, "load", lambda *a, **k: pytest.fail("loaded"))
    assert cli(["circuit", "attn-only-2l", "--task", "induction", "--method", "patching", "--out",
                str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert "81 edges (at most 50)" in err and "--method eap-ig" in err


def test_the_commands_choices_are_the_engines():
    """One definition (interp.analyses.circuits.choices, torch-free), not a copy the CLI keeps in step."""
    from interp.analyses.circuits import runner
    from interp.commands import circuit as command

    assert command.METHODS is C.METHODS and command.IG_ON is C.IG_ON and command.SELECTIONS is C.SELECTIONS
    assert command.IG_POINTS is runner.IG_POINTS


@pytest.mark.parametrize("name", ["learned-layernorm", "gemma3-like", "rotary-partial-parallel"])
def test_node_patching_where_the_sender_writes_equals_patching_all_its_edges(name):
    model = build(OWN_CONFIGS[name])
    runner = Runner(model, random_task(model))
    g = runner.graph
    fast = runner.patch_nodes()
    for s in range(len(g.senders)):
        mask = torch.zeros(g.allowed.shape)
        mask[s] = 1
        assert float(fast[s]) == pytest.approx(runner.patched(mask) - runner.clean_metric, abs=2e-5), g.senders[s]


@pytest.mark.parametrize("name", ["rotary-rms-swiglu-gqa", "gemma3-like", "rotary-partial-parallel", "learned-layernorm"])
def test_a_run_with_many_edges_patched_is_the_same_stacked_or_from_the_buffer(name, monkeypatch):
    """The buffer's two forms (the patched senders, or the running sum less the kept ones) against the
    stacked one, with most edges patched and with few."""
    model = build(OWN_CONFIGS[name])
    runner = Runner(model, random_task(model))
    g = runner.graph
    gen = torch.Generator().manual_seed(1)
    for patched in (0.98, 0.7, 0.05):
        mask = (torch.rand(g.allowed.shape, generator=gen) < patched).float()
        mask[torch.rand(g.allowed.shape, generator=gen) < 0.05] = 0.5  # a mixed edge too
        monkeypatch.setattr(circuit_runner._Patching, "STACK", 0)
        buffered = runner.patched(mask)
        monkeypatch.setattr(circuit_runner._Patching, "STACK", 10_000)
        assert buffered == pytest.approx(runner.patched(mask), abs=2e-5), patched


# ---- on a real model ------------------------------------------------------------------------------------
@pytest.mark.slow
@needs_smol
def test_smollm2_ioi_and_greater_than(smollm2):
    """SmolLM2 does IOI (the indirect object beats the subject) and greater-than (later years beat earlier
    ones, and the corrupted ..01 start removes most of it); EAP-IG's node ranking follows exact patching."""
    from interp.analyses._common import spearman
    from interp.analyses.circuits.tasks import greater_than_task, ioi_task

    model = smollm2  # the suite's one SmolLM2 (tests/conftest.py)
    ioi = ioi_task(model, 8)
    assert (ioi.clean != ioi.corrupted).any(1).all() and ioi.clean.shape == ioi.corrupted.shape
    runner = Runner(model, ioi)
    assert runner.clean_metric > 1.0 > runner.corrupted_metric
    some = list(range(0, len(runner.graph.senders), 4))  # a quarter of the nodes, for time
    nodes = runner.patch_nodes(some)[some]
    assert spearman(runner.eap_ig(2).sum(1)[some].abs(), nodes.abs()) > 0.6
    gt = Runner(model, greater_than_task(model, 8))
    assert gt.clean_metric > 0.2 and gt.clean_metric > gt.corrupted_metric + 0.1


def test_the_circuit_drawn_by_default_is_the_smallest_faithful_one():
    from interp.analyses.circuits.study import chosen_size

    curve = pd.DataFrame({"fraction": [0.0, 0.01, 0.02, 0.05, 1.0], "faithfulness": [0.0, 0.5, 0.85, 0.7, 1.0]})
    assert chosen_size(curve) == 0.02
    assert chosen_size(curve.assign(faithfulness=[0, 0.1, 0.2, 0.3, 1.0])) == 0.05  # none below 100%: 5%
