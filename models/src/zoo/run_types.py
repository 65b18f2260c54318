"""What a run and its checkpoints are, and how a checkpoint folder's name and contents are read:
the types and rules shared by run discovery (`runs`) and the shipped zoo (`zoo`), which both import
this module (and `runs` imports `zoo`, never the other way)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

_STEP_PATTERNS = (
    re.compile(r"(?:^|[_\-/])(?:global_step|step|checkpoint|ckpt|iter|iteration)[_\-]?(\d+)$", re.IGNORECASE),
    re.compile(r"(\d+)$"),
)
_WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin")


@dataclass(frozen=True)
class Checkpoint:
    """One checkpoint of a run. `path` is a checkpoint folder `interp.load` accepts."""

    run: str
    name: str
    step: int | None
    path: str


@dataclass(frozen=True)
class Run:
    name: str
    source: str  # what the user named: a zoo name or a folder
    checkpoints: tuple[Checkpoint, ...]


def parse_step(name: str) -> int | None:
    """The training step a checkpoint folder's name encodes (`step1000`, `checkpoint-500`), or None."""
    for pattern in _STEP_PATTERNS:
        m = pattern.search(name)
        if m:
            return int(m.group(1))
    return None


def is_checkpoint(path: Path) -> bool:
    """A folder `interp.load` would try: it has a config.json and (possibly broken) weights."""
    return (path / "config.json").is_file() and any((path / f).exists() for f in _WEIGHT_FILES)
