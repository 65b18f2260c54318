"""What a circuit run holds, and its estimate (issue 65, defects 5 and 8): EAP-IG's points made one at a time and
absurd steps refused in one line before any run; a long-prompt runner that holds one chunk's runs at a time and a
patched run that writes its differences over the lean cache, the same numbers as before; and the command's
memory estimate against the peak resident memory of its stages, measured in a fresh process."""

from __future__ import annotations

import json
import subprocess
import sys
import tracemalloc

import pytest
import torch

import interp
from interp.analyses.circuits import Graph, Runner, faithfulness_curve, select
from interp.analyses.circuits import runner as circuit_runner
from interp.analyses.circuits.positions import each_position, patched as position_patched
from interp.cli import main as cli

from circuit_tasks import random_task
from core_models import OWN_CONFIGS, build


def _one_line(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert err and "\n" not in err and "Traceback" not in err, err
    return err


# ---- defect 5: --steps ---------------------------------------------------------------------------------------
def test_absurd_steps_are_refused_in_one_line_before_any_run(monkeypatch, tmp_path, capsys):
    """--steps 100000000 reached 17 GB building its points and was killed without a word: now one line, saying
    why and how long they would take, before the clean and corrupted runs."""
    monkeypatch.setattr(circuit_runner.Runner, "__init__", lambda *a, **k: pytest.fail("a run started"))
    assert cli(["circuit", "attn-only-2l", "--task", "induction", "--prompts", "4", "--steps", "100000000",
                "--out", str(tmp_path / "a"), "--no-progress"]) == 2
    said = _one_line(capsys)
    assert "--steps 100,000,000" in said and f"at most {circuit_runner.MAX_STEPS:,} steps" in said, said
    assert "these would take about" in said, said  # and how long they would have taken
    assert not (tmp_path / "a").exists()
    model = build(OWN_CONFIGS["rotary-rms-swiglu-gqa"])
    monkeypatch.undo()
    with pytest.raises(ValueError, match="at most 1,000 steps"):
        Runner(model, random_task(model)).eap_ig(circuit_runner.MAX_STEPS + 1)


def test_eap_igs_points_are_made_one_at_a_time(monkeypatch):
    """The points (and the jobs over chunks x points) are never a list: 1,000 steps allocate no more Python
    memory than 10 (the per-point work is stubbed out; the old lists took ~150 kB at 1,000 steps)."""
    model = build(OWN_CONFIGS["rotary-rms-swiglu-gqa"])
    runner = Runner(model, random_task(model), layered=True)
    seen = []
    monkeypatch.setattr(circuit_runner, "layered_attribution", lambda r, i, point, *a: seen.append(point) if
                        len(seen) < 3 else None)
    peaks = {}
    for steps in (10, 1000):
        tracemalloc.start()
        runner.eap_ig(steps)
        peaks[steps] = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    assert seen[:2] == [(0.5 / 10, "inputs"), (1.5 / 10, "inputs")]
    assert peaks[1000] < peaks[10] + 20_000, peaks


def test_the_estimate_does_not_grow_with_steps_and_its_time_does():
    from interp.analyses.circuits.cost import estimate

    cfg = OWN_CONFIGS["rotary-rms-swiglu-gqa"]
    few, many = (estimate(cfg, 2, 256, steps=k, flops=1e10) for k in (5, 500))
    assert few.stages == many.stages
    assert many.seconds["eap-ig"] > 50 * few.seconds["eap-ig"] and many.seconds["runs"] == few.seconds["runs"]
    assert "500 steps x 2 prompts x" in many.line()


# ---- defect 8: holding one chunk's runs, patching over the lean cache ------------------------------------------
@pytest.mark.parametrize("name", ["rotary-rms-swiglu-gqa", "gemma3-like", "rotary-partial-parallel"])
def test_a_runner_holding_one_chunk_gives_the_numbers_of_one_holding_all(name):
    """Block by block with one chunk held at a time (each chunk run again when a stage needs it, the held one
    first): every score, patched run, node and edge, and the faithfulness curve, equal to the runner that holds
    every chunk."""
    model = build(OWN_CONFIGS[name])
    task = random_task(model, n=5, p=7)
    every, one = (Runner(model, task, batch_size=2, layered=True, hold=h) for h in (None, 1))
    assert len(every._cache) == 3 and len(one._cache) == 1 and one.clean_metric == every.clean_metric
    for method in ("eap", "eap_ig"):
        want, got = getattr(every, method)(), getattr(one, method)()
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7 * float(want.abs().max()))
    g = every.graph
    mask = (torch.rand(g.allowed.shape, generator=torch.Generator().manual_seed(0)) < 0.5).float()
    assert one.patched(mask) == every.patched(mask)
    torch.testing.assert_close(one.patch_nodes(), every.patch_nodes(), rtol=0, atol=0)
    edges = [(0, 3), (1, len(g.receivers) - 1)]
    torch.testing.assert_close(one.patch_edges(edges), every.patch_edges(edges), rtol=0, atol=0)
    scores = every.eap_ig(2)
    a, b = faithfulness_curve(every, scores), faithfulness_curve(one, scores)
    assert a.equals(b)
    pos = each_position(task)
    pmask = (torch.rand(*g.allowed.shape, pos.n_classes, generator=torch.Generator().manual_seed(1)) < 0.3).float()
    assert position_patched(one, pos, pmask) == position_patched(every, pos, pmask)


