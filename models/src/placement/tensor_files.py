"""Tensors on disk: our checkpoint format's writer, and the reader of every safetensors / PyTorch
weights file a checkpoint folder holds (ours or Hugging Face's).

Our format is a directory with `config.json` ({"interp_format": 1, "config": ModelConfig}) and
`model.safetensors` (tensors may be stored in fp16/bf16 and are restored to the requested dtype).
Nothing here builds a model, so the model itself can import `save_model` (`model.save`).

The checkpoint's file while a model lives. A loaded model's weights are, where their dtype and layout
allow, the file's own pages, mapped copy-on-write (`mapped_safetensors`; a zip-format `pytorch_model.bin`
through torch's mapping, `read_pickled`): the kernel reads a page from the file when it is touched, and
drops it again when memory is short or an offloaded block is done with it (`release_pages`), to read it
anew next time. So the file must not change under a live model. What a user must not do, and what
interp does if they do (`MappedFile.check`, run before every forward of a native model,
`HookedModel.check_weight_files`, and before an offloaded block brings its weights in,
`interp.models.placement.offload`; one `os.stat` of each mapped file, nothing for a model whose weights were copied):

    written over in place (a trainer saving to the same path, `cp` onto it, `open(path, "r+b")`): the
        next forward would compute with the new bytes, NaN included, though NaN is refused at load. The
        file's size or modification time (ns) differs from the load's on the same inode: refused in one
        line, `CheckpointChanged`, naming the file: reload the model after the file is written.
    truncated in place (`os.truncate`, a copy that starts by emptying the file): touching a page past the
        new end kills the process with SIGBUS, which Python cannot turn into an exception (a SIGBUS
        handler returns to the faulting instruction, which faults again). The size check refuses it in
        one line before a forward, or an offloaded block, touches a page.
    replaced by a new file (`os.replace` onto the path, as `save_model` writes; `rm`; a Hugging Face
        cache's link pointed at a new blob): the mapping keeps the old inode's pages, so the model still
        computes with exactly the weights it loaded and checked, as a model whose weights were copied out
        of the file does, and nothing is wrong with its numbers. It is not refused: refusing would make
        every live model stop when a checkpoint is re-saved the safe way; but the path no longer holds
        what the model computes with, so it warns once per file (`CheckpointReplaced`), saying so.

What is not caught: a file changed during one forward of a model held whole (checked once per forward;
an offloaded model checks each block), weights read outside a forward (`model.W_Q`, `state_dict()` of
a model held whole), a write that keeps the size within a few ms of the file's previous write (mtime ticks
with the kernel's coarse clock, so both can carry the same time), and writes to the old inode after the
path was replaced (through another hard link); nor a wrapped model (transformers holds its weights). A truncation in
those windows still kills the process with SIGBUS, with no message; `python -X faulthandler` (or
`faulthandler.enable()`) makes Python print "Fatal Python error: Bus error" and the stack before it dies.
Never write over a checkpoint a live model reads: copy it elsewhere first, or write the new file beside
it and move it into place.
"""

from __future__ import annotations

import ctypes
import json
import math
import mmap
import os
import time
import warnings
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors.torch import save_file
from torch import Tensor

from interp.errors import CheckpointError

