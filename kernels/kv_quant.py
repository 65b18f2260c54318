"""Quantized KV-cache storage: one scale per (batch, KV head, position) vector over d_head, symmetric.

    int8   s = max|x| / 127, codes = clamp(round(x / s), -127, 127) as int8
    int4   s = max|x| / 7,   codes = clamp(round(x / s), -7, 7), two per byte (low nibble first, + 8)
    fp8    s = max|x| / 448, codes = (x / s) cast to float8_e4m3fn
    fp32, fp16, bf16   stored as that dtype, no scale

Scales are float32. A vector of zeros gets scale 1 (codes 0). Dequantized: codes * s. This is the
scheme serving stacks use for per-token KV quantization, chosen so results can be recomputed by hand.
"""

from __future__ import annotations

import torch
from torch import Tensor

QMAX = {"int8": 127, "int4": 7, "fp8": 448.0}
FULL = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
PRECISIONS = ("fp32", "fp16", "bf16", "int8", "fp8", "int4")


def check_precision(name: str) -> str:
    if name not in PRECISIONS:
        raise ValueError(f"unknown KV precision {name!r}; choose from {', '.join(PRECISIONS)}")
    return name


def code_shape(precision: str, d_head: int) -> int:
    """Stored elements per vector of d_head values."""
    if precision == "int4":
        if d_head % 2:
            raise ValueError(f"int4 packs two codes per byte and needs an even d_head; this model's is {d_head}")
        return d_head // 2
    return d_head


def code_dtype(precision: str) -> torch.dtype:
    return FULL.get(precision) or {"int8": torch.int8, "int4": torch.uint8, "fp8": torch.float8_e4m3fn}[precision]


def quantize(x: Tensor, precision: str) -> tuple[Tensor, Tensor | None]:
    """x [..., d_head] -> (codes [..., code_shape], float32 scales [...] or None for full precisions)."""
    if precision in FULL:
        return x.to(FULL[precision]), None
    xf = x.float()
    scale = xf.abs().amax(-1) / QMAX[precision]
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    y = xf / scale[..., None]
    if precision == "fp8":
        return y.to(torch.float8_e4m3fn), scale
    q = y.round().clamp(-QMAX[precision], QMAX[precision])
    if precision == "int8":
        return q.to(torch.int8), scale
    u = (q + 8).to(torch.uint8)  # int4: 1..15, packed two per byte
    return u[..., 0::2] | (u[..., 1::2] << 4), scale


def dequantize(codes: Tensor, scale: Tensor | None, precision: str, dtype: torch.dtype) -> Tensor:
    """The inverse of `quantize`, in `dtype`."""
    if precision in FULL:
        return codes.to(dtype)
    if precision == "int4":
        lo, hi = (codes & 0xF).to(torch.int16) - 8, (codes >> 4).to(torch.int16) - 8
        values = torch.stack((lo, hi), dim=-1).flatten(-2).float()
    else:
        values = codes.float()
    return (values * scale[..., None]).to(dtype)


def fake_quantize(x: Tensor, precision: str) -> Tensor:
    """x quantized and dequantized (same dtype): what attention reads from a cache of `precision`."""
    codes, scale = quantize(x, precision)
    return dequantize(codes, scale, precision, x.dtype)


def bytes_per_vector(precision: str, d_head: int) -> int:
    """Bytes one stored vector takes: codes plus its float32 scale."""
    return code_shape(precision, d_head) * torch.tensor([], dtype=code_dtype(precision)).element_size() + (
        0 if precision in FULL else 4)
