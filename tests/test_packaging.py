"""Every package folder is in the wheel: pyproject.toml lists packages by hand (find_packages cannot see through
the package-dir mapping), and an unlisted folder is silently missing from the install and skipped by
import-linter's contracts. The old import paths of moved modules still work, with a DeprecationWarning."""

from __future__ import annotations

import importlib
import sys
import tomllib
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def listed_and_found(root: Path = ROOT) -> tuple[set[str], set[str]]:
    """(the packages pyproject.toml lists, the package folders under the mapped source folders)."""
    config = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]
    folders = {v: k for k, v in config["package-dir"].items()}  # "models" -> "interp.models"
    found = set()
    for folder, package in folders.items():
        for init in (root / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(root / folder)
            found.add(".".join([package, *rel.parts]))
    return set(config["packages"]), found


def test_every_package_folder_is_listed_in_pyproject():
    listed, found = listed_and_found()
    assert found - listed == set(), f"add these to [tool.setuptools] packages in pyproject.toml: {sorted(found - listed)}"
    assert listed - found == set(), f"listed but not a package folder: {sorted(listed - found)}"


def test_the_check_catches_an_unlisted_folder(tmp_path):
    (tmp_path / "pyproject.toml").write_text('[tool.setuptools]\npackage-dir = { "interp" = "interp", '
                                             '"interp.models" = "models" }\npackages = ["interp", "interp.models"]\n')
    for folder in ("interp", "models", "models/kv"):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "__init__.py").write_text("")
    listed, found = listed_and_found(tmp_path)
    assert found - listed == {"interp.models.kv"}
    _, ours = listed_and_found()
    assert {"interp.models.kv", "interp.analyses.kv", "interp.models.formats"} <= ours  # the rooms are seen


@pytest.mark.parametrize("old, new, name", [
    ("interp.models.kv_policy", "interp.models.kv.policies", "parse_policy"),
    ("interp.models.kv_cache_policy", "interp.models.kv.policy_cache", "PolicyKVCache"),
    ("interp.models.checkpoint", "interp.models.formats.checkpoint", "load_checkpoint"),
    ("interp.analyses.kv_policies", "interp.analyses.kv.policies", "PolicyStudy"),
    ("interp.analyses.tasks", "interp.analyses.kv.tasks", "retrieval_prompts"),
    ("interp.models.evaldata", "interp.analyses.evaldata", "language_reference"),
])
def test_old_import_paths_work_for_one_release_with_a_warning(old, new, name):
    sys.modules.pop(old, None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module = importlib.import_module(old)
    assert module is importlib.import_module(new) and hasattr(module, name)  # one object under both names
    assert any(issubclass(w.category, DeprecationWarning) and f"{old} moved to {new}" in str(w.message)
               for w in caught), [str(w.message) for w in caught]
