"""The model zoo: small models trained here from scratch, shipped as package data with their checkpoints.

Layout (one folder per run, made by `interp train NAME --out models/src/zoo/NAME`):

    models/src/zoo/<run>/run.json                  the recipe, corpus hash, timings and the checkpoint list
    models/src/zoo/<run>/step_<05d>/config.json    one checkpoint (fp16 weights; `interp.load` restores fp32)
                               model.safetensors
                               meta.json        step, tokens seen, losses, seed, run, probe scores
                               tokenizer.json   `interp.models.formats.tokenizer.ByteTokenizer`

Names `interp.load` accepts (see `resolve`):

    "attn-only-2l"                 the run's last checkpoint
    "attn-only-2l/step_01000"      a checkpoint by its folder name
    "attn-only-2l/1000"            the same, by step number (also "step_1000")

Text: the zoo models were trained on windows that start with `<bos>` (id 256), so their configs say
`"prepend_bos": true` and `model.to_tokens(text)` / `model(text)` put it first, as TransformerLens
does. Without it, attn-only-2l's loss on the first 8 bytes of a window rises from 2.50 to 3.23 nats
(2.00 -> 2.24 over 200-byte windows of the Python reference; rope-gqa-4l: 2.32 -> 2.65, 1.77 -> 1.79).

This module only reads folders (no torch import); the recipes that made them are in `.recipes`.
Discovering the checkpoints of any run folder (ours, Hugging Face's, the zoo's) is `interp.models.runs.discover`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from .run_types import is_checkpoint, parse_step

ZOO_DIR = Path(__file__).resolve().parent
RUN_FILE = "run.json"


@dataclass(frozen=True)
class RunInfo:
    """A shipped run: its folder, its run.json and the checkpoint folders present on disk."""

    name: str
    path: Path
    run: dict
    checkpoints: tuple[Path, ...]  # sorted by step

    @property
    def last(self) -> Path:
        return self.checkpoints[-1]

    @property
    def steps(self) -> list[int]:
        return [checkpoint_step(p) for p in self.checkpoints]

    def size_bytes(self) -> int:
        return sum(f.stat().st_size for f in self.path.rglob("*") if f.is_file())


def checkpoint_step(path: Path) -> int:
    """The step of a checkpoint folder named `step_<n>` (the zoo's naming; `runs.parse_step` reads it)."""
    return parse_step(path.name)


def _is_checkpoint(path: Path) -> bool:
    return path.is_dir() and path.name.startswith("step_") and path.name[5:].isdigit() and is_checkpoint(path)


def run_info(path: Path) -> RunInfo:
    """Read one run folder (any folder with run.json, shipped or not)."""
    path = Path(path)
    run = json.loads((path / RUN_FILE).read_text())
    ckpts = tuple(sorted((p for p in path.iterdir() if _is_checkpoint(p)), key=checkpoint_step))
    if not ckpts:
        raise FileNotFoundError(f"run folder {path} has no step_XXXXX checkpoints")
    return RunInfo(run.get("name", path.name), path, run, ckpts)


def list_runs(root: Path = ZOO_DIR) -> list[RunInfo]:
    """The shipped runs, sorted by name (folders under `root` with a run.json and checkpoints)."""
    out = []
    for d in sorted(p for p in root.iterdir() if (p / RUN_FILE).exists()):
        try:
            out.append(run_info(d))
        except FileNotFoundError:
            continue
    return out


def resolve(name: str, root: Path = ZOO_DIR) -> Path | None:
    """The checkpoint folder that `name` names ("run", "run/step_01000", "run/1000"), or None.

    A run that exists but has no such step raises a FileNotFoundError listing its steps."""
    run_name, _, which = str(name).strip("/").partition("/")
    if not run_name or run_name.startswith(".") or not (root / run_name / RUN_FILE).exists():
        return None
    info = run_info(root / run_name)
    if not which:
        return info.last
    digits = which[5:] if which.startswith("step_") else which
    if digits.isdigit():
        for p in info.checkpoints:
            if checkpoint_step(p) == int(digits):
                return p
    raise FileNotFoundError(
        f"zoo run {run_name!r} has no checkpoint {which!r}; its steps are {info.steps} "
        f"(name one as {run_name}/step_{info.steps[-1]:05d} or {run_name}/{info.steps[-1]})"
    )


__all__ = ["RunInfo", "ZOO_DIR", "checkpoint_step", "list_runs", "resolve", "run_info"]
