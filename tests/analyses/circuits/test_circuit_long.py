"""Circuits over long prompts (issue 57, part 3): attribution block by block (`circuits.layered`) against the
whole-graph gradients on every configuration of ours, with position classes too; the senders' values
written into one tensor as they come; the passkey task built from the KV study's prompts; the memory
estimate and the command's refusals."""

from __future__ import annotations

import pytest
import torch

import interp
from interp.analyses.circuits import Graph, Runner
from interp.analyses.circuits.passes import _Pass, graph_mode
from interp.analyses.circuits.passkey import passkey_task
from interp.analyses.circuits.positions import each_position
from interp.analyses.circuits.cost import stage_bytes
from interp.analyses.circuits.runner import LAYERED_ABOVE, goes_by_layer
from interp.cli import main as cli

from circuit_tasks import random_task
from core_models import OWN_CONFIGS, build

NAMES = sorted(OWN_CONFIGS)
POINTS = {"eap": lambda r: r.eap(), "eap-ig inputs": lambda r: r.eap_ig(2, "inputs"),
          "eap-ig activations": lambda r: r.eap_ig(2, "activations")}


def _both(model, task, batch_size=2):
    return Runner(model, task, batch_size=batch_size, layered=False), Runner(model, task, batch_size=batch_size,
                                                                              layered=True)


@pytest.mark.parametrize("name", NAMES)
def test_block_by_block_attribution_is_the_whole_graphs(name):
    """The chain rule block by block gives the gradients of one backward through the whole model: every
    method's scores agree to float32 round-off (the sums' order differs), on every configuration."""
    model = build(OWN_CONFIGS[name])
    whole, layered = _both(model, random_task(model, n=3, p=7))
    for method, score in POINTS.items():
        want, got = score(whole), score(layered)
        assert want.abs().max() > 1e-3, method  # something to compare
        torch.testing.assert_close(got, want, rtol=1e-5, atol=2e-6 * float(want.abs().max()), msg=method)


def test_block_by_block_keeps_position_classes_apart_as_the_whole_graph_does():
    model = build(OWN_CONFIGS["rotary-rms-swiglu-gqa"])
    task = random_task(model, n=2, p=6)
    whole, layered = _both(model, task)
    pos = each_position(task)
    want, got = whole.eap_ig(2, positions=pos), layered.eap_ig(2, positions=pos)
    assert got.shape == want.shape == (len(whole.graph.senders), len(whole.graph.receivers), 6)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=2e-6 * float(want.abs().max()))
    torch.testing.assert_close(got.sum(-1), layered.eap_ig(2), rtol=1e-5, atol=2e-6 * float(want.abs().max()))


@pytest.mark.parametrize("name", ["rotary-rms-swiglu-gqa", "gemma3-like", "rotary-partial-parallel"])
def test_the_lean_cache_patches_as_the_whole_cache_does(name):
    """Block by block the runner keeps only each sender's corrupted - clean value and forms the corrupted values
    again, block by block, for a patched run: every patched run (edges, a circuit's faithfulness, resumed at a
    late block or only at the logits; nodes; position edges) and the QK attribution equal the full cache's."""
    from interp.analyses.circuits.positions import patched as position_patched

    model = build(OWN_CONFIGS[name])
    task = random_task(model, n=3, p=7)
    whole, lean = _both(model, task)
    assert lean.lean and not whole.lean and "diff" in lean._cache[0] and lean._cache[0]["clean"][0] is None
    g = whole.graph
    assert torch.equal(lean._cache[0]["diff"], whole._cache[0]["corrupted"][0] - whole._cache[0]["clean"][0])
    gen = torch.Generator().manual_seed(0)
    late = torch.zeros(len(g.senders), len(g.receivers))
    late[:, [r for r in range(len(g.receivers)) if g.receiver_layer[r] >= g.n_layers - 1]] = 1
    logits = torch.zeros_like(late)
    logits[:, -1] = 1
    masks = {"a random half": (torch.rand(late.shape, generator=gen) < 0.5).float(), "from the last block": late,
             "the logits only": logits, "a single edge": torch.zeros_like(late).index_put_((torch.tensor([0]),
                                                                                        torch.tensor([3])),
                                                                                       torch.tensor(1.0))}
    for what, mask in masks.items():
        want = whole.patched(mask)
        assert abs(want - whole.clean_metric) > 1e-6, what  # the patch changes something
        assert lean.patched(mask) == pytest.approx(want, rel=1e-5, abs=1e-6), what
    torch.testing.assert_close(lean.patch_nodes(), whole.patch_nodes(), rtol=1e-5, atol=1e-6)
    pos = each_position(task)
    pmask = (torch.rand(len(g.senders), len(g.receivers), pos.n_classes, generator=gen) < 0.3).float()
    assert position_patched(lean, pos, pmask) == pytest.approx(position_patched(whole, pos, pmask), rel=1e-5, abs=1e-6)
    head = (model.cfg.n_layers - 1, 0)
    want, got = whole.qk_attribution(head).pairs(), lean.qk_attribution(head).pairs()
    assert list(got.columns) == list(want.columns) and len(got) == len(want)
    for column in want.select_dtypes("number").columns:
        torch.testing.assert_close(torch.tensor(got[column].to_numpy()), torch.tensor(want[column].to_numpy()),
                                   rtol=1e-5, atol=1e-6, msg=column)


