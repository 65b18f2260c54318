"""What a checkpoint folder holds besides its weights: the tokenizer saved beside them, and code,
which never runs. Shared by our format and Hugging Face's folders."""

from __future__ import annotations

import json
from pathlib import Path

from interp.errors import OwnCodeRefused
from ..placement.tensor_files import index_shards, inside
from .tokenizer import load_tokenizer

INDEX = "model.safetensors.index.json"


def _auto_map(raw) -> list[str]:
    """What an `auto_map` maps to the folder's code: its keys (a dict, as transformers writes it), or, in any
    other shape (a list, a string: transformers would trip over it, or read it as a class path), the value
    itself. Any non-empty `auto_map` is code, refused."""
    value = raw.get("auto_map") if isinstance(raw, dict) else None
    if not value:
        return []
    if isinstance(value, dict):
        return sorted(str(k) for k in value)
    return [str(v) for v in value] if isinstance(value, (list, tuple)) else [repr(value)]


def refuse_own_code(path: Path, config: dict, *, tokenizer_given: bool) -> None:
    """Code in a checkpoint folder never runs. A folder whose config.json maps a class to its own Python
    files (`auto_map`, which transformers would import with trust_remote_code) is refused: its model
    is whatever that code computes, which no family here can vouch for. A tokenizer_config.json with an
    `auto_map` is refused unless the caller brings its own tokenizer (then the folder's is never read).
    Raises CheckpointError with one line that says how to load such a folder knowingly."""
    mapped = _auto_map(config)
    if mapped:
        raise OwnCodeRefused(
            f"{path / 'config.json'} maps {', '.join(mapped)} to code in the checkpoint folder (auto_map); "
            "interp never runs a checkpoint's code. If you trust it, read that code, load the model yourself "
            "(transformers' AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)) and convert it "
            "with interp.from_hf(hf_model)")
    if tokenizer_given:
        return
    file = path / "tokenizer_config.json"
    try:
        mapped = _auto_map(json.loads(file.read_text())) if file.is_file() else []
    except (OSError, json.JSONDecodeError, UnicodeDecodeError):
        mapped = []  # an unreadable tokenizer config loads no tokenizer (local_tokenizer), and runs nothing
    if mapped:
        raise OwnCodeRefused(
            f"{file} maps {', '.join(mapped)} to code in the checkpoint folder (auto_map); interp never "
            "runs a checkpoint's code. If you trust it, read that code, load the tokenizer yourself "
            "(AutoTokenizer.from_pretrained(folder, trust_remote_code=True)) and pass it: "
            "interp.load(folder, tokenizer=tok)")


def refuse_files_outside(path: Path, config: dict, *, tokenizer_given: bool) -> None:
    """Every file a checkpoint folder names stays inside it (`tensor_files.inside`): each shard of its
    `model.safetensors.index.json`, and each `..._file` entry of its config.json and (unless the caller brings
    its own tokenizer, so the folder's is never read) its tokenizer_config.json. A shard that is itself a
    symbolic link stays allowed: that is the Hugging Face cache's layout. Raises CheckpointError, one line,
    before any weight or tokenizer is read (transformers' own from_pretrained would follow such an entry)."""
    if (path / INDEX).is_file():
        index_shards(path / INDEX)
    named = [("config.json", config)]
    if not tokenizer_given:
        try:
            tok = json.loads((path / "tokenizer_config.json").read_text())
        except (OSError, json.JSONDecodeError, UnicodeDecodeError):
            tok = None  # absent or unreadable: no tokenizer is loaded from it (local_tokenizer)
        named.append(("tokenizer_config.json", tok))
    for file, raw in named:
        for key, value in (raw.items() if isinstance(raw, dict) else ()):
            if isinstance(key, str) and key.endswith("_file") and isinstance(value, str) and value:
                inside(path, value, f"{path / file}'s {key}")


def refuse_code_in(path) -> None:
    """`refuse_own_code` and `refuse_files_outside` for a checkpoint path as a sweep lists it (a folder, a file inside one, or a
    .gguf file, which carries no code), reading only its JSON: cheap enough to run on every checkpoint
    of a sweep before any work. An unreadable config.json is left to the loader to report."""
    path = Path(path)
    if path.suffix == ".gguf":
        return
    folder = path.parent if path.is_file() else path
    try:
        raw = json.loads((folder / "config.json").read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError):
        return
    raw = raw if isinstance(raw, dict) else {}
    refuse_own_code(folder, raw, tokenizer_given=False)
    refuse_files_outside(folder, raw, tokenizer_given=False)


def local_tokenizer(path: Path):
    """The tokenizer saved beside a checkpoint (ours, e.g. the zoo's bytes; else Hugging Face files), or None."""
    ours = load_tokenizer(path)
    if ours is not None:
        return ours
    if not any((path / f).exists() for f in ("tokenizer.json", "tokenizer_config.json", "vocab.json")):
        return None
    try:
        from transformers import AutoTokenizer  # optional third-party package: only for a folder's tokenizer files
    except ImportError:
        return None
    try:
        # trust_remote_code=False: never import the folder's code, and never prompt for it (refuse_own_code
        # has refused the folders that need it; this is the second lock).
        return AutoTokenizer.from_pretrained(str(path), local_files_only=True, trust_remote_code=False)
    except Exception:  # noqa: BLE001 - a broken tokenizer must not stop the model from loading
        return None
