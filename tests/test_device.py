"""Devices without a GPU: the one door out of the device, the statistics kernel chosen by device, `interp doctor`.

Every test here runs on the CPU. What would break on a GPU is caught three ways:
* dynamically: conftest sets INTERP_REFUSE_HOST_COPIES=1, so every `interp ...` command the suite runs
  refuses a tensor taken to the host other than by `interp.models.device.to_numpy` (`.numpy()` on a CUDA
  tensor raises); the viewer of before this change fails that way (test below);
* statically: no `.numpy()` call anywhere in the package but in that one helper (a rule with its own
  negative case, today's viewer line as it was);
* by default choice: every entry point that runs the statistics kernel defaults to ``backend="auto"``,
  which is Triton for CUDA tensors.
"""

from __future__ import annotations

import ast
import inspect
import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

import interp
from interp.kernels import attention_stats, resolve_backend
from interp.models.device import HostCopyError, compute_record, refuse_host_copies, resolve_device, to_numpy
from interp.models.errors import BadValue

PACKAGE = Path(interp.__file__).resolve().parent.parent  # the source tree: interp/, models/, kernels/, analyses/


# ---- the guard -------------------------------------------------------------------------------------
def test_the_guard_refuses_every_implicit_host_copy_and_lets_the_door_through():
    t = torch.arange(6.0).reshape(2, 3)
    with refuse_host_copies():
        for leak in (lambda: t.numpy(), lambda: np.asarray(t), lambda: pd.DataFrame({"x": t[0]}),
                     lambda: pd.Series(t[0]), lambda: np.array(t)):
            with pytest.raises(HostCopyError, match="to_numpy"):
                leak()
        assert to_numpy(t).tolist() == [[0, 1, 2], [3, 4, 5]]
        assert to_numpy(t.bfloat16()).dtype == np.float32  # numpy has no bfloat16
        assert t.tolist() == [[0, 1, 2], [3, 4, 5]] and float(t[1, 2]) == 5.0  # fine on every device
    assert t.numpy().shape == (2, 3)  # outside the block, nothing is refused


def test_the_viewer_as_it_was_fails_under_the_guard(tmp_path, monkeypatch, capsys):
    """The H100 bug: the viewer called `.numpy()` on the patterns' codes. Put that call back and the
    command the suite runs (`interp analyze`, guarded by conftest's INTERP_REFUSE_HOST_COPIES) reports it
    as the viewer's error; with the helper it runs clean."""
    from interp.analyses.registry import viewer
    from interp.cli import main as cli

    argv = ["analyze", "attn-only-2l", "--analyses", "viewer", "--n-seqs", "2", "--seq-len", "32", "--no-progress",
            "--no-report"]
    assert cli([*argv, "--out", str(tmp_path / "ok")]) == 0, capsys.readouterr().err
    monkeypatch.setattr(viewer, "to_numpy", lambda t: t.numpy())  # the line as it was: codes.numpy()
    assert cli([*argv, "--out", str(tmp_path / "bad")]) == 1
    errors = json.loads((tmp_path / "bad" / "errors.json").read_text())
    assert [e["analysis"] for e in errors] == ["viewer"] and "HostCopyError" in json.dumps(errors)


def _numpy_calls(source: str) -> list[int]:
    """Lines of `<anything>.numpy()` calls in Python source."""
    return [node.lineno for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "numpy"]


def test_no_numpy_call_in_the_package_but_the_one_door():
    allowed = PACKAGE / "models" / "device.py"
    found = []
    for folder in ("interp", "models", "kernels", "analyses"):
        for f in sorted((PACKAGE / folder).rglob("*.py")):
            if f != allowed:
                found += [f"{f.relative_to(PACKAGE)}:{line}" for line in _numpy_calls(f.read_text())]
    assert not found, f"take tensors off the device with interp.models.device.to_numpy, not .numpy(): {found}"
    assert _numpy_calls(allowed.read_text())  # the door itself is found by the rule
    old_viewer = '"patterns_u8": base64.b64encode(codes.numpy().tobytes()).decode()'
    assert _numpy_calls("x = {" + old_viewer + "}") == [1]  # the rule catches the viewer as it was


# ---- the statistics kernel, chosen by device --------------------------------------------------------
def test_every_statistics_entry_point_defaults_to_auto():
    from interp.analyses.heads import detect_heads
    from interp.models import stats

    entries = [attention_stats, stats.model_attention_stats, stats.kv_cache_attention_stats,
               interp.HookedTransformer.attention_stats, detect_heads]
    defaults = {f.__qualname__: inspect.signature(f).parameters["backend"].default for f in entries}
    assert set(defaults.values()) == {"auto"}, defaults


