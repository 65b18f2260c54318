"""Discovering the checkpoints of a training run, in step order.

A *run* is named on the command line in one of four ways (`discover`):

- a zoo name (`attn-only-2l`): the zoo's run folder, whose `run.json` lists the checkpoints;
- a run folder of ours: `run.json` listing checkpoints, or sub-folders each holding a checkpoint
  (`config.json` + weights, optional `meta.json` with `step`, `tokens`, `loss`);
- a folder of Hugging Face checkpoint folders (Pythia revisions `step1000/`, Trainer's
  `checkpoint-500/`): each sub-folder with a `config.json` is one checkpoint;
- a single checkpoint folder (ours or Hugging Face): a run of one checkpoint.

The step comes from `meta.json` (`step`), else `run.json`, else the folder name (`step1000`,
`checkpoint-500`, `ckpt_20`, trailing digits). Checkpoints sort by step, unnumbered ones last.
A run folder's checkpoints are those `run.json` lists (when their folders exist: a zoo may ship a
subset) plus any other sub-folder holding a `config.json`.
Discovery only lists folders: a checkpoint whose weights are truncated is found here and
reported when the sweep fails to load it.
"""

from __future__ import annotations

import json
from pathlib import Path

from .. import zoo
from ..zoo.run_types import Checkpoint, Run, is_checkpoint, parse_step

__all__ = ["Checkpoint", "Run", "discover", "is_checkpoint", "parse_step", "zoo_path"]

def discover(spec: str, last_only: bool = False) -> Run:
    """The run `spec` names (a zoo name, a run folder, a folder of checkpoint folders, or one checkpoint);
    with `last_only`, just its last checkpoint (`interp analyze`)."""
    path = Path(spec)
    if not path.exists():
        path = zoo_path(spec)
        if path is None:
            raise FileNotFoundError(
                f"{spec!r} is neither a folder nor a zoo run name; give a run folder (with run.json or "
                "checkpoint sub-folders), a checkpoint folder, or a name from `interp.models.zoo.list_runs()`"
            )
        if is_checkpoint(path) and (path.parent / "run.json").is_file() and "/" not in spec.strip("/"):
            path = path.parent  # a bare zoo name resolves to its latest checkpoint: sweep the whole run
    path = path.resolve()
    run_name = spec.strip("/") if not Path(spec).exists() else path.name
    if (path / "config.json").is_file() and not (path / "run.json").is_file():  # one checkpoint (loading judges it)
        checkpoints = [_checkpoint(path, run_name, path.name)]
    else:  # run.json's entries whose folders exist, then any other checkpoint sub-folder
        listed = _from_run_json(path, run_name) if (path / "run.json").is_file() else []
        known = {Path(c.path) for c in listed}
        subdirs = sorted(p for p in path.iterdir() if p.is_dir() and (p / "config.json").is_file() and p not in known)
        checkpoints = [c for c in listed if Path(c.path).is_dir()] + [_checkpoint(p, run_name, p.name) for p in subdirs]
    if not checkpoints:
        raise FileNotFoundError(
            f"{path} holds no checkpoints: expected run.json, sub-folders with config.json + model.safetensors, "
            "or a checkpoint folder itself"
        )
    names = [c.name for c in checkpoints]
    if len(set(names)) != len(names):
        raise ValueError(f"run {run_name!r} lists checkpoint names more than once: {names}")
    checkpoints = sorted(checkpoints, key=_order)
    return Run(run_name, spec, tuple(checkpoints[-1:] if last_only else checkpoints))


def _order(c: Checkpoint):
    return (c.step is None, c.step if c.step is not None else 0, c.name)


def _checkpoint(path: Path, run: str, name: str, step: int | None = None) -> Checkpoint:
    meta = _read_json(path / "meta.json")
    if isinstance(meta, dict) and isinstance(meta.get("step"), int):
        step = meta["step"]
    if step is None:
        step = parse_step(name)
    return Checkpoint(run=run, name=name, step=step, path=str(path))


def _from_run_json(path: Path, run: str) -> list[Checkpoint]:
    """`run.json`: {"checkpoints": [...]} (or a bare list) of names or {"name"/"path", "step"} records."""
    raw = _read_json(path / "run.json")
    entries = raw.get("checkpoints", []) if isinstance(raw, dict) else raw
    if not isinstance(entries, list):
        raise ValueError(f"{path / 'run.json'} should hold a list of checkpoints under 'checkpoints'")
    out = []
    for e in entries:
        if isinstance(e, str):
            rel, step = e, None
        elif isinstance(e, dict):
            rel = e.get("path") or e.get("dir") or e.get("name")
            step = e.get("step") if isinstance(e.get("step"), int) else None
        else:
            raise ValueError(f"{path / 'run.json'}: cannot read checkpoint entry {e!r}")
        if rel is None:
            raise ValueError(f"{path / 'run.json'}: checkpoint entry {e!r} names no folder")
        out.append(_checkpoint(path / rel, run, Path(rel).name, step))
    return out


def _read_json(file: Path):
    if not file.is_file():
        return None
    try:
        return json.loads(file.read_text())
    except (json.JSONDecodeError, OSError):
        return None  # a broken meta.json costs the step, not the run; loading reports real damage


def zoo_path(name: str) -> Path | None:
    """The folder a zoo name resolves to (a bare run name: its latest checkpoint), or None."""
    try:
        resolved = zoo.resolve(name)  # a zoo run without the named step raises, listing its steps
    except (KeyError, ValueError):
        return None
    return Path(resolved) if resolved is not None else None
