"""Our checkpoint format: a directory with `config.json` ({"interp_format": 1, "config": ModelConfig})
and `model.safetensors` (tensors may be stored in fp16/bf16 and are restored to the requested dtype).

This is the model's own serialization, so it lives with the model (training writes checkpoints);
finding checkpoints by name, converting other formats (Hugging Face, GGUF) and `interp.load` are
the user surface's (`interp.loading`), which calls in here.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Callable

import torch
from torch import Tensor

from .components import relayout_mlp_
from .config import ModelConfig
from .families import get_family
from .transformer import HookedTransformer

FORMAT_VERSION = 1


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be read: missing, truncated or corrupt file, missing or mismatched tensor."""


def save_model(model: HookedTransformer, path, dtype: torch.dtype | None = None, meta: dict | None = None) -> Path:
    """Write `config.json` + `model.safetensors` (+ `meta.json` when given) to the directory `path`.

    `dtype` (e.g. torch.float16) stores the weights smaller; `load` restores float32 by default."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    sd = {k: (v.to(dtype) if dtype is not None and v.is_floating_point() else v).detach().contiguous().cpu()
          for k, v in model.state_dict().items()}
    tmp = path / "model.safetensors.tmp"
    save_file(sd, str(tmp), metadata={"interp_format": str(FORMAT_VERSION)})
    os.replace(tmp, path / "model.safetensors")
    (path / "config.json").write_text(json.dumps({"interp_format": FORMAT_VERSION, "config": model.cfg.to_dict()}, indent=2))
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


def build_model(cfg: ModelConfig, sd: dict[str, Tensor], source: str, dtype, device, *,
                fresh: bool = False) -> HookedTransformer:
    """A model holding the state dict `sd` (checked against the config's shapes). With `fresh` (the
    tensors belong to no one else, e.g. just read from a file), the model adopts them without a copy."""
    with torch.device("meta"):
        model = HookedTransformer(cfg, seed=None)
    expected = {k: v.shape for k, v in model.state_dict().items()}
    missing = sorted(set(expected) - set(sd))
    if missing:
        raise CheckpointError(f"{source} is missing tensors {missing[:5]}{' ...' if len(missing) > 5 else ''} for this config")
    unexpected = sorted(set(sd) - set(expected))
    if unexpected:
        raise CheckpointError(f"{source} has tensors this config does not use: {unexpected[:5]}")
    for k, shape in expected.items():
        if tuple(sd[k].shape) != tuple(shape):
            raise CheckpointError(f"tensor {k!r} in {source} has shape {tuple(sd[k].shape)}, the config implies {tuple(shape)}")
    if fresh:
        target = torch.device(device or "cpu")
        owned = {k: (v.to(device=target, dtype=dtype) if v.is_floating_point() else v.to(target)).contiguous()
                 for k, v in sd.items()}
        model.load_state_dict(owned, strict=True, assign=True)
    else:
        model = model.to_empty(device=device or "cpu")
        model.load_state_dict({k: v.to(dtype) if v.is_floating_point() else v for k, v in sd.items()}, strict=True)
    model.to(dtype)
    for block in model.blocks:  # adopted tensors are contiguous: back to the MLP's out-major layout
        relayout_mlp_(block.mlp)
    # Buffers (rotary frequencies, sinusoidal tables, ALiBi slopes) were on the meta device: rebuild them.
    _rebuild_buffers(model, cfg)
    return model.eval()


def _rebuild_buffers(model: HookedTransformer, cfg: ModelConfig) -> None:
    from .positions import Rotary, alibi_slopes, sinusoidal_table

    device = model.device
    if model.rotary is not None:
        model.rotary.inv_freq = Rotary(cfg).inv_freq.to(device)
    if cfg.positional == "sinusoidal":
        model.pos_embed.W_pos = sinusoidal_table(cfg.n_ctx, cfg.d_model).to(device, model.dtype)
    if cfg.positional == "alibi":
        for b in model.blocks:
            b.attn.alibi_slopes = alibi_slopes(cfg.n_heads).to(device)


def load_checkpoint(path, *, dtype: torch.dtype = torch.float32, device: torch.device | str | None = None,
                    tokenizer=None) -> HookedTransformer:
    """A model from a local checkpoint directory (or a file inside it): our format, or a Hugging Face
    checkpoint converted by its family (by config.json's `model_type`), without `transformers`;
    or a llama-architecture `.gguf` file (`interp.models.gguf`)."""
    path = Path(path)
    if path.suffix == ".gguf":
        from .gguf import load_gguf

        return load_gguf(path, dtype=dtype, device=device, tokenizer=tokenizer)
    if path.is_file():
        path = path.parent
    config_file = path / "config.json"
    if not config_file.exists():
        raise CheckpointError(f"{path} has no config.json; a checkpoint directory needs config.json and model.safetensors")
    try:
        raw = json.loads(config_file.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{config_file} is not valid JSON ({e}); the file is truncated or corrupt") from None
    if "interp_format" in raw:
        cfg = ModelConfig.from_dict(raw["config"])
        sd = read_state_dict(path)
        model = build_model(cfg, sd, str(path / "model.safetensors"), dtype, device)
    else:
        family = get_family(raw.get("model_type"))
        cfg = family.config(raw)
        tensors = read_state_dict(path)
        sd = convert_weights(family, cfg, tensors, str(path))
        model = build_model(cfg, sd, str(path), dtype, device)
    model.tokenizer = tokenizer if tokenizer is not None else local_tokenizer(path)
    return model


def read_config(path) -> ModelConfig:
    """The ModelConfig of a checkpoint (folder, file inside one, or .gguf) without reading its weights."""
    path = Path(path)
    if path.suffix == ".gguf":
        from .gguf import _reader, hf_config

        config = hf_config(_reader(path), str(path))
        return get_family(config["model_type"]).config(config)
    if path.is_file():
        path = path.parent
    try:
        raw = json.loads((path / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"cannot read {path / 'config.json'} ({e})") from None
    if "interp_format" in raw:
        return ModelConfig.from_dict(raw["config"])
    return get_family(raw.get("model_type")).config(raw)


def _getter(tensors: dict[str, Tensor], source: str) -> Callable[[str], Tensor]:
    """get(name, *alternatives): a tensor by its Hugging Face name (or the first alternative name
    present, e.g. Pythia's `embed_out` vs transformers 5's `lm_head`), tolerating a missing or extra
    base-model prefix."""

    def get(*names: str) -> Tensor:
        get.last = names[0]
        for name in names:
            short = name.split(".", 1)[1] if "." in name else name
            for cand in (name, short, f"model.{short}", f"transformer.{short}", f"gpt_neox.{short}"):
                if cand in tensors:
                    get.used.add(cand)
                    return tensors[cand]
        raise CheckpointError(f"{source} has no tensor {' or '.join(map(repr, names))} (it holds {len(tensors)} tensors)")

    get.used, get.last = set(), None  # what the conversion read: unread tensors are an error (see _convert)
    return get


# Buffers some checkpoints carry that hold no weights (causal masks, rotary frequencies).
_NOT_WEIGHTS = (".attn.bias", ".attn.masked_bias", ".attention.bias", ".attention.masked_bias", "rotary_emb.inv_freq")


def convert_weights(family, cfg: ModelConfig, tensors: dict[str, Tensor], source: str) -> dict[str, Tensor]:
    """A family's weight mapping, failing loudly: a tensor it cannot convert, or a checkpoint tensor it
    does not read (a weight the config does not describe, e.g. a bias the config turns off), raises."""
    get = _getter(tensors, source)
    try:
        sd = family.weights(cfg, get)
    except CheckpointError:
        raise
    except (RuntimeError, ValueError, IndexError) as e:
        raise CheckpointError(
            f"{source}: could not convert the {family.name} weights at tensor {get.last!r} ({e}); "
            "do config.json and the weights belong to the same model?"
        ) from e
    unread = sorted(k for k in tensors if k not in get.used and not k.endswith(_NOT_WEIGHTS))
    tied = [k for k in unread if k.endswith("lm_head.weight") and cfg.tie_embeddings]
    for k in tied:  # transformers keeps the tied head in state_dict(); it must be the embedding
        if not torch.equal(tensors[k], sd["embed.W_E"]):
            raise CheckpointError(f"{source}: the config ties the embeddings but {k!r} differs from the embedding matrix")
        unread.remove(k)
    if unread:
        raise CheckpointError(
            f"{source} has tensors the {family.name} conversion does not use: {unread[:5]}{' ...' if len(unread) > 5 else ''}; "
            "the config does not describe these weights (e.g. a bias or norm the config turns off)"
        )
    return sd


def local_tokenizer(path: Path):
    """The tokenizer saved beside a checkpoint (ours, e.g. the zoo's bytes; else Hugging Face files), or None."""
    from .tokenizer import load_tokenizer

    ours = load_tokenizer(path)
    if ours is not None:
        return ours
    if not any((path / f).exists() for f in ("tokenizer.json", "tokenizer_config.json", "vocab.json")):
        return None
    try:
        from transformers import AutoTokenizer
    except ImportError:
        return None
    try:
        return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except Exception:  # noqa: BLE001 - a broken tokenizer must not stop the model from loading
        return None
