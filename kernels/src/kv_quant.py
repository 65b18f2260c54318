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


# ---- KIVI (Liu et al. 2024): asymmetric low-bit codes, keys per channel, values per token ---------
#
#   keys    groups of G tokens: for each group and channel, zero = min, scale = (max - min) / (2^bits - 1)
#   values  each token alone, in groups of G channels: the same min / max rule over the group
#   codes   round((x - zero) / scale) clamped to [0, 2^bits - 1], packed 8 / bits per byte (low bits
#           first); scale and zero stored as float16 (what KIVI stores), and the codes computed from
#           the float16 values, so dequantized = codes * scale + zero exactly as stored.
#
# A group of equal values gets scale 1 (codes 0, dequantized exactly). Keys vary per channel (outlier
# channels), values per token: the axes KIVI found to quantize each along.

KIVI_BITS = (2, 4)


def check_kivi(bits: int, group: int, d_head: int) -> None:
    """KIVI's packing and grouping must fit d_head (values are grouped over channels)."""
    if bits not in KIVI_BITS:
        raise ValueError(f"KIVI quantizes to {' or '.join(map(str, KIVI_BITS))} bits, got {bits}")
    if group < 1 or d_head % group:
        raise ValueError(f"KIVI groups values over channels: the group size ({group}) must divide d_head ({d_head})")


def pack_bits(codes: Tensor, bits: int) -> Tensor:
    """uint8 codes [..., d] with values < 2^bits -> [..., d * bits / 8] bytes, low bits first."""
    per = 8 // bits
    c = codes.view(*codes.shape[:-1], codes.shape[-1] // per, per)
    out = c[..., 0].clone()
    for i in range(1, per):
        out |= c[..., i] << (bits * i)
    return out


def unpack_bits(packed: Tensor, bits: int) -> Tensor:
    """The inverse of `pack_bits`: [..., n] bytes -> uint8 codes [..., n * 8 / bits]."""
    per, mask = 8 // bits, (1 << bits) - 1
    parts = [(packed >> (bits * i)) & mask for i in range(per)]
    return torch.stack(parts, dim=-1).flatten(-2)


def _asym(x: Tensor, bits: int, dim: int) -> tuple[Tensor, Tensor, Tensor]:
    """Asymmetric codes of x along `dim` (the group axis): (uint8 codes like x, scale, zero as float16
    with `dim` kept at size 1)."""
    qmax = (1 << bits) - 1
    xf = x.float()
    lo, hi = xf.amin(dim, keepdim=True), xf.amax(dim, keepdim=True)
    zero = lo.half()
    scale = ((hi - lo) / qmax).half()
    if not (torch.isfinite(zero).all() and torch.isfinite(scale).all()):
        raise ValueError("KIVI stores scales in float16 and these keys or values exceed its range (|x| > 65504)")
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = ((xf - zero.float()) / scale.float()).round().clamp(0, qmax).to(torch.uint8)
    return codes, scale, zero


def kivi_quantize_keys(k: Tensor, bits: int, group: int) -> tuple[Tensor, Tensor, Tensor]:
    """k [..., T, d] with T a multiple of `group` -> (packed codes [..., T, d * bits / 8],
    scale and zero [..., T / group, d] float16): one (scale, zero) per channel per group of tokens."""
    *lead, t, d = k.shape
    codes, scale, zero = _asym(k.reshape(*lead, t // group, group, d), bits, dim=-2)
    return pack_bits(codes.reshape(*lead, t, d), bits), scale.squeeze(-2), zero.squeeze(-2)


def kivi_dequantize_keys(packed: Tensor, scale: Tensor, zero: Tensor, bits: int, group: int,
                         dtype: torch.dtype) -> Tensor:
    codes = unpack_bits(packed, bits).float()
    *lead, t, d = codes.shape
    out = codes.view(*lead, t // group, group, d) * scale.float()[..., None, :] + zero.float()[..., None, :]
    return out.view(*lead, t, d).to(dtype)


def kivi_quantize_values(v: Tensor, bits: int, group: int) -> tuple[Tensor, Tensor, Tensor]:
    """v [..., T, d] -> (packed codes [..., T, d * bits / 8], scale and zero [..., T, d / group]
    float16): one (scale, zero) per token per group of channels."""
    *lead, d = v.shape
    codes, scale, zero = _asym(v.reshape(*lead, d // group, group), bits, dim=-1)
    return pack_bits(codes.reshape(*lead, d), bits), scale.squeeze(-1), zero.squeeze(-1)


def kivi_dequantize_values(packed: Tensor, scale: Tensor, zero: Tensor, bits: int, group: int,
                           dtype: torch.dtype) -> Tensor:
    codes = unpack_bits(packed, bits).float()
    *lead, d = codes.shape
    out = codes.view(*lead, d // group, group) * scale.float()[..., None] + zero.float()[..., None]
    return out.view(*lead, d).to(dtype)
