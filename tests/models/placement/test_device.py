"""Devices without a GPU: the one door out of the device, the statistics kernel chosen by device, `interp doctor`.

Every test here runs on the CPU. What would break on a GPU is caught three ways:
* dynamically: conftest sets INTERP_REFUSE_HOST_COPIES=1, so every `interp ...` command the suite runs
  refuses a tensor taken to the host other than by `interp.models.placement.device.to_numpy` (`.numpy()` on a CUDA
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
from interp.models.placement.device import compute_record, resolve_device, to_numpy
from interp.testing import HostCopyError, refuse_host_copies
from interp.errors import BadValue

PACKAGE = Path(interp.__file__).resolve().parent.parent  # the source tree: interp/, models/src/, kernels/src/, analyses/src/


# ---- the guard -------------------------------------------------------------------------------------
def _code_from(path: Path, source: str) -> dict:
    """Functions compiled as if they were written in the file `path` (the guard judges a host copy by its caller)."""
    namespace = {"np": np, "pd": pd, "to_numpy": to_numpy}
    exec(compile(source, str(path), "exec"), namespace)
    return namespace


LEAKS = """
def numpy(t): return t.numpy()
def asarray(t): return np.asarray(t)
def array(t): return np.array(t)
def frame(t): return pd.DataFrame({"x": t[0]})
def series(t): return pd.Series(t[0])
def door(t): return to_numpy(t)
"""


def test_the_guard_refuses_every_implicit_host_copy_our_code_makes():
    t = torch.arange(6.0).reshape(2, 3)
    ours = _code_from(PACKAGE / "analyses" / "src" / "some_analysis.py", LEAKS)
    theirs = _code_from(Path(np.__file__).parent.parent / "some_library" / "module.py", LEAKS)
    with refuse_host_copies():
        for leak in ("numpy", "asarray", "array", "frame", "series"):
            with pytest.raises(HostCopyError, match="to_numpy"):
                ours[leak](t)
            assert len(theirs[leak](t)) > 0  # a library's own host copy (of a tensor we gave it) is its affair
        assert ours["door"](t).tolist() == [[0, 1, 2], [3, 4, 5]]
        assert to_numpy(t.bfloat16()).dtype == np.float32  # numpy has no bfloat16
        assert t.tolist() == [[0, 1, 2], [3, 4, 5]] and float(t[1, 2]) == 5.0  # fine on every device
    assert ours["numpy"](t).shape == (2, 3) and "numpy" not in torch.Tensor.__dict__  # outside, nothing is refused


def test_the_viewer_as_it_was_fails_under_the_guard(tmp_path, monkeypatch, capsys):
    """The H100 bug: the viewer called `.numpy()` on the patterns' codes. Put that call back and the
    command the suite runs (`interp analyze`, guarded by conftest's INTERP_REFUSE_HOST_COPIES) reports it
    as the viewer's error; with the helper it runs clean."""
    from interp.analyses.atlas.registry import viewer
    from interp.cli import main as cli

    argv = ["analyze", "attn-only-2l", "--analyses", "viewer", "--n-seqs", "2", "--seq-len", "32", "--no-progress",
            "--no-report"]
    assert cli([*argv, "--out", str(tmp_path / "ok")]) == 0, capsys.readouterr().err
    as_it_was = _code_from(Path(viewer.__file__), "def codes_numpy(codes): return codes.numpy()")["codes_numpy"]
    monkeypatch.setattr(viewer, "to_numpy", as_it_was)  # the viewer's line as it was: codes.numpy()
    assert cli([*argv, "--out", str(tmp_path / "bad")]) == 1
    errors = json.loads((tmp_path / "bad" / "errors.json").read_text())
    assert [e["analysis"] for e in errors] == ["viewer"] and "HostCopyError" in json.dumps(errors)


def _numpy_calls(source: str) -> list[int]:
    """Lines of `<anything>.numpy()` calls in Python source."""
    return [node.lineno for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "numpy"]


def test_no_numpy_call_in_the_package_but_the_one_door():
    allowed = PACKAGE / "models" / "src" / "placement" / "device.py"
    found = []
    for folder in ("interp", "models", "kernels", "analyses"):
        for f in sorted((PACKAGE / folder).rglob("*.py")):
            if f != allowed:
                found += [f"{f.relative_to(PACKAGE)}:{line}" for line in _numpy_calls(f.read_text())]
    assert not found, f"take tensors off the device with interp.models.placement.device.to_numpy, not .numpy(): {found}"
    assert _numpy_calls(allowed.read_text())  # the door itself is found by the rule
    old_viewer = '"patterns_u8": base64.b64encode(codes.numpy().tobytes()).decode()'
    assert _numpy_calls("x = {" + old_viewer + "}") == [1]  # the rule catches the viewer as it was


# ---- the statistics kernel, chosen by device --------------------------------------------------------
def test_every_statistics_entry_point_defaults_to_auto():
    from interp.analyses.heads import detect_heads
    from interp.models.readouts import head_statistics as stats

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
    # statistics without `max` (the atlas's): the fused route off CUDA; layers it cannot compute: the tiles
    no_max = ("sink", "previous", "duplicate", "induction")
    assert resolve_backend("auto", "cpu", stats=no_max) == "fused" and resolve_backend("auto", "mps", stats=no_max) == "fused"
    assert resolve_backend("auto", "cpu", stats=no_max, softcap=True) == "torch"
    assert resolve_backend("auto", "cpu", stats=no_max, causal=False, alibi=True) == "torch"
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
    ["analyze", "attn-only-2l"], ["sweep", "attn-only-2l"], ["kv", "precision", "attn-only-2l", "--seq-len", "128"],
    ["kv", "passkey", "attn-only-2l", "--lengths", "200", "--seq-len", "200"], ["demo"], ["doctor"],
    ["generate", "attn-only-2l", "def f(x):"],
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
    assert "fused route vs float64 materialised pattern (float32):" in out
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


# ---- the CPU playing a GPU: device mixing --------------------------------------------------------------
def test_the_simulated_gpu_refuses_what_cuda_refuses():
    from interp.testing import DeviceMixError, simulated_gpu

    with simulated_gpu():
        host = torch.arange(3.0)
        dev = host.to("cpu")  # "to the device"
        lin = torch.nn.Linear(3, 2)  # a module's parameters live on the device
        assert (dev + 1).tolist() == [1, 2, 3] and float((dev * torch.tensor(2.0)).sum()) == 6.0  # host scalars mix
        assert (dev + torch.zeros(3, device=dev.device)).tolist() == [0, 1, 2]  # a factory told where
        assert (dev.cpu() + host).tolist() == [0, 2, 4] and (host + host).tolist() == [0, 2, 4]
        assert dev[torch.tensor([2, 0])].tolist() == [2, 0]  # indexing with a host index is fine on CUDA too
        assert lin(dev).shape == (2,) and to_numpy(dev).tolist() == [0, 1, 2]
        for mix in (lambda: dev + host, lambda: torch.cat([dev, host]), lambda: lin(host), lambda: dev.numpy(),
                    lambda: torch.where(dev > 0, dev, host), lambda: dev.index_select(0, torch.tensor([0, 1]))):
            with pytest.raises(DeviceMixError):
                mix()
        assert host.numpy().tolist() == [0, 1, 2]  # a host tensor's .numpy() is fine (the guard above polices ours)


SIMULATED = [  # every command, tiny: what a --device cuda run does, on the CPU playing the GPU
    ["analyze", "rope-gqa-4l", "--n-seqs", "2", "--seq-len", "32", "--analyses",
     "previous_token,duplicate_token,induction,sinks,viewer,streaming,composition,ablation,pruning,importance,loss"],
    ["sweep", "attn-only-2l", "--n-seqs", "2", "--seq-len", "32", "--analyses", "induction,sinks,streaming,loss"],
    ["kv", "precision", "attn-only-2l", "--seq-len", "96", "--n-seqs", "2", "--seeds", "1"],
    ["kv", "passkey", "attn-only-2l", "--lengths", "248", "--depths", "0.5", "--prompts", "1",
     "--seq-len", "200"],
    ["kv", "select", "attn-only-2l", "--rankings", "retrieval,razor,loss,random,gates", "--gate-steps", "2",
     "--lengths", "248",
     "--depths", "0.5", "--prompts", "1", "--window", "32", "--fractions", "0.5", "--seq-len", "200",
     "--scoring-prompts", "1", "--selection-seeds", "1"],
    ["demo", "--seq", "32"],
    ["generate", "attn-only-2l", "def f(x):", "--max-new-tokens", "8", "--kv-policy", "streaming(4,8)"],
    ["generate", "attn-only-2l", "def f(x):", "--max-new-tokens", "8", "--sample", "--top-p", "0.9"],
]


@pytest.mark.slow
@pytest.mark.parametrize("argv", SIMULATED, ids=lambda a: "-".join(a[:3]))
def test_every_command_runs_on_the_simulated_gpu(argv, tmp_path, capsys):
    from interp.cli import main as cli
    from interp.testing import simulated_gpu

    out = ["--out", str(tmp_path / "out"), "--no-progress"] if argv[0] in ("analyze", "sweep", "kv") else []
    with simulated_gpu():
        rc = cli([*argv, *out])
    captured = capsys.readouterr()
    assert rc == 0, captured.err + captured.out
    if argv[0] in ("analyze", "sweep"):
        assert json.loads((tmp_path / "out" / "errors.json").read_text()) == []


def test_a_host_tensor_among_device_ones_fails_on_the_simulated_gpu(monkeypatch):
    """The bug class the simulation is for: a count computed on the host (a forgotten `device=`) meets the
    streaming statistics on the device. On a GPU that fails, and here too; as written, it runs."""
    from interp.analyses import heads
    from interp.testing import DeviceMixError, simulated_gpu

    counts = heads.earlier_occurrences
    with simulated_gpu():
        model = interp.load("rope-gqa-4l", device="cpu")
        tokens = torch.randint(0, model.cfg.d_vocab, (2, 40), generator=torch.Generator().manual_seed(0))
        tokens = tokens.to(model.device)
        assert len(heads.detect_heads(model, tokens, method="streaming")) == 3 * model.cfg.n_layers * model.cfg.n_heads
        monkeypatch.setattr(heads, "earlier_occurrences", lambda t: counts(t.cpu()))
        with pytest.raises(DeviceMixError, match="mixes tensors on the device with host tensor"):
            heads.detect_heads(model, tokens, method="streaming")


# ---- interp generate -----------------------------------------------------------------------------------
def test_generate_prints_what_model_generate_gives(capsys):
    from interp.cli import main as cli

    model = interp.load("attn-only-2l")
    for extra, kwargs in (([], {}), (["--sample", "--temperature", "0.7", "--seed", "3"],
                                     dict(do_sample=True, temperature=0.7, seed=3)),
                          (["--kv-policy", "streaming(4,8)"], dict(kv_policy="streaming(4,8)"))):
        assert cli(["generate", "attn-only-2l", "def f(x):", "--max-new-tokens", "12", *extra]) == 0
        out = capsys.readouterr().out
        tokens = model.to_tokens("def f(x):")
        want = model.generate(tokens, 12, **kwargs)[0, tokens.shape[1]:]
        assert out.startswith("def f(x):" + model.to_string(want) + "\n"), (extra, out)
        assert "12 new tokens in" in out


@pytest.mark.parametrize("extra, message", [
    (["--max-new-tokens", "0"], "max_new_tokens must be >= 1"),
    (["--top-p", "1.5"], "top_p must be in (0, 1]"),
    (["--temperature", "0"], "temperature must be > 0.0"),
    (["--kv-policy", "lru(3)"], "unknown KV-cache policy 'lru(3)'"),
    (["--max-new-tokens", "1000"], "longer than this model's context (n_ctx=256)"),
])
def test_generate_bad_settings_are_one_line(extra, message, capsys):
    from interp.cli import main as cli

    assert cli(["generate", "attn-only-2l", "def f(x):", *extra]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err
