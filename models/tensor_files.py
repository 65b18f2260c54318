"""Tensors on disk: our checkpoint format's writer, and the reader of every safetensors / PyTorch
weights file a checkpoint folder holds (ours or Hugging Face's).

Our format is a directory with `config.json` ({"interp_format": 1, "config": ModelConfig}) and
`model.safetensors` (tensors may be stored in fp16/bf16 and are restored to the requested dtype).
Nothing here builds a model, so the model itself can import `save_model` (`model.save`).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor

from interp.errors import CheckpointError

if TYPE_CHECKING:
    from .transformer import HookedTransformer

FORMAT_VERSION = 1


def save_model(model: "HookedTransformer", path, dtype: torch.dtype | None = None, meta: dict | None = None) -> Path:
    """Write `config.json` + `model.safetensors` (+ `meta.json` when given) to the directory `path`.

    `dtype` (e.g. torch.float16) stores the weights smaller; `load` restores float32 by default."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    sd = {k: (v.to(dtype) if dtype is not None and v.is_floating_point() else v).detach().contiguous().cpu()
          for k, v in model.state_dict().items()}
    tmp = path / "model.safetensors.tmp"
    save_file(sd, str(tmp), metadata={"interp_format": str(FORMAT_VERSION)})
    os.replace(tmp, path / "model.safetensors")
    cfg = model.cfg
    override = getattr(getattr(model, "runtime", None), "prepend_bos", None)
    if override is not None:  # a BOS default the model was loaded with is kept with it
        cfg = cfg.replace(prepend_bos=override)
    (path / "config.json").write_text(json.dumps({"interp_format": FORMAT_VERSION, "config": cfg.to_dict()}, indent=2))
    if meta is not None:
        (path / "meta.json").write_text(json.dumps(meta, indent=2))
    if model.tokenizer is not None and hasattr(model.tokenizer, "save_pretrained"):
        model.tokenizer.save_pretrained(str(path))
    return path


def read_state_dict(path: Path) -> dict[str, Tensor]:
    """All tensors of a checkpoint directory, with errors that name the file."""
    single, index, pt = path / "model.safetensors", path / "model.safetensors.index.json", path / "pytorch_model.bin"
    if single.exists():
        return _read_safetensors(single)
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        out: dict[str, Tensor] = {}
        for f in files:
            out.update(_read_safetensors(path / f))
        return out
    if pt.exists():
        try:
            return torch.load(pt, map_location="cpu", weights_only=True)
        except Exception as e:  # noqa: BLE001 - re-raised with the file named
            raise CheckpointError(f"could not read {pt}: {e}") from e
    raise CheckpointError(f"{path} has no model.safetensors (nor a sharded index or pytorch_model.bin)")


def _read_safetensors(file: Path) -> dict[str, Tensor]:
    from safetensors import safe_open

    try:
        with safe_open(str(file), framework="pt") as f:
            return {k: f.get_tensor(k) for k in f.keys()}
    except Exception as e:  # noqa: BLE001 - safetensors raises several types; name the file
        raise CheckpointError(
            f"could not read {file} ({type(e).__name__}: {e}); the file is truncated or corrupt: re-save or re-download it"
        ) from e


def header_shapes(file: Path) -> dict[str, tuple[int, ...]] | None:
    """{tensor name: shape} from a safetensors file's header, without reading any tensor; None when the
    header cannot be read (`read_state_dict` then reports the file)."""
    try:
        with safe_open(str(file), framework="pt") as f:
            return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    except Exception:  # noqa: BLE001 - an unreadable file is reported by read_state_dict, with its name
        return None