def test_auto_is_triton_on_cuda_and_torch_elsewhere(monkeypatch):
    import importlib.util

    from interp.kernels import stats

    assert resolve_backend("auto", "cpu") == "torch" and resolve_backend("auto", "mps") == "torch"
    monkeypatch.setattr(stats, "_triton_available", lambda: True)
    assert resolve_backend("auto", "cuda:0") == "triton" and resolve_backend("auto", torch.device("cuda")) == "triton"
    monkeypatch.setattr(stats, "_triton_available", lambda: False)
    assert resolve_backend("auto", "cuda") == "torch"  # a GPU machine without Triton
    with pytest.raises(ImportError, match="needs the `triton` package.*backend='torch' runs anywhere"):
        attention_stats(torch.randn(1, 1, 4, 8), torch.randn(1, 1, 4, 8), backend="triton")
    monkeypatch.setattr(stats, "_triton_available", lambda: importlib.util.find_spec("triton") is not None)
    if stats._triton_available():
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
        with pytest.raises(ValueError, match="needs CUDA tensors \\(these are on cpu\\)"):
            attention_stats(torch.randn(1, 1, 4, 8), torch.randn(1, 1, 4, 8), backend="triton")
    with pytest.raises(ValueError, match="unknown backend 'cuda'"):
        resolve_backend("cuda", "cpu")


def test_auto_gives_the_torch_kernels_numbers_on_the_cpu():
    from interp.analyses.heads import detect_heads

    model = interp.load("rope-gqa-4l")
    tokens = torch.randint(0, model.cfg.d_vocab, (2, 48), generator=torch.Generator().manual_seed(0))
    auto = detect_heads(model, tokens, method="streaming")
    explicit = detect_heads(model, tokens, method="streaming", backend="torch")
    pd.testing.assert_frame_equal(auto, explicit)


# ---- devices named by the user -----------------------------------------------------------------------
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")
@pytest.mark.parametrize("name, message", [
    ("cuda", "device 'cuda' is not available: this machine has cpu"),
    ("cuda:7", "device 'cuda:7' is not available: this machine has cpu"),
    ("gpu", "device 'gpu' is not a device name (cpu, cuda, cuda:N, mps); this machine has: cpu"),
])
def test_a_device_the_machine_lacks_is_one_line(name, message):
    with pytest.raises(BadValue) as e:
        resolve_device(name)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_the_default_device_and_the_compute_record():
    assert resolve_device(None) == torch.device("cuda" if torch.cuda.is_available() else "cpu")
    assert resolve_device("cpu") == torch.device("cpu")
    record = compute_record("cpu")
    assert record["device"] == "cpu" and record["stats_backend"] == "torch"
    assert record["threads"] == torch.get_num_threads() and record["device_name"].startswith("CPU (")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")
@pytest.mark.parametrize("argv", [
    ["analyze", "attn-only-2l"], ["sweep", "attn-only-2l"], ["kv", "attn-only-2l", "--seq-len", "128"],
    ["kv", "attn-only-2l", "--task", "passkey", "--lengths", "200", "--seq-len", "200"], ["demo"], ["doctor"],
])
def test_every_command_refuses_a_missing_gpu_in_one_line_before_loading(argv, tmp_path, monkeypatch, capsys):
    from interp.cli import main as cli

    monkeypatch.setattr(interp, "load", lambda *a, **k: pytest.fail("the model must not load"))
    out = ["--out", str(tmp_path / "out")] if argv[0] in ("analyze", "sweep", "kv") else []
    assert cli([*argv, *out, "--device", "cuda:1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "device 'cuda:1' is not available: this machine has cpu" in err, err
    assert not (tmp_path / "out").exists()


def test_settings_and_report_say_where_it_ran_and_with_which_kernel(tmp_path, capsys):
    from interp.cli import main as cli

    out = tmp_path / "atlas"
    assert cli(["analyze", "attn-only-2l", "--analyses", "induction,sinks", "--n-seqs", "2", "--seq-len", "32",
                "--device", "cpu", "--no-progress", "--out", str(out)]) == 0, capsys.readouterr().err
    compute = json.loads((out / "settings.json").read_text())["compute"]
    assert compute["device"] == "cpu" and compute["stats_backend"] == "torch"
    report = (out / "report.md").read_text()
    assert f"{compute['threads']} threads); streaming statistics kernel: torch." in report


# ---- interp doctor -----------------------------------------------------------------------------------
def test_doctor_prints_the_machine_and_passes_its_checks(capsys):
    from interp.cli import main as cli

    assert cli(["doctor", "--seq", "128"]) == 0
    out = capsys.readouterr().out
    assert f"torch {torch.__version__}" in out and "auto -> torch on cpu" in out
    assert "torch kernel vs float64 materialised pattern (float32):" in out
    assert "fused vs instrumented attention" in out and out.rstrip().endswith("all checks passed")
    if "triton 3" in out or "triton 4" in out:  # installed: checked in its CPU interpreter
        assert "triton kernel (CPU interpreter, 96 tokens) vs torch kernel (float32):" in out


def test_doctor_says_failed_and_exits_1_when_a_check_is_off(capsys, monkeypatch):
    from interp.cli import main as cli
    from interp.commands import doctor

    monkeypatch.setattr(doctor, "_interpreted_triton_diff", lambda n: (None, "not needed here"))
    monkeypatch.setattr(doctor, "TOL", {**doctor.TOL, "float32": 0.0})  # float32 round-off now fails
    assert cli(["doctor", "--seq", "64"]) == 1
    out = capsys.readouterr().out
    assert "float64 materialised pattern (float32):" in out and "FAILED (tolerance 0e+00)" in out
    assert "check(s) FAILED: please report this output" in out
