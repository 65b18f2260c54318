"""The first five minutes: a fast CLI whose help names match the library, and settings refused up
front with one line (exit 2) before any checkpoint is loaded or anything is written."""

from __future__ import annotations

import subprocess

import sys
import tempfile
import time

import numpy as np
import pytest
import torch
from sweep_fixtures import CFG, make_run

from interp.cli import main as cli
from interp.commands import choices


def test_the_help_names_are_the_librarys():
    from interp.analyses.atlas import executors, sweep
    from interp.analyses import data as sweep_data
    from interp.analyses.atlas.registry import ANALYSES
    from interp.benchmarks.suite import ALL

    assert choices.ANALYSES == tuple(sorted(ANALYSES))
    assert choices.DEFAULT_ANALYSES == sweep.DEFAULT_ANALYSES
    assert choices.ATLAS_ANALYSES == sweep.ATLAS_ANALYSES
    assert choices.DATA_KINDS == sweep_data.DATA_KINDS
    d = sweep_data.DataSpec()
    assert (choices.DATA_N_SEQS, choices.DATA_SEQ_LEN, choices.DATA_SEED) == (d.n_seqs, d.seq_len, d.seed)
    assert choices.EXECUTOR_KINDS == executors.EXECUTOR_KINDS
    assert choices.BENCH_SECTIONS == tuple(ALL)
    from interp.kernels.kv_quant import PRECISIONS

    assert choices.KV_PRECISIONS == PRECISIONS
    from interp.analyses.kv.policies import DEFAULT_POLICIES

    assert choices.KV_POLICIES == DEFAULT_POLICIES
    from interp.analyses.kv.roles_study import GATE_STEPS, LOSS_TOKENS

    assert choices.GATE_STEPS == GATE_STEPS
    assert choices.LOSS_TOKENS == LOSS_TOKENS


@pytest.mark.parametrize("args", [[], ["sweep"], ["analyze"], ["bench"], ["info"], ["report"], ["train"], ["kv"],
                                  ["kv", "select"], ["lengths"], ["circuit"]])
def test_help_is_instant_and_imports_no_torch(args):
    """Under a second, measured in a fresh interpreter (what a user's shell pays), torch never imported."""
    code = ("import sys, time; t = time.perf_counter(); from interp.cli import main\n"
            "try:\n    main(sys.argv[1:] + ['--help'])\nexcept SystemExit: pass\n"
            "print('TORCH' if 'torch' in sys.modules else 'NO-TORCH', time.perf_counter() - t)")
    start = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=60, cwd=tempfile.gettempdir()).stdout
    wall = time.perf_counter() - start
    assert out.splitlines()[-1].startswith("NO-TORCH"), out[-500:]
    assert wall < 1.0, f"interp {' '.join(args)} --help took {wall:.2f} s"


@pytest.fixture
def run_dir(tmp_path):
    return make_run(tmp_path, steps=(0, 10))


def _refused(capsys, argv, message, out):
    assert cli(argv) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err  # one line
    assert not out.exists(), "nothing may be written"


def test_settings_are_checked_before_any_checkpoint_is_loaded(run_dir, tmp_path, capsys, monkeypatch):
    import interp.models.formats.checkpoint as checkpoint

    def no_loading(*a, **k):
        raise AssertionError("a checkpoint was loaded")

    monkeypatch.setattr(checkpoint, "load_checkpoint", no_loading)
    out = tmp_path / "out"
    base = ["sweep", str(run_dir), "--out", str(out), "--no-progress"]
    _refused(capsys, base + ["--seq-len", str(CFG.n_ctx * 4)], f"pass --seq-len {CFG.n_ctx} or less", out)
    if not torch.cuda.is_available():
        _refused(capsys, base + ["--device", "cuda:7"], "device 'cuda:7' is not available: this machine has cpu", out)
    _refused(capsys, base + ["--analyses", "induction,nope"], "unknown analyses ['nope']", out)
    _refused(capsys, base + ["--data-file", str(tmp_path / "none.npy")], "does not exist", out)
    floats = tmp_path / "floats.npy"
    np.save(floats, np.zeros((4, 32), dtype=np.float32))
    _refused(capsys, base + ["--data-file", str(floats)], "token ids must be integers", out)
    cube = tmp_path / "cube.pt"
    torch.save(torch.zeros(2, 2, 64, dtype=torch.long), cube)
    _refused(capsys, base + ["--data-file", str(cube)], "must be [n_seqs, seq_len] or flat", out)
    short = tmp_path / "short.npy"
    np.save(short, np.zeros(10, dtype=np.int64))
    _refused(capsys, base + ["--data-file", str(short)], "holds 10 tokens", out)
    big = tmp_path / "big.npy"
    np.save(big, np.full((16, 256), CFG.d_vocab + 5, dtype=np.int64))
    _refused(capsys, base + ["--data-file", str(big), "--seq-len", "32"], "outside run's vocabulary", out)


def test_misspelt_names_suggest_the_right_one(capsys):
    assert cli(["info", "attn-only-2"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: no model 'attn-only-2'; did you mean 'attn-only-2l'?") and err.count("\n") == 1


@pytest.mark.parametrize("error, where", [(MemoryError, "this machine"), ("cuda", "the GPU")])
def test_out_of_memory_is_one_line_naming_where(error, where, monkeypatch, capsys):
    """torch's CUDA out-of-memory error is a RuntimeError, told apart by its class, not by its name."""
    import torch

    import interp.commands.info as info

    raised = torch.cuda.OutOfMemoryError("CUDA out of memory") if error == "cuda" else error()

    def run(args):
        raise raised

    monkeypatch.setattr(info, "run", run)
    assert cli(["info", "attn-only-2l"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: out of memory on {where}") and err.count("\n") == 1, err


def test_an_error_named_like_torchs_is_not_taken_for_it(monkeypatch):
    import interp.commands.info as info

    class OutOfMemoryError(RuntimeError):  # someone else's class with torch's name: a bug, raised as it is
        pass

    def run(args):
        raise OutOfMemoryError("not torch's")

    monkeypatch.setattr(info, "run", run)
    with pytest.raises(OutOfMemoryError):
        cli(["info", "attn-only-2l"])