def test_eap_ig_at_the_left_points_starts_from_the_corrupted_run():
    """points="left" (EAP-IG's own k / steps): one step takes the gradient at the corrupted run itself, which
    is EAP on the task with clean and corrupted swapped, negated (EAP's difference is the other way round);
    two steps average that and the midpoint's one step."""
    import dataclasses

    model = build(OWN_CONFIGS["rotary-rms-swiglu-gqa"])
    task = random_task(model, n=3, p=7)
    swapped = dataclasses.replace(task, clean=task.corrupted, corrupted=task.clean)
    runner = Runner(model, task, batch_size=2)
    left = runner.eap_ig(1, points="left")
    want = -Runner(model, swapped, batch_size=2).eap()
    assert want.abs().max() > 1e-3
    torch.testing.assert_close(left, want, rtol=1e-5, atol=1e-6 * float(want.abs().max()))
    two = runner.eap_ig(2, points="left")  # points 0 and 1/2: the mean of the above and the 1-step midpoint
    torch.testing.assert_close(two, (left + runner.eap_ig(1)) / 2, rtol=1e-5, atol=1e-6 * float(want.abs().max()))
    assert not torch.allclose(left, runner.eap_ig(1))
    with pytest.raises(ValueError, match="'midpoint' or 'left'"):
        runner.eap_ig(2, points="right")


def test_senders_values_written_as_they_come_are_the_stacked_values():
    model = build(OWN_CONFIGS["gemma3-like"])  # sandwich norms: head shares computed in the pass
    task = random_task(model)
    g = Graph(model.cfg)
    runs = []
    for store in (None, len(g.senders)):
        p = _Pass(model, g, store=store)
        with torch.no_grad(), graph_mode(model), model.hooks(p.hooks()):
            model(task.clean, stop_at_layer=model.cfg.n_layers)
        runs.append(torch.stack(list(p.values)) if store is None else p.values.stacked)
    assert torch.equal(runs[0], runs[1])


