"""Every package folder is in the wheel: pyproject.toml lists packages by hand (find_packages cannot see through
the package-dir mapping), and an unlisted folder is silently missing from the install and skipped by
import-linter's contracts. Moved modules have no old path kept alive: CHANGELOG.md lists every move."""

from __future__ import annotations

import importlib
import sys
import tomllib
from pathlib import Path

import pytest
from changelog import moved_modules

ROOT = Path(__file__).resolve().parents[2]


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


def test_no_compatibility_layer_and_every_move_in_the_changelog():
    """Before a release, modules move freely: no import hook keeps an old path alive (it reserved 42 names, and
    a future module at one would have been replaced silently); CHANGELOG.md lists each move instead."""
    moved = moved_modules()
    assert len(moved) >= 40, len(moved)
    assert not [f for f in sys.meta_path if type(f).__module__.startswith("interp")], sys.meta_path
    for old, new in moved.items():
        importlib.import_module(new)  # the new path is real
        sys.modules.pop(old, None)
        with pytest.raises(ModuleNotFoundError):
            importlib.import_module(old)