def test_a_long_prompt_runner_holds_as_many_prompts_as_fit(monkeypatch):
    model = build(OWN_CONFIGS["rotary-rms-swiglu-gqa"])
    task = random_task(model, n=6, p=7)
    per = circuit_runner.run_bytes(model.cfg, Runner(model, task).graph, 7, lean=True)
    monkeypatch.setattr(circuit_runner, "HELD_BYTES", 2 * per)
    runner = Runner(model, task, batch_size=16, layered=True)
    assert (runner.chunk_size, runner.hold, len(runner.chunks), len(runner._cache)) == (2, 1, 3, 1)
    assert (runner.chunk_size, Runner(model, task, batch_size=16).hold) == (2, 1)  # the whole graph: all held


def test_a_patched_run_writes_over_the_lean_cache_which_is_formed_again_bit_for_bit():
    """The lean cache of senders' differences is a patched run's buffer (no second copy): after the run it holds
    the run's differences from its first block on, and the runner forms the cached ones again, bit for bit,
    when it next needs them (attribution, node patching)."""
    model = build(OWN_CONFIGS["rotary-rms-swiglu-gqa"])
    task = random_task(model, n=3, p=7)
    runner = Runner(model, task, batch_size=4, layered=True)
    g = runner.graph
    cached = runner._cache[0]["diff"]
    before = cached.clone()
    eap = runner.eap()
    mask = (torch.rand(g.allowed.shape, generator=torch.Generator().manual_seed(0)) < 0.7).float()
    seen = []
    original = circuit_runner._Patching._fill

    def fill(self, values, x):
        original(self, values, x)
        seen.append(self.diff)

    circuit_runner._Patching._fill, value = fill, None
    try:
        value = runner.patched(mask)
    finally:
        circuit_runner._Patching._fill = original
    assert seen and all(d is cached for d in seen), "the patched run's buffer is the cache itself"
    assert runner._cache[0]["written_from"] == 0 and not torch.equal(cached, before)
    assert value == Runner(model, task, batch_size=4, layered=False).patched(mask) or \
        value == pytest.approx(Runner(model, task, batch_size=4, layered=False).patched(mask), rel=1e-5, abs=1e-6)
    torch.testing.assert_close(runner.eap(), eap, rtol=0, atol=0)  # formed again first
    assert torch.equal(runner._cache[0]["diff"], before) and runner._cache[0]["written_from"] == g.n_layers
    late = torch.zeros_like(mask)
    late[:, [r for r in range(len(g.receivers)) if g.receiver_layer[r] >= g.n_layers - 1]] = 1
    assert runner.patched(late) != runner.clean_metric
    assert runner._cache[0]["written_from"] == g.n_layers - 1  # only the last block's senders written over
    assert torch.equal(runner._cache[0]["diff"][:runner._below[g.n_layers - 1]], before[:runner._below[g.n_layers - 1]])


def test_a_circuits_faithfulness_asked_again_is_remembered(monkeypatch):
    model = build(OWN_CONFIGS["rotary-rms-swiglu-gqa"])
    runner = Runner(model, random_task(model))
    scores = runner.eap_ig(2)
    curve = faithfulness_curve(runner, scores, fractions=(0.1, 0.5))
    monkeypatch.setattr(Runner, "patched_many", lambda *a, **k: pytest.fail("run again"))
    circuit = select(runner.graph, scores, int(round(0.1 * runner.graph.n_edges)))
    assert runner.faithfulness(circuit) == curve.faithfulness.iloc[0]