def test_the_whole_graph_or_block_by_block_is_chosen_by_the_gradients_size():
    cfg = OWN_CONFIGS["rotary-rms-swiglu-gqa"]
    g = Graph(cfg)
    assert not goes_by_layer(g, cfg.d_model, 16, 20)
    edge = LAYERED_ABOVE // (len(g.receivers) * cfg.d_model * 4)  # positions at which the gradients reach it
    assert goes_by_layer(g, cfg.d_model, 1, edge + 1) and not goes_by_layer(g, cfg.d_model, 1, edge)
    assert not goes_by_layer(g, cfg.d_model, 2, edge // 2) and goes_by_layer(g, cfg.d_model, 2, edge // 2 + 1)
    # block by block, the working set holds one block's receivers, not the graph's
    assert stage_bytes(cfg, 1, 4096, 1, layered=True)["eap-ig"] < stage_bytes(cfg, 1, 4096, 1, layered=False)["eap-ig"]


@pytest.fixture(scope="module")
def zoo():
    return interp.load("rope-gqa-4l")


def test_the_passkey_task_differs_only_in_the_key_and_answers_its_first_digit(zoo):
    task = passkey_task(zoo, 256, 2, seed=1)
    assert task.clean.shape[1] <= 256 and task.n_answers == 2
    for i in range(2):
        clean, corrupted, at = task.clean[i], task.corrupted[i], int(task.positions[i])
        differ = (clean != corrupted).nonzero().flatten().tolist()
        assert differ and max(differ) < at, "the keys differ, in the needle only"
        assert zoo.to_string(clean[:at + 1]).rstrip().endswith("The pass key is")
        key, other = task.prompts[i].split()[1], task.prompts[i].split()[3].rstrip(",")
        assert zoo.to_string(clean[differ]) == "".join(a for a, b in zip(key * 2, other * 2) if a != b)
        # the answer read there is the clean key's first digit, the wrong one the other key's
        assert zoo.to_string(task.answer_tokens[i:i + 1]).strip() == key[0]


def test_the_command_refuses_a_length_it_cannot_use_in_one_line(tmp_path, capsys):
    assert cli(["circuit", "rope-gqa-4l", "--task", "ioi", "--length", "512", "--out", str(tmp_path / "a")]) == 2
    assert "--length sets the passkey task's prompt length" in capsys.readouterr().err
    assert cli(["circuit", "rope-gqa-4l", "--task", "passkey", "--length", "4096", "--out", str(tmp_path / "b")]) == 2
    assert "the passkey prompts need 128 .. 256 tokens" in capsys.readouterr().err


def test_a_passkey_circuit_runs_from_the_command(tmp_path):
    out = tmp_path / "pk"
    assert cli(["circuit", "rope-gqa-4l", "--task", "passkey", "--length", "256", "--method", "eap", "--prompts", "1",
                "--out", str(out), "--no-progress"]) == 0
    assert (out / "edges.parquet").exists() and (out / "faithfulness.csv").exists()


def test_a_long_prompts_pattern_view_keeps_the_positions_that_matter(zoo, monkeypatch):
    """Past PATTERN_MAX positions the report's patterns are the full patterns' rows and columns at the keys
    each head attends to most from the answer, the first token and the last few, read from one layer's
    pattern at a time (`attention_rows`: never the whole pattern); the movers' attention is the same as from full
    patterns."""
    import pandas as pd

    from interp.analyses.circuits import study

    task = passkey_task(zoo, 256, 1)
    heads = pd.DataFrame({"node": ["L3H1", "L1H0"], "layer": [3, 1], "head": [1, 0], "score": [2.0, 1.0]})
    monkeypatch.setattr(study, "PATTERN_MAX", 128)
    names, stack, strings = study._patterns(zoo, task, heads)
    n = int(task.positions.max()) + 1
    _, cache = zoo.run_with_cache(task.clean[:1, :n])
    shown = [int(s.rsplit("@", 1)[1]) for s in strings]
    assert names == ["L3H1", "L1H0"] and len(shown) < n and 0 in shown and n - 1 in shown
    answer = [cache["pattern", l][0, h, n - 1] for l, h in ((3, 1), (1, 0))]
    for a in answer:  # each head's most attended keys are among those shown
        assert set(a.topk(study.PATTERN_KEYS).indices.tolist()) <= set(shown)
    at = torch.tensor(shown)
    want = torch.stack([cache["pattern", l][0, h][at][:, at] for l, h in ((3, 1), (1, 0))])
    torch.testing.assert_close(torch.as_tensor(stack), want)
    edges = pd.DataFrame({"sender": ["L3H1", "L1H0"], "receiver": ["logits", "logits"], "score": [2.0, 1.0]})
    movers = study._movers(zoo, task, edges)
    rows, pos = task.rows, task.positions
    on = task.clean[rows]
    for (l, h), got in zip(((3, 1), (1, 0)), movers.attention_to_answer):
        full = zoo.run_with_cache(task.clean)[1]["pattern", l][rows, h, pos]
        # Two float32 computations of the same attention weights (the study's rows from q and k, this the whole
        # cache's pattern): they agree to float32 round-off, about 1e-7 per term
        # relative, not to approx's default 1e-6 (2.3e-6 apart on an AVX-512 / AMX Xeon).
        want = float((full * (on == task.answer_tokens[:, None])).sum()) / task.n_answers
        assert got == pytest.approx(want, rel=1e-5, abs=1e-7)


def test_the_command_takes_eap_igs_own_points(tmp_path):
    """--ig-points left: the scores of `Runner.eap_ig(steps, points="left")`, recorded in settings.json."""
    import json

    import pandas as pd

    from interp.analyses.circuits.tasks import induction_task

    out = tmp_path / "left"
    assert cli(["circuit", "attn-only-2l", "--task", "induction", "--prompts", "4", "--steps", "2", "--ig-points",
                "left", "--out", str(out), "--no-progress"]) == 0
    assert json.loads((out / "settings.json").read_text())["ig_points"] == "left"
    edges = pd.read_parquet(out / "edges.parquet")
    model = interp.load("attn-only-2l")
    runner = Runner(model, induction_task(model, n_prompts=4, seed=0))
    want = runner.graph.edge_frame(runner.eap_ig(2, points="left"))
    assert edges.method.iloc[0] == "eap-ig (inputs, 2 left steps)"
    torch.testing.assert_close(torch.tensor(edges.score.to_numpy()), torch.tensor(want.score.to_numpy()))


def test_block_by_block_the_curve_is_measured_at_fewer_sizes_and_no_edge_is_the_corrupted_run(tmp_path, monkeypatch):
    """Long prompts (block by block) take LONG_FRACTIONS: the curve has those sizes, the empty circuit costs no
    patched run and is 0 by definition, which is what patching every edge gives (run here, to float32 round-off);
    the report says why the curve is short; the time estimate counts only the runs made."""
    import pandas as pd

    from interp.analyses.circuits import runner as runner_module
    from interp.analyses.circuits.cost import stage_seconds
    from interp.analyses.circuits.graph import FRACTIONS, LONG_FRACTIONS

    model = build(OWN_CONFIGS["rotary-rms-swiglu-gqa"])
    whole, lean = _both(model, random_task(model, n=3, p=7))
    empty = torch.zeros_like(lean.graph.allowed)
    every = lean.patched(lean.graph.allowed.float())  # every edge patched, run
    assert (every - lean.corrupted_metric) / (lean.clean_metric - lean.corrupted_metric) == pytest.approx(0, abs=1e-5)
    runs = []
    monkeypatch.setattr(Runner, "patched_many", lambda self, masks, **k: runs.append(len(masks)) or [0.0] * len(masks))
    assert lean.faithfulness(empty) == 0.0 and runs == []  # not run
    whole.faithfulness(empty)
    assert runs == [1]  # the whole graph runs it: a check of the patching
    monkeypatch.undo()

    out = tmp_path / "long"
    monkeypatch.setattr(runner_module, "goes_by_layer", lambda *a, **k: True)  # block by block at a short length
    assert cli(["circuit", "rope-gqa-4l", "--task", "induction", "--prompts", "4", "--method", "eap", "--out", str(out),
                "--no-progress"]) == 0
    curve = pd.read_csv(out / "faithfulness.csv")
    assert tuple(curve.fraction) == LONG_FRACTIONS and curve.faithfulness.iloc[0] == 0.0
    assert "is measured at 1%, 5%, 20% of the edges only" in (out / "report.md").read_text()
    cfg = model.cfg
    flops = 1e9
    _, notes, _ = stage_seconds(cfg, 2, 64, method="eap", flops=flops, layered=False)
    _, long_notes, _ = stage_seconds(cfg, 2, 64, method="eap", flops=flops, layered=True)
    assert notes["faithfulness"].startswith(f"{len(FRACTIONS) - 1} patched runs")
    assert long_notes["faithfulness"].startswith(f"{len(LONG_FRACTIONS) - 2} patched runs")
