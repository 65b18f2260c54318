"""Tensors on disk: our checkpoint format's writer, and the reader of every safetensors / PyTorch
weights file a checkpoint folder holds (ours or Hugging Face's).

Our format is a directory with `config.json` ({"interp_format": 1, "config": ModelConfig}) and
`model.safetensors` (tensors may be stored in fp16/bf16 and are restored to the requested dtype).
Nothing here builds a model, so the model itself can import `save_model` (`model.save`).
"""

from __future__ import annotations

import ctypes
import json
import math
import mmap
import os
import warnings
import weakref
from pathlib import Path
from typing import TYPE_CHECKING

import torch
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


class Joined:
    """Tensors joined along `dim`, not joined yet: a family's fused weight (W_qkv from separate q, k, v
    projections) made of views of a checkpoint's mapped files. Joining copies; held this way, a model that
    offloads its blocks (`interp.models.offload`) keeps the parts in the files and joins them into the block's
    memory only while it runs, and a model held whole joins each as it adopts it, one at a time. It answers
    what the loader asks of a tensor (shape, dtype, `to`, strides: a contiguous result's) and nothing else."""

    def __init__(self, parts: list[Tensor], dim: int) -> None:
        self.parts, self.dim = list(parts), dim
        first = self.parts[0]
        shape = list(first.shape)
        shape[dim] = sum(p.shape[dim] for p in self.parts)
        self.shape, self.dtype, self.device = torch.Size(shape), first.dtype, first.device

    def is_floating_point(self) -> bool:
        return self.dtype.is_floating_point

    def numel(self) -> int:
        return self.shape.numel()

    def _out_major(self) -> bool:
        """Matrices joined along their columns, each the transposed view of a contiguous [out, in] weight
        (nn.Linear's layout, `builders.t`): the joined matrix is then out-major too, one contiguous block."""
        return self.dim == 1 and all(p.dim() == 2 and p.stride() == (1, p.shape[0]) for p in self.parts)

    def stride(self) -> tuple:
        if self._out_major():
            return (1, self.shape[0])
        return torch.empty(self.shape, device="meta").stride()

    def to(self, *args, **kwargs) -> Tensor:
        """The joined tensor, each part moved or cast first (as `Tensor.to` takes them), in the layout
        `stride` reports: the values of casting the joined tensor, since a cast is elementwise."""
        if self._out_major():
            return torch.cat([p.to(*args, **kwargs).t() for p in self.parts], dim=0).t()
        return torch.cat([p.to(*args, **kwargs) for p in self.parts], dim=self.dim)

    def copy_into(self, dest: Tensor, non_blocking: bool = False) -> Tensor:
        """Write the joined tensor into `dest` (any layout, dtype, device), part by part: no joined copy."""
        start = 0
        for p in self.parts:
            dest.narrow(self.dim, start, p.shape[self.dim]).copy_(p, non_blocking=non_blocking)
            start += p.shape[self.dim]
        return dest


def fill(dest: Tensor, t, non_blocking: bool = False) -> Tensor:
    """Write `t` (a tensor, or a `Joined` part by part) into `dest`, whatever their layouts."""
    if isinstance(t, Joined):
        return t.copy_into(dest, non_blocking=non_blocking)
    return dest.copy_(t, non_blocking=non_blocking)


def tensors_of(t) -> list[Tensor]:
    """The tensors a loaded weight is made of: itself, or a `Joined`'s parts."""
    return t.parts if isinstance(t, Joined) else [t]


def read_state_dict(path: Path) -> dict[str, Tensor]:
    """All tensors of a checkpoint directory, with errors that name the file. Safetensors files are
    memory-mapped (`mapped_safetensors`): each tensor is a view of the file's bytes, read from disk when
    first touched and never copied here, so reading costs no memory until a conversion needs a copy."""
    single, index, pt = path / "model.safetensors", path / "model.safetensors.index.json", path / "pytorch_model.bin"
    if single.exists():
        return mapped_safetensors(single)
    if index.exists():
        return _read_sharded(index)
    if pt.exists():
        return read_pickled(pt)
    raise CheckpointError(f"{path} has no model.safetensors (nor a sharded index or pytorch_model.bin)")