def test_long_prompts_that_would_not_fit_are_refused_naming_the_longest_that_do(monkeypatch):
    """Block by block a runner holds one chunk's runs whatever the number of prompts, so what does not fit is
    the prompts' length: one line naming the longest that fits (and that length does fit)."""
    from interp.analyses.circuits import study as circuit_study
    from interp.analyses.circuits.cost import stage_bytes
    from interp.analyses.circuits.passkey import passkey_task
    from interp.models.placement.memory import FIXED_BYTES

    model = interp.load("rope-gqa-4l")
    monkeypatch.setattr(circuit_runner, "LAYERED_ABOVE", 0)
    monkeypatch.setattr(circuit_runner, "HELD_BYTES", 1)  # one prompt's runs at a time
    task = passkey_task(model, 256, 4)
    n, p = task.clean.shape
    fixed = FIXED_BYTES + model.cfg.n_params() * 4
    available = fixed + max(stage_bytes(model.cfg, n, 200, 16).values())
    with pytest.raises(ValueError) as e:
        circuit_study.check_memory(model, task, 16, available=available)
    said = str(e.value)
    assert said.startswith(f"prompts of {p} tokens: about ") and "1 prompt(s)' runs held at a time" in said, said
    longest = int(said.rsplit("prompts of at most about ", 1)[1].split(" ")[0].replace(",", ""))
    assert 190 <= longest < p and fixed + max(stage_bytes(model.cfg, n, longest, 16).values()) <= available
    line = circuit_study.check_memory(model, task, 16, available=10 * available)
    assert line.startswith("estimate: at most about ") and "1 of 4 prompts' runs held at a time" in line, line


# ---- the estimate against the measured peak ---------------------------------------------------------------------
MEASURE = r"""
import json, sys
import matplotlib.pyplot, pandas, pyarrow  # the report's imports: part of the baseline, not of the stages
import torch
import interp
from interp.analyses.circuits import runner as R, cost
from interp.analyses.circuits.passkey import passkey_task
from interp.analyses.circuits.study import CircuitSettings, CircuitStudy
from interp.analyses.study import run

name, (length, prompts, layered, held) = sys.argv[1], map(int, sys.argv[2:])

def status(field):
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024

model = interp.load(name)
if layered:
    R.LAYERED_ABOVE, R.HELD_BYTES = 0, held
task = passkey_task(model, length, prompts)
with torch.no_grad():
    model(task.clean[:1, :16])  # torch's own start-up (thread pools): part of the baseline
stages = cost.stage_bytes(model.cfg, prompts, int(task.clean.shape[1]), 16)
open("/proc/self/clear_refs", "w").write("5")  # the peak from here on
base = status("VmRSS")
settings = CircuitSettings(model=name, task="passkey", length=length, prompts=prompts, progress=False)
run(CircuitStudy(), model, "out", settings, log=lambda *a: None)
print(json.dumps({"base": base, "peak": status("VmHWM") - base, "stages": stages}))
"""


@pytest.mark.parametrize("layered, prompts", [(False, 12), (True, 48)],
                         ids=["whole graph, 12 prompts", "block by block, 8 of 48 prompts held"])
def test_the_commands_memory_estimate_covers_its_measured_peak(tmp_path, layered, prompts):
    """`interp circuit rope-gqa-4l --task passkey --length 256` (EAP-IG, its faithfulness curve, the report's roles
    and patterns) in a fresh process: its peak resident memory over the baseline after the imports, the model and
    one small forward is below the estimate of its stages' peak (`cost.stage_bytes`), and above half of it. Block
    by block (forced, with room for 8 prompts' runs), the runner holds 8 of the 48 prompts' runs at a time."""
    cfg = interp.load("rope-gqa-4l").cfg
    held = 8 * circuit_runner.run_bytes(cfg, Graph(cfg), 256, lean=True)
    out = subprocess.run([sys.executable, "-c", MEASURE, "rope-gqa-4l", "256", str(prompts), str(int(layered)),
                          str(held)], cwd=tmp_path, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    estimate = max(got["stages"].values())
    assert got["peak"] < estimate < 2 * got["peak"], got
