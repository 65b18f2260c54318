"""The one-way architecture, enforced: `lint-imports` with the contracts in pyproject.toml.

kernels (torch only) <- models <- analyses <- the user surface (loading, interop, CLI, benchmarks).
import-linter finds a package's modules by walking its folder, and ours maps three top-level
folders into `interp` (setuptools package-dir), so the contracts are checked on a tree laid out
as installed: one symlink per source file, under `interp/`, `interp/models/`, ... A wrong-way
import, even a lazy one inside a function, fails this test and so the README's test command.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def installed_layout(dest: Path) -> Path:
    """Mirror the package-dir mapping of pyproject.toml under `dest` (file symlinks); returns dest."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    for package in config["packages"]:
        parent = max((p for p in config["package-dir"] if package == p or package.startswith(p + ".")), key=len)
        source = ROOT / config["package-dir"][parent] / Path(*package.split(".")[len(parent.split(".")):])
        target = dest / Path(*package.split("."))
        target.mkdir(parents=True, exist_ok=True)
        for f in source.glob("*.py"):
            (target / f.name).symlink_to(f)
    return dest


def test_imports_point_one_way(tmp_path):
    exe = shutil.which("lint-imports", path=os.path.dirname(sys.executable)) or shutil.which("lint-imports")
    if exe is None:
        pytest.fail("lint-imports is not installed: pip install -e '.[dev]' installs import-linter")
    tree = installed_layout(tmp_path / "tree")
    env = {**os.environ, "PYTHONPATH": str(tree)}
    proc = subprocess.run([exe, str(ROOT / "pyproject.toml"), "--no-cache"], cwd=tree, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "Contracts: 3 kept, 0 broken" in proc.stdout, proc.stdout[-2000:]


def _lint_with(tmp_path, module: str, appended: str) -> subprocess.CompletedProcess:
    """lint-imports on the installed layout with `appended` added to `module` (a path under interp/)."""
    exe = shutil.which("lint-imports", path=os.path.dirname(sys.executable)) or shutil.which("lint-imports")
    if exe is None:
        pytest.fail("lint-imports is not installed")
    tree = installed_layout(tmp_path / "tree")
    bad = tree / "interp" / module
    text = bad.read_text()
    bad.unlink()  # a symlink to the source: replace it, never write through it
    bad.write_text(text + appended)
    env = {**os.environ, "PYTHONPATH": str(tree)}
    return subprocess.run([exe, str(ROOT / "pyproject.toml"), "--no-cache"], cwd=tree, env=env,
                          capture_output=True, text=True, timeout=300)


def test_a_wrong_way_import_is_caught(tmp_path):
    """The check can fail: a lazy import of the user surface inside a models function breaks it."""
    proc = _lint_with(tmp_path, "models/config.py", "\n\ndef _wrong_way():\n    from interp.loading import load\n    return load\n")
    assert proc.returncode != 0 and "interp.models.config -> interp.loading" in proc.stdout, proc.stdout[-3000:]


def test_a_cycle_between_siblings_is_caught(tmp_path):
    """A cycle inside one layer, hidden in a function-level import, breaks the acyclic-siblings contract:
    the visibility rule importing the statistics kernel that imports it."""
    proc = _lint_with(tmp_path, "kernels/visibility.py",
                      "\n\ndef _cycle():\n    from interp.kernels.stats import attention_stats\n    return attention_stats\n")
    assert proc.returncode != 0 and "No cycles are allowed in interp.kernels" in proc.stdout, proc.stdout[-3000:]


def test_architecture_names_only_paths_that_exist():
    """ARCHITECTURE.md's "where each decision lives" table and how-to name real files: a file moved or
    renamed without the map following fails here."""
    import re

    text = (ROOT / "ARCHITECTURE.md").read_text()
    named = set(re.findall(r"`((?:models|kernels|analyses|interp|tests)/[\w/]+(?:\.py)?/?)(?:::[\w.]+)?`", text))
    assert len(named) > 30, named
    missing = sorted(p for p in named if not (ROOT / p).exists())
    assert not missing, f"ARCHITECTURE.md names paths that do not exist: {missing}"


def test_no_module_calls_a_models_private_methods():
    """A model's private methods are its own: outside models/src/native/transformer.py (and the mixins it is made
    of), nothing reaches into `model._...`; what callers need is public (`prepare`, `loaded_as`, ...)."""
    import ast

    own = {"models/src/native/transformer.py", "models/src/text.py", "models/src/readouts/weights.py"}
    found = []
    for folder in ("models", "kernels", "analyses", "interp"):
        for file in (ROOT / folder).rglob("*.py"):
            rel = file.relative_to(ROOT).as_posix()
            if rel in own:
                continue
            for node in ast.walk(ast.parse(file.read_text())):
                if (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")
                        and isinstance(node.value, ast.Name) and node.value.id in ("model", "hooked", "ours")):
                    found.append(f"{rel}:{node.lineno} {node.value.id}.{node.attr}")
    assert not found, found


def test_no_test_module_imports_another():
    """Shared test code lives in support modules (conftest.py, core_models.py, tl_pairs.py, smol.py, ...),
    never in a test module another imports: importing one runs its module-level setup and collects
    nothing, and its fixtures would silently apply twice."""
    import re

    found = [f"{f.name}: {m}" for f in (ROOT / "tests").rglob("test_*.py")
             for m in re.findall(r"^(?:from|import) (test_\w+)", f.read_text(), flags=re.M)]
    assert not found, found


def test_fixtures_live_in_conftest():
    """A fixture is defined once, in conftest.py, where pytest gives it to every test module: a support
    module (core_models.py, sweep_fixtures.py, ...) holds plain helpers only, so no test imports a fixture."""
    found = [f.name for f in (ROOT / "tests").rglob("*.py")
             if not f.name.startswith("test_") and f.name != "conftest.py" and "@pytest.fixture" in f.read_text()]
    assert not found, f"fixtures outside conftest.py: {found}"


@pytest.mark.parametrize("module, mixin, host", [("models/src/text.py", "TextMixin", "TextModel"),
                                                  ("models/src/readouts/weights.py", "WeightViews", "WeightModel")])
def test_the_mixins_read_only_what_their_protocol_names(module, mixin, host):
    """`TextMixin` and `WeightViews` reach the model they are mixed into only through the attributes their
    Protocol lists (or their own methods), and the model has every one of them."""
    import ast

    from interp import HookedTransformer, ModelConfig

    tree = ast.parse((ROOT / module).read_text())
    classes = {node.name: node for node in tree.body if isinstance(node, ast.ClassDef)}
    named = {n.target.id for n in classes[host].body if isinstance(n, ast.AnnAssign)}
    own = {n.name for n in classes[mixin].body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    own |= {t.id for n in classes[mixin].body if isinstance(n, ast.Assign) for t in n.targets if isinstance(t, ast.Name)}
    read = {n.attr for n in ast.walk(classes[mixin])
            if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "self"}
    assert read - own - named == set(), f"{mixin} reads {sorted(read - own - named)}: add them to {host}"
    model = HookedTransformer(ModelConfig(n_layers=1, d_model=8, n_heads=2, d_vocab=11, n_ctx=8))
    assert all(hasattr(model, name) for name in named), [n for n in named if not hasattr(model, n)]