def read_pickled(pt: Path) -> dict[str, Tensor]:
    """A `pytorch_model.bin`'s tensors, never running its code (weights_only), memory-mapped where the file is
    torch's zip format (every torch.save since 1.6): the tensors are views of the file's pages, as a safetensors
    file's are, so an offloaded model (`interp.models.offload`) keeps them on disk. An older file is read
    into memory."""
    try:
        try:
            return torch.load(pt, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError as e:
            if "zip" not in str(e).lower():  # not the old format: a damaged file, said below
                raise
            return torch.load(pt, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - re-raised with the file named
        raise CheckpointError(f"could not read {pt}: {e}") from e


def inside(folder: Path, name, what: str) -> Path:
    """`folder / name` for a file a checkpoint names (an index's shard, a tokenizer's file), refused unless it
    lies inside `folder`: a relative path, no `..`, no folder on the way that is a link out of it. The file
    itself may be a symbolic link (the Hugging Face cache's snapshots link every file to its blob). Otherwise a
    stranger's folder could make interp read, compute with and report on any file the user can read."""
    ok = isinstance(name, str) and name.strip() != "" and "\0" not in name and "\\" not in name
    if ok:
        parts = Path(name).parts
        ok = not Path(name).is_absolute() and ".." not in parts and len(parts) > 0
    if ok:
        root = os.path.realpath(folder)
        where = os.path.realpath((folder / name).parent)
        ok = where == root or where.startswith(root.rstrip(os.sep) + os.sep)
    if not ok:
        raise CheckpointError(f"{what} names {name!r}, which is not a file inside {folder} (an absolute path, a path "
                              "with .., or a folder that links out of it): interp reads a checkpoint's files from its "
                              "own folder only; fix the entry, or load the checkpoint it points at by its own path")
    return folder / name


def index_shards(index: Path) -> dict[str, Path]:
    """{tensor name: the shard file} of a `model.safetensors.index.json`, each shard checked to lie inside the
    index's folder (`inside`); one line naming the index when it is not an index or names a file elsewhere."""
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        if not isinstance(weight_map, dict):
            raise TypeError("weight_map is not an object")
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as e:
        raise CheckpointError(f"{index} is not a safetensors index ({type(e).__name__}: {e})") from None
    shards = {f: inside(index.parent, f, str(index)) for f in set(weight_map.values())}
    return {k: shards[f] for k, f in weight_map.items()}


def _read_sharded(index: Path) -> dict[str, Tensor]:
    """The tensors a `model.safetensors.index.json` names, each from the shard it names: a missing shard,
    a shard outside the index's folder, a tensor the index puts in a shard that does not hold it, or one
    that two shards hold, is one line naming the files."""
    where = index_shards(index)
    out: dict[str, Tensor] = {}
    held: dict[str, Path] = {}
    for shard in sorted(set(where.values())):
        if not shard.is_file():
            raise CheckpointError(f"{index} names the shard {shard.name}, which is not in {index.parent}: the download "
                                  "is incomplete")
        tensors = mapped_safetensors(shard)
        twice = sorted(k for k in tensors if k in held)
        if twice:
            raise CheckpointError(f"{shard.name} and {held[twice[0]].name} both hold tensor {twice[0]!r}"
                                  f"{f' (+{len(twice) - 1} more)' if len(twice) > 1 else ''}: which copy is the "
                                  f"model's is not known; the index ({index.name}) puts it in "
                                  f"{where[twice[0]].name if twice[0] in where else 'neither'}; remove the other copy")
        held.update(dict.fromkeys(tensors, shard))
        out.update(tensors)
    absent = sorted(k for k, f in where.items() if k not in out or held[k] != f)
    if absent:
        raise CheckpointError(f"{index} puts tensor {absent[0]!r} in {where[absent[0]].name}, which does not hold it"
                              f"{f' (+{len(absent) - 1} more)' if len(absent) > 1 else ''}: the index and the shards "
                              "do not belong together")
    return out


_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}


def safetensors_header(file: Path) -> tuple[dict, int]:
    """(the header's tensor entries, the byte offset where the data starts) of a safetensors file, checked
    against the file's size so that no tensor reaches past its end; CheckpointError naming the file."""
    bad = f"{file} is truncated or corrupt: re-save or re-download it"
    try:
        size = file.stat().st_size
        with open(file, "rb") as fh:
            head = fh.read(8)
            n = int.from_bytes(head, "little") if len(head) == 8 else -1
            if n < 2 or 8 + n > size:
                raise CheckpointError(f"could not read {file} (its header is {'missing' if n < 0 else 'cut off'}); {bad}")
            header = json.loads(fh.read(n))
    except OSError as e:
        raise CheckpointError(f"could not read {file} ({e})") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"could not read {file} (its header is not JSON: {e}); {bad}") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"could not read {file} (its header is not an object); {bad}")
    header.pop("__metadata__", None)
    start = 8 + n
    for name, e in header.items():
        try:
            dtype = _DTYPES[e["dtype"]]
            shape = [int(d) for d in e["shape"]]
            begin, end = (int(x) for x in e["data_offsets"])
        except (KeyError, TypeError, ValueError) as err:
            raise CheckpointError(f"could not read {file} (tensor {name!r}: {type(err).__name__} {err}); {bad}") from None
        numel = math.prod(shape)
        if min(shape, default=1) < 0 or not 0 <= begin <= end or end - begin != numel * dtype.itemsize or start + end > size:
            raise CheckpointError(f"could not read {file} (tensor {name!r} does not fit in the file); {bad}")
        e["torch_dtype"], e["shape"], e["data_offsets"] = dtype, shape, (begin, end)
    return header, start


