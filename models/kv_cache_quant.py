"""A KV cache that stores keys (after RoPE, as cached) and values quantized: int8, fp8 (e4m3) or
int4 codes with one float32 scale per (batch, KV head, position) vector, or a full precision (fp32,
fp16, bf16), for the whole cache or per (layer, KV head) through a precision map. Attention reads
the dequantized values, in prefill and in every decoding step, so a forward or `generate` through
this cache is what a serving stack with that cache computes. The scheme: `interp.kernels.kv_quant`.

    cache = model.new_kv_cache(1, 2048, precision="int8")
    cache = model.new_kv_cache(1, 2048, precision={(0, 1): "fp32"}, default="int4")   # L0 KV head 1 kept
"""

from __future__ import annotations

from typing import Mapping

import torch
from torch import Tensor

from interp.kernels.kv_quant import check_precision, code_dtype, code_shape, dequantize, quantize

from .kv_cache import KVCache

PrecisionMap = Mapping[tuple[int, int], str]


def resolve_precisions(precision, n_layers: int, n_kv_heads: int, default: str = "fp32") -> list[list[str]]:
    """[layer][kv head] -> precision name, from one name or a {(layer, kv_head): name} map (the rest
    `default`); a layer or head the model does not have is an error."""
    check_precision(default)
    grid = [[default] * n_kv_heads for _ in range(n_layers)]
    if isinstance(precision, str):
        check_precision(precision)
        return [[precision] * n_kv_heads for _ in range(n_layers)]
    for key, name in dict(precision).items():
        try:
            layer, head = key
        except (TypeError, ValueError):
            raise ValueError(f"a precision map is keyed by (layer, kv_head) pairs, got {key!r}") from None
        if not (0 <= layer < n_layers and 0 <= head < n_kv_heads):
            raise ValueError(f"precision map names layer {layer}, KV head {head}; this model has layers 0..{n_layers - 1} "
                             f"and KV heads 0..{n_kv_heads - 1}")
        grid[layer][head] = check_precision(name)
    return grid


class PrecisionStore:
    """Codes (and scales) of a group of KV heads of one layer that share a precision."""

    def __init__(self, precision: str, heads: list[int], batch: int, max_len: int, d_head: int, device) -> None:
        self.precision, self.heads = precision, heads
        self.index = torch.tensor(heads, device=device)
        shape = (batch, len(heads), max_len)
        self.codes = [torch.zeros(*shape, code_shape(precision, d_head), dtype=code_dtype(precision), device=device)
                      for _ in range(2)]  # keys, values
        self.scales = [None if precision in ("fp32", "fp16", "bf16") else torch.zeros(shape, device=device)
                       for _ in range(2)]

    def write(self, which: int, x: Tensor, start: int) -> None:
        codes, scale = quantize(x[:, self.index], self.precision)
        self.codes[which][:, :, start : start + x.shape[2]] = codes
        if scale is not None:
            self.scales[which][:, :, start : start + x.shape[2]] = scale

    def read(self, which: int, end: int, dtype: torch.dtype) -> Tensor:
        scale = None if self.scales[which] is None else self.scales[which][:, :, :end]
        return dequantize(self.codes[which][:, :, :end], scale, self.precision, dtype)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.codes, *self.scales) if t is not None)


class QuantizedKVCache(KVCache):
    """`KVCache` with quantized storage (module docstring). Reading (`k`, `v`, what attention sees)
    returns dequantized tensors in the cache's dtype; `nbytes` counts the codes and scales held."""

    def __init__(self, *args, precision="int8", default: str = "fp32", **kwargs) -> None:
        self._precision_arg, self._default = precision, default
        super().__init__(*args, **kwargs)

    def _allocate(self, shape: tuple, dtype: torch.dtype, device) -> None:
        n_layers, batch, kv, max_len, d_head = shape
        self.shape = shape
        self.precisions = resolve_precisions(self._precision_arg, n_layers, kv, self._default)
        self.stores: list[list[PrecisionStore]] = []
        for layer in range(n_layers):
            groups: dict[str, list[int]] = {}
            for head, name in enumerate(self.precisions[layer]):
                groups.setdefault(name, []).append(head)
            self.stores.append([PrecisionStore(name, heads, batch, max_len, d_head, device) for name, heads in groups.items()])

    @property
    def nbytes(self) -> int:
        """Bytes of keys and values as stored: codes plus scales, every layer."""
        return sum(s.nbytes for layer in self.stores for s in layer)

    def bytes_per_token(self) -> float:
        """Stored bytes per cached token (all layers, keys and values, scales included), per sequence."""
        return self.nbytes / (self.max_len * self.batch_size)

    def __repr__(self) -> str:
        names = sorted({p for layer in self.precisions for p in layer})
        return (f"QuantizedKVCache(layers={self.shape[0]}, batch={self.batch_size}, kv_heads={self.shape[2]}, "
                f"d_head={self.shape[4]}, length={self.length}/{self.max_len}, precisions {'/'.join(names)}, "
                f"{self.nbytes / 2**20:.2f} MiB)")

    def _read(self, layer: int, which: int, end: int) -> Tensor:
        b, kv, d = self.shape[1], self.shape[2], self.shape[4]
        stores = self.stores[layer]
        if len(stores) == 1:
            return stores[0].read(which, end, self.dtype)
        out = torch.empty(b, kv, end, d, dtype=self.dtype, device=stores[0].index.device)
        for s in stores:
            out[:, s.index] = s.read(which, end, self.dtype)
        return out

    def append(self, layer: int, k: Tensor, v: Tensor, q: Tensor | None = None) -> tuple[Tensor, Tensor]:
        start, end = self.length, self.length + k.shape[2]
        for s in self.stores[layer]:
            s.write(0, k, start)
            s.write(1, v, start)
        if self.queries is not None and q is not None:
            self.queries[layer, :, :, start:end] = q
        return self._read(layer, 0, end), self._read(layer, 1, end)

    def k(self, layer: int) -> Tensor:
        return self._read(layer, 0, self.length)

    def v(self, layer: int) -> Tensor:
        return self._read(layer, 1, self.length)
