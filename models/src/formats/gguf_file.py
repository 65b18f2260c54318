"""The GGUF container: header, metadata and tensor table, read straight from a memory map.

llama.cpp's `gguf` package has a reader too, but it builds a numpy view for every part of every
field: a Gemma 3 file's 262,144 vocabulary strings become ~3 million small arrays and ~11 s of the
load. This reads the same layout (https://github.com/ggml-org/ggml/blob/master/docs/gguf.md) with
`struct` in one pass: strings are decoded once, numeric arrays are one `np.frombuffer` each, and a
tensor's data is a read-only view of the map (nothing is copied until it is dequantized: `dequantize`).

    file = GGUFFile(path)
    file.fields["general.architecture"]     # 'gemma3' (scalars, strings, lists as Python values)
    t = file.tensors[0]; t.name, t.shape, t.tensor_type, t.data

`t.shape` lists dimensions fastest-first as GGUF does; `t.data` is what `gguf.quants.dequantize`
takes (float32/float16 elements, or uint8 rows of quantized blocks). A file that ends early, is not
GGUF, or holds a value type or tensor type this does not know raises ValueError naming what was
wrong (the loader turns it into one CheckpointError line).
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

_MAGIC = b"GGUF"
# value type id -> (struct format, numpy dtype) for the fixed-size kinds
_SCALARS = {0: ("<B", np.uint8), 1: ("<b", np.int8), 2: ("<H", np.uint16), 3: ("<h", np.int16),
            4: ("<I", np.uint32), 5: ("<i", np.int32), 6: ("<f", np.float32), 7: ("<?", np.bool_),
            10: ("<Q", np.uint64), 11: ("<q", np.int64), 12: ("<d", np.float64)}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    shape: tuple[int, ...]  # fastest-first, as stored
    tensor_type: object  # gguf.GGMLQuantizationType
    data: np.ndarray  # read-only view of the file


class GGUFFile:
    """One GGUF file: `fields` {key: value}, `tensors` [GGUFTensor] in file order, `alignment`."""

    def __init__(self, path) -> None:
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        self.path = Path(path)
        with open(self.path, "rb") as f:
            try:
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            except ValueError as e:  # an empty file cannot be mapped
                raise ValueError("the file is empty") from e
        buf, self._pos = self._map, 0
        if buf[:4] != _MAGIC:
            raise ValueError(f"it does not start with the GGUF magic bytes (found {bytes(buf[:4])!r})")
        self._pos = 4
        self.version = self._scalar("<I")
        if self.version not in (2, 3):
            raise ValueError(f"GGUF version {self.version} is not supported (2 and 3 are; big-endian files are not)")
        n_tensors, n_fields = self._scalar("<Q"), self._scalar("<Q")
        self.fields: dict[str, object] = {}
        for _ in range(n_fields):
            key = self._string()
            self.fields[key] = self._value(self._scalar("<I"))
        infos = []
        for _ in range(n_tensors):
            name = self._string()
            n_dims = self._scalar("<I")
            if n_dims > 8:
                raise ValueError(f"tensor {name!r} claims {n_dims} dimensions")
            dims = struct.unpack_from(f"<{n_dims}Q", buf, self._pos)
            self._pos += 8 * n_dims
            kind, offset = self._scalar("<I"), self._scalar("<Q")
            infos.append((name, tuple(int(d) for d in dims), kind, offset))
        self.alignment = int(self.fields.get("general.alignment", 32))
        if self.alignment < 1:
            raise ValueError(f"general.alignment = {self.alignment}")
        start = -(-self._pos // self.alignment) * self.alignment
        self.tensors: list[GGUFTensor] = []
        for name, dims, kind, offset in infos:
            try:
                qtype = GGMLQuantizationType(kind)
            except ValueError:
                raise ValueError(f"tensor {name!r} has an unknown type id {kind}") from None
            block, type_size = GGML_QUANT_SIZES[qtype]
            shape = dims[::-1]  # slowest-first, as numpy lays it out
            count = int(np.prod(dims, dtype=np.int64))
            if dims[0] % block:
                raise ValueError(f"tensor {name!r}: {dims[0]} elements per row is not a multiple of {qtype.name}'s block {block}")
            n_bytes = count // block * type_size
            at = start + offset
            if at + n_bytes > len(buf):
                raise ValueError(f"tensor {name!r} runs past the end of the file ({at + n_bytes} > {len(buf)} bytes)")
            if qtype == GGMLQuantizationType.F32:
                data = np.frombuffer(buf, np.float32, count, at).reshape(shape)
            elif qtype == GGMLQuantizationType.F16:
                data = np.frombuffer(buf, np.float16, count, at).reshape(shape)
            else:  # rows of quantized blocks, bytes last (what gguf.quants.dequantize takes)
                data = np.frombuffer(buf, np.uint8, n_bytes, at).reshape(*shape[:-1], dims[0] // block * type_size)
            self.tensors.append(GGUFTensor(name, dims, qtype, data))

    # ---- reading, each step checked against the end of the file ----
    def _need(self, n: int) -> None:
        if self._pos + n > len(self._map):
            raise ValueError(f"the file ends at byte {len(self._map)} while reading its header")

    def _scalar(self, fmt: str):
        size = struct.calcsize(fmt)
        self._need(size)
        (value,) = struct.unpack_from(fmt, self._map, self._pos)
        self._pos += size
        return value

    def _string(self) -> str:
        n = self._scalar("<Q")
        self._need(n)
        raw = self._map[self._pos:self._pos + n]
        self._pos += n
        return raw.decode("utf-8", errors="replace")

    def _value(self, kind: int):
        if kind in _SCALARS:
            return self._scalar(_SCALARS[kind][0])
        if kind == _STRING:
            return self._string()
        if kind == _ARRAY:
            item, n = self._scalar("<I"), self._scalar("<Q")
            if item == _STRING:
                return [self._string() for _ in range(n)]
            if item in _SCALARS:
                dtype = np.dtype(_SCALARS[item][1]).newbyteorder("<")
                self._need(n * dtype.itemsize)
                values = np.frombuffer(self._map, dtype, n, self._pos)
                self._pos += n * dtype.itemsize
                return values.tolist()
            return [self._value(item) for _ in range(n)]  # arrays of arrays
        raise ValueError(f"unknown metadata value type {kind} at byte {self._pos}")


def dequantize(data: np.ndarray, qtype) -> np.ndarray:
    """float32 values of a GGUF tensor: `gguf.quants`' dequantizers, applied to ~4M-value slabs of rows
    (the package's own entry applies them 16 rows per call: 16k calls for Gemma's embedding)."""
    import gguf

    kind = getattr(gguf.quants, "_type_traits", {}).get(qtype)  # private: older or newer packages may lack it
    if kind is None or data.ndim < 2 or not hasattr(kind, "dequantize_rows"):
        return gguf.quants.dequantize(data, qtype)
    block, type_size = gguf.GGML_QUANT_SIZES[qtype]
    rows = data.reshape(-1, data.shape[-1])
    per_row = rows.shape[1] // type_size * block
    out = np.empty((rows.shape[0], per_row), np.float32)
    if hasattr(kind, "init_grid"):
        kind.init_grid()
    step = max(1, (1 << 22) // per_row)
    for i in range(0, rows.shape[0], step):
        out[i:i + step] = kind.dequantize_rows(rows[i:i + step]).reshape(-1, per_row)
    return out.reshape(*data.shape[:-1], per_row)


__all__ = ["GGUFFile", "GGUFTensor", "dequantize"]