def mapped_safetensors(file: Path) -> dict[str, Tensor]:
    """Every tensor of a safetensors file as a view of the file, memory-mapped copy-on-write: pages are read
    from disk when touched and stay file-backed (RssFile, reclaimable), never anonymous memory, until
    something writes to them (then that page alone is copied; the file never changes). A tensor whose
    offset is not aligned to its element size is copied (safetensors does not promise alignment)."""
    header, start = safetensors_header(file)
    mapped = None
    if any(e["data_offsets"][1] > e["data_offsets"][0] for e in header.values()):
        try:
            with open(file, "rb") as fh:
                mapped = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_COPY)
        except (OSError, ValueError) as e:
            raise CheckpointError(f"could not read {file} ({e})") from None
        _track(mapped)
    out = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        for name, e in header.items():
            dtype, shape, (begin, end) = e["torch_dtype"], e["shape"], e["data_offsets"]
            if end == begin:
                out[name] = torch.empty(shape, dtype=dtype)
                continue
            t = torch.frombuffer(mapped, dtype=torch.uint8, count=end - begin, offset=start + begin)
            if (start + begin) % dtype.itemsize:
                t = t.clone()
            out[name] = t.view(dtype).reshape(shape)
    return out


# The mappings `mapped_safetensors` made that are still alive: (the mmap, its address, its length). Held
# weakly: a mapping goes when the last tensor over it does, and its addresses may then be reused by
# anonymous memory, which `release_pages` must never touch (MADV_DONTNEED would zero it).
_LIVE: list[tuple[weakref.ref, int, int]] = []


def _track(mapped: mmap.mmap) -> None:
    view = ctypes.c_char.from_buffer(mapped)  # only to read the address; released at once (the mmap may close)
    address = ctypes.addressof(view)
    del view
    _LIVE[:] = [e for e in _LIVE if e[0]() is not None]
    _LIVE.append((weakref.ref(mapped), address, len(mapped)))


def _in_live_mapping(start: int, nbytes: int) -> bool:
    return any(ref() is not None and base <= start and start + nbytes <= base + length for ref, base, length in _LIVE)
_PAGE = mmap.PAGESIZE


def release_pages(tensors) -> None:
    """Hand the resident pages of memory-mapped tensors (`mapped_safetensors`'s) back to the kernel
    (madvise MADV_DONTNEED, Linux): the next read faults them in again from the page cache, so only what
    a load is touching now stays resident. Only for tensors nothing has written to (a private mapping's
    written page would be lost): a load calls it on what it has only read. Others are left alone."""
    if not _LIVE or not hasattr(mmap, "MADV_DONTNEED"):
        return
    for t in (p for x in tensors for p in tensors_of(x)):
        storage = t.untyped_storage()
        start = storage.data_ptr()
        if not _in_live_mapping(start, storage.nbytes()):  # anonymous memory: never (it would be zeroed)
            continue
        first, end = -(-start // _PAGE) * _PAGE, (start + storage.nbytes()) // _PAGE * _PAGE
        if end > first:
            _madvise(ctypes.c_void_p(first), ctypes.c_size_t(end - first), mmap.MADV_DONTNEED)


def _madvise(*args):
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
    return _libc.madvise(*args)


_libc = None


def header_shapes(file: Path) -> dict[str, tuple[int, ...]] | None:
    """{tensor name: shape} from a safetensors file's header, without reading any tensor; None when the
    header cannot be read (`read_state_dict` then reports the file)."""
    try:
        return {k: tuple(e["shape"]) for k, e in safetensors_header(file)[0].items()}
    except CheckpointError:  # an unreadable file is reported by read_state_dict, with its name
        return None
