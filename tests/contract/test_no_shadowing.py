"""A checkout shadows nothing (issues 64 and 66).

The rooms `kernels/`, `models/`, `analyses/` hold their packages one level down (`kernels/src/`, mapped as
`interp.kernels` by pyproject's package-dir), so a Python started in the repository's root imports PyPI's
`kernels` (which transformers >= 5.25 imports whenever it builds a model), not this folder. And every child
process interp or its tests start runs in a folder of its choosing (`cwd=`), never in whatever folder the caller
happens to be in.
"""

from __future__ import annotations

import ast
import importlib.metadata
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SPAWNERS = ("run", "Popen", "check_output", "check_call", "call")


def children_without_a_folder(source: str) -> list[int]:
    """Lines of `subprocess.<spawn>(...)` calls that do not say where the child starts (no `cwd=`)."""
    return [n.lineno for n in ast.walk(ast.parse(source))
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr in SPAWNERS
            and isinstance(n.func.value, ast.Name) and n.func.value.id == "subprocess"
            and not any(k.arg == "cwd" for k in n.keywords)]


def test_every_child_process_says_where_it_starts():
    found = [f"{f.relative_to(ROOT)}:{line}"
             for folder in ("interp", "models", "kernels", "analyses", "tests")
             for f in sorted((ROOT / folder).rglob("*.py"))
             for line in children_without_a_folder(f.read_text())]
    assert not found, ("start children with cwd= (a temporary folder): in the caller's folder, a checkout's root, "
                       f"they would import its folders as packages: {found}")


def test_the_rule_catches_a_child_in_the_callers_folder():
    assert children_without_a_folder("import subprocess\nsubprocess.run(['python', '-c', 'pass'])\n") == [2]
    assert children_without_a_folder("import subprocess\nsubprocess.Popen(['x'], cwd='/tmp')\n") == []


def _in_root(code: str) -> subprocess.CompletedProcess:
    """`python -c code` started in the repository's root, as a user typing `python` there would."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONSAFEPATH")}
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)


def test_no_room_is_a_top_level_package_in_the_root():
    proc = _in_root("import importlib.util as u\n"
                    "for name in ('kernels', 'models', 'analyses'):\n"
                    "    spec = u.find_spec(name)\n"
                    "    print(name, spec.origin if spec else None, list(spec.submodule_search_locations or []) if spec else [])\n"
                    "import interp.kernels\nprint('interp.kernels', interp.kernels.__file__)\n")
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = dict(line.split(" ", 1) for line in proc.stdout.splitlines())
    for name in ("kernels", "models", "analyses"):
        # a namespace portion at most (no __init__.py in the room): any regular package elsewhere wins over it,
        # and nothing of ours is reachable under the bare name
        origin, _, portions = lines[name].partition(" ")
        assert origin == "None" or not origin.startswith(str(ROOT / name)), (name, lines[name])
        assert f"{ROOT / name}/" not in origin + "/"
    assert not lines["interp.kernels"].startswith(str(ROOT / "kernels" / "__init__"))
    ours = _in_root("import models.config")
    assert ours.returncode != 0 and "ModuleNotFoundError" in ours.stderr


def test_pypis_kernels_and_a_transformers_model_in_the_root():
    pytest.importorskip("transformers")
    try:
        importlib.metadata.version("kernels")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("PyPI's kernels is not installed (transformers before 5.25 does not require it)")
    proc = _in_root("import kernels; print(kernels.__file__)\n"
                    "from transformers import LlamaConfig, LlamaForCausalLM\n"
                    "LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, "
                    "num_attention_heads=4, num_key_value_heads=2, vocab_size=1000, head_dim=16))\nprint('built')\n")
    assert proc.returncode == 0, proc.stderr[-2000:]
    where, built = proc.stdout.split()
    assert not where.startswith(str(ROOT / "kernels")) and built == "built"


@pytest.mark.slow
def test_python_m_pytest_in_the_root_runs_a_wrapped_model():
    pytest.importorskip("transformers")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "PYTHONPATH"))}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x",
                           "tests/models/wrapped/test_wrapped.py::test_native_only_requests_say_so_in_one_line"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and "1 passed" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-2000:]
    # and plain `pytest` (what CI runs), on a test in tests/interp/: that folder must not shadow interp itself
    exe = shutil.which("pytest", path=os.path.dirname(sys.executable)) or shutil.which("pytest")
    proc = subprocess.run([exe, "-q", "-p", "no:cacheprovider", "-x",
                           "tests/interp/test_cli.py::test_out_of_memory_is_one_line_naming_where"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and "2 passed" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-2000:]