if TYPE_CHECKING:
    from ..native.transformer import HookedTransformer

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
    offloads its blocks (`interp.models.placement.offload`) keeps the parts in the files and joins them into the block's
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
    file's are, so an offloaded model (`interp.models.placement.offload`) keeps them on disk. An older file is read
    into memory."""
    try:
        try:
            seen = os.stat(pt)  # what torch maps next: the file as it was when loaded (`MappedFile`)
            tensors = torch.load(pt, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError as e:
            if "zip" not in str(e).lower():  # not the old format: a damaged file, said below
                raise
            return torch.load(pt, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - re-raised with the file named
        raise CheckpointError(f"could not read {pt}: {e}") from e
    _track_torch_mapping(pt, seen, tensors)
    return tensors


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
                seen = os.fstat(fh.fileno())  # the inode mapped, as it is now (`MappedFile.check`)
        except (OSError, ValueError) as e:
            raise CheckpointError(f"could not read {file} ({e})") from None
        _track(mapped, file, seen)
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


# ---- the files mapped, and whether they are still what was loaded ------------------------------------------
class CheckpointChanged(CheckpointError):
    """A checkpoint file that live weights are mapped from changed on disk (written over or truncated in
    place) since the load: computing on would read other weights, or die of SIGBUS (see the module's docstring)."""


class CheckpointReplaced(UserWarning):
    """A checkpoint file a live model was loaded from is no longer at its path (replaced by a new file, or
    removed): the model still computes with the weights it loaded, not with the file now at the path."""


@dataclass(eq=False)
class MappedFile:
    """One checkpoint file whose pages live tensors are: its path; what the file was when it was mapped
    (size, modification time in ns, inode, device); the addresses the mapping spans; weak references to
    what holds the mapping (the mmap, or torch's storages), so a mapping nothing uses is never checked again,
    and its addresses, which anonymous memory may reuse, are never released (`release_pages`)."""

    path: str
    size: int
    mtime_ns: int
    ino: int
    dev: int
    address: int
    length: int
    refs: tuple
    releasable: bool  # ours (`mapped_safetensors`); torch's mapping of a .bin is left to torch
    told: bool = False  # the one warning that the path now holds another file was given

    @classmethod
    def of(cls, path, seen: os.stat_result, address: int, length: int, refs, releasable: bool) -> "MappedFile":
        return cls(str(path), seen.st_size, seen.st_mtime_ns, seen.st_ino, seen.st_dev, address, length,
                   tuple(refs), releasable)

    @property
    def alive(self) -> bool:
        return any(r() is not None for r in self.refs)

    def spans(self, start: int, nbytes: int) -> bool:
        return self.address <= start and start + nbytes <= self.address + self.length

    def check(self) -> None:
        """Raise `CheckpointChanged` when the file was written over or truncated in place since it was mapped;
        warn once (`CheckpointReplaced`) when its path now names another file or none. One `os.stat`."""
        if not self.alive:
            return
        try:
            now = os.stat(self.path)
        except OSError:
            return self._tell("was removed")
        if (now.st_ino, now.st_dev) != (self.ino, self.dev):
            return self._tell(f"was replaced by a new file (inode {self.ino} -> {now.st_ino})")
        if now.st_size != self.size or now.st_mtime_ns != self.mtime_ns:
            raise CheckpointChanged(self._changed(now))

    def _changed(self, now: os.stat_result) -> str:
        if now.st_size < self.size:
            what = (f"truncated from {self.size:,} to {now.st_size:,} bytes; touching a weight past its new end "
                    "would kill the process with SIGBUS")
        elif now.st_size != self.size:
            what = f"size {self.size:,} -> {now.st_size:,} bytes"
        else:
            what = (f"written over in place: same size and inode, modified at {_when(now.st_mtime_ns)}, loaded at "
                    f"{_when(self.mtime_ns)}")
        return (f"{self.path} changed on disk while a model loaded from it is alive ({what}): the model's weights "
                "are that file's memory-mapped pages, so it would compute with whatever the file holds now. Reload "
                "the model (interp.load) after the file is written, and never write over a checkpoint that a live "
                "model reads: copy it elsewhere first, or write the new file beside it and move it into place "
                "(os.replace, as interp.save_model does)")

    def _tell(self, what: str) -> None:
        if not self.told:
            self.told = True
            warnings.warn(f"{self.path} {what} while a model loaded from it is alive: the model keeps computing with "
                          "the weights it loaded (the old file's pages stay mapped), not with the file now at that "
                          "path; reload the model (interp.load) to use the new file", CheckpointReplaced, stacklevel=2)


def _when(ns: int) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ns // 10**9)) + f".{ns % 10**9:09d}"


# The files mapped whose mappings are still alive: `MappedFile` records, pruned as their mappings go.
_LIVE: list[MappedFile] = []


def _track(mapped: mmap.mmap, file: Path, seen: os.stat_result) -> None:
    view = ctypes.c_char.from_buffer(mapped)  # only to read the address; released at once (the mmap may close)
    address = ctypes.addressof(view)
    del view
    _remember(MappedFile.of(file, seen, address, len(mapped), [weakref.ref(mapped)], releasable=True))


def _track_torch_mapping(file: Path, seen: os.stat_result, tensors) -> None:
    """torch.load(mmap=True) maps the whole file and gives every tensor a storage sliced from it: the mapping
    lives while any of those storages does, and spans at least their addresses."""
    storages = {}
    for t in tensors.values() if isinstance(tensors, dict) else ():
        if isinstance(t, Tensor) and t.device.type == "cpu" and t.untyped_storage().nbytes():
            s = t.untyped_storage()
            storages[s.data_ptr()] = s
    if storages:
        start = min(storages)
        end = max(p + s.nbytes() for p, s in storages.items())
        _remember(MappedFile.of(file, seen, start, end - start, [weakref.ref(s) for s in storages.values()],
                                releasable=False))


def _remember(record: MappedFile) -> None:
    _LIVE[:] = [e for e in _LIVE if e.alive]
    _LIVE.append(record)


def _in_live_mapping(start: int, nbytes: int) -> bool:
    return any(e.releasable and e.alive and e.spans(start, nbytes) for e in _LIVE)


def mapped_files(tensors) -> tuple[MappedFile, ...]:
    """The live mapped files (`MappedFile`) that any of `tensors` (tensors or `Joined`) is a view of, once
    each, in the order found: what a model reading them must check (`check_files`). Empty for copies."""
    found: dict[int, MappedFile] = {}
    live = [e for e in _LIVE if e.alive]
    if not live:
        return ()
    for t in (p for x in tensors for p in tensors_of(x)):
        if not isinstance(t, Tensor) or t.device.type != "cpu":
            continue
        storage = t.untyped_storage()
        start, nbytes = storage.data_ptr(), storage.nbytes()
        for e in live:
            if e.spans(start, nbytes):
                found.setdefault(id(e), e)
    return tuple(found.values())


def check_files(files) -> None:
    """`MappedFile.check` each of `files`: raise `CheckpointChanged` for the first one written over or truncated
    since it was mapped (warn once for one replaced)."""
    for f in files:
        f.check()


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
