"""Positional schemes: learned and sinusoidal embeddings, rotary (with scaling), ALiBi.

Rotary comes in two layouts of the first `rotary_dim` dimensions of each head (the rest pass through:
partial rotary, as in Pythia and GPT-J), chosen once from `cfg.rotary_adjacent_pairs`:

    rotate half (GPT-NeoX, Llama)   dimension i turns with i + rotary_dim / 2: the two halves rotate as
                                    (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin)
    adjacent pairs (GPT-J, CodeGen) dimension 2i turns with 2i + 1 ("rotate every two"), at frequency i

Both use the same frequencies; only which dimension holds which frequency differs.
"""

from __future__ import annotations

import contextlib
import math

import torch
from torch import Tensor, nn

from .config import ModelConfig, RopeScaling


def sinusoidal_table(n_ctx: int, d_model: int) -> Tensor:
    """Vaswani et al. (2017): PE[p, 2i] = sin(p / 10000^(2i/d)), PE[p, 2i+1] = cos(...). [n_ctx, d_model]"""
    pos = torch.arange(n_ctx, dtype=torch.float64)[:, None]
    div = torch.exp(torch.arange(0, d_model, 2, dtype=torch.float64) * (-math.log(10000.0) / d_model))
    table = torch.zeros(n_ctx, d_model, dtype=torch.float64)
    table[:, 0::2] = torch.sin(pos * div)
    table[:, 1::2] = torch.cos(pos * div)[:, : d_model // 2]
    return table.float()


def alibi_slopes(n_heads: int) -> Tensor:
    """Press et al. (2022): geometric slopes 2^(-8 i / n) for i = 1..n, with the interleaving rule
    for head counts that are not powers of two. [n_heads]"""

    def powers(n: int) -> list[float]:
        start = 2 ** (-(2 ** -(math.log2(n) - 3)))
        return [start ** (i + 1) for i in range(n)]

    if math.log2(n_heads).is_integer():
        return torch.tensor(powers(n_heads))
    closest = 2 ** math.floor(math.log2(n_heads))
    extra = powers(2 * closest)[0::2][: n_heads - closest]
    return torch.tensor(powers(closest) + extra)


def _inv_freq(base: float, dim: int) -> Tensor:
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def rope_frequencies(cfg: ModelConfig, seq_len: int | None = None) -> tuple[Tensor, float]:
    """Inverse frequencies [rotary_dim / 2] and the cos/sin scale (YaRN's attention factor), as
    Hugging Face computes them for each `rope_type`. `seq_len` matters only for "dynamic" and
    "longrope" (its long factors once seq_len > original_max_position; short ones for None)."""
    dim, base, s = cfg.rot_dim, cfg.rotary_base, cfg.rope_scaling
    if s is None:
        return _inv_freq(base, dim), 1.0
    if s.kind == "linear":
        return _inv_freq(base, dim) / s.factor, 1.0
    if s.kind == "ntk":
        return _inv_freq(base * s.factor ** (dim / (dim - 2)), dim), 1.0
    if s.kind == "dynamic":
        orig = s.original_max_position or cfg.n_ctx
        n = max(seq_len or orig, orig)
        return _inv_freq(base * ((s.factor * n / orig) - (s.factor - 1)) ** (dim / (dim - 2)), dim), 1.0
    if s.kind == "yarn":
        return _yarn(base, dim, s, s.original_max_position or cfg.n_ctx)
    if s.kind == "llama3":
        return _llama3(base, dim, s), 1.0
    if s.kind == "longrope":
        return _longrope(base, dim, s, long=seq_len is not None and seq_len > s.original_max_position)
    raise ValueError(f"unknown rope scaling {s.kind!r}")


def _yarn(base: float, dim: int, s: RopeScaling, orig: int) -> tuple[Tensor, float]:
    """YaRN (Peng et al. 2023): interpolate low frequencies, keep high ones, ramp in between."""
    factor = s.factor
    attn = s.attention_factor if s.attention_factor is not None else (0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0)

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(orig / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(s.beta_fast), correction_dim(s.beta_slow)
    if s.truncate:  # rounded out to whole dimensions (gpt-oss keeps them unrounded)
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp  # 1: keep the original frequency
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    inv = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv, attn


def _longrope(base: float, dim: int, s: RopeScaling, long: bool) -> tuple[Tensor, float]:
    """LongRoPE (Ding et al. 2024): each frequency divided by its own rescale factor, the short set
    within the original context and the long set beyond it; cos/sin scaled by the attention factor."""
    orig, factor = s.original_max_position, s.factor
    attn = s.attention_factor
    if attn is None:
        attn = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(orig))
    rescale = torch.tensor(s.long_factor if long else s.short_factor, dtype=torch.float32)
    return 1.0 / (rescale * base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)), attn


def _llama3(base: float, dim: int, s: RopeScaling) -> Tensor:
    inv = _inv_freq(base, dim)
    old = s.original_max_position
    low_wavelen, high_wavelen = old / s.low_freq_factor, old / s.high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / s.factor, inv)
    smooth = (old / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def llama3_divisors(base: float, dim: int, s: RopeScaling) -> Tensor:
    """Each frequency's divisor under Llama 3's scaling `s` (plain over scaled): what llama.cpp's converter
    stores as a GGUF file's `rope_freqs.weight`."""
    return _inv_freq(base, dim) / _llama3(base, dim, s)


class Rotary(nn.Module):
    """Computes cos/sin once per forward for each RoPE table the model uses and rotates q and k.

    One table (`rotary_base`, with `rope_scaling`), or two when sliding-window layers rotate with their
    own base (`rotary_base_local`, unscaled: Gemma 3's 1e4 local against 1e6 global layers). Row t of
    the buffer `inv_freq` [table, rotary_dim / 2] is table t; `table_of_layer[l]` names layer l's."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        # On the meta device (a model built to receive a checkpoint's weights) the frequencies are computed
        # on the CPU and only their shape kept: torch's meta kernels for arange and pow import torch._dynamo
        # (1.5 s, a third of loading a 1B checkpoint), and the loader rebuilds this buffer anyway.
        meta = torch.get_default_device().type == "meta"
        with torch.device("cpu") if meta else contextlib.nullcontext():
            inv, factor = rope_frequencies(cfg)
            rows, self.attention_factors = [inv], [factor]
            if cfg.rotary_base_local is not None:
                rows.append(_inv_freq(cfg.rotary_base_local, cfg.rot_dim))
                self.attention_factors.append(1.0)
            # longrope: the long factors' frequencies, a last row, taken instead of table 0's (the short
            # ones) by calls whose longest position passes original_max_position (`long_after`).
            self.long_row, self.long_after = None, None
            if cfg.rope_scaling is not None and cfg.rope_scaling.kind == "longrope":
                self.long_row, self.long_after = len(rows), cfg.rope_scaling.original_max_position
                rows.append(rope_frequencies(cfg, self.long_after + 1)[0])
            # One buffer for every table, so a loader that rebuilds `inv_freq` from a fresh `Rotary(cfg)`
            # (a model built on the meta device) rebuilds them all.
        inv_freq = torch.stack(rows)
        self.register_buffer("inv_freq", inv_freq.to("meta") if meta else inv_freq, persistent=False)
        self.table_of_layer = tuple(int(cfg.local_rope(l)) for l in range(cfg.n_layers))
        self.dynamic = cfg.rope_scaling is not None and cfg.rope_scaling.kind == "dynamic"
        # Where each frequency sits in cos / sin: twice in a row (adjacent pairs) or in both halves.
        self.spread = _in_pairs if cfg.rotary_adjacent_pairs else _in_halves

    def cos_sin(self, positions: Tensor, dtype: torch.dtype, layer: int | None = None) -> tuple[Tensor, Tensor]:
        """positions: [batch, pos] -> cos, sin: [batch, pos, 1, rotary_dim] in `dtype`, for `layer`'s
        table (None: the full layers' table, the only one of most models).

        For "dynamic" scaling the frequencies follow the longest position in the call (stateless;
        Hugging Face keeps the largest length seen so far instead). For "longrope" the long factors'
        frequencies replace the short ones when the longest position in the call passes
        original_max_position, as Hugging Face chooses them (chosen on the device: no host sync)."""
        table = 0 if layer is None else self.table_of_layer[layer]
        inv = self.inv_freq[table]
        if self.dynamic and table == 0:
            inv = rope_frequencies(self.cfg, int(positions.max()) + 1)[0].to(inv.device)
        if self.long_row is not None and table == 0:
            inv = torch.where(positions.max() + 1 > self.long_after, self.inv_freq[self.long_row], inv)
        freqs = positions[..., None].float() * inv.float()
        emb = self.spread(freqs)[:, :, None, :]
        factor = self.attention_factors[table]
        return (emb.cos() * factor).to(dtype), (emb.sin() * factor).to(dtype)

    def per_layer(self, positions: Tensor, dtype: torch.dtype) -> list[tuple[Tensor, Tensor]]:
        """cos, sin of every layer (see `cos_sin`), each table computed once and shared by its layers."""
        first = {t: self.table_of_layer.index(t) for t in set(self.table_of_layer)}  # a layer of each table
        tables = {t: self.cos_sin(positions, dtype, layer=l) for t, l in first.items()}
        return [tables[t] for t in self.table_of_layer]

    @staticmethod
    def rotate_adjacent(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """x: [batch, pos, head, d_head]; rotates the first rotary_dim dims in adjacent pairs (2i, 2i + 1):
        (a, b) -> (a cos - b sin, b cos + a sin), with cos / sin from a model with `rotary_adjacent_pairs`."""
        rot = cos.shape[-1]
        x_rot = x[..., :rot]
        turned = torch.stack((-x_rot[..., 1::2], x_rot[..., 0::2]), dim=-1).flatten(-2)
        out = x_rot * cos + turned * sin
        return out if rot == x.shape[-1] else torch.cat((out, x[..., rot:]), dim=-1)

    @staticmethod
    def rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """x: [batch, pos, head, d_head]; rotates the first rotary_dim dims (rotate half)."""
        rot = cos.shape[-1]
        if rot == x.shape[-1]:
            x1, x2 = x.chunk(2, dim=-1)
            return x * cos + torch.cat((-x2, x1), dim=-1) * sin
        x_rot, x_pass = x[..., :rot], x[..., rot:]
        x1, x2 = x_rot.chunk(2, dim=-1)
        return torch.cat((x_rot * cos + torch.cat((-x2, x1), dim=-1) * sin, x_pass), dim=-1)


def _in_halves(freqs: Tensor) -> Tensor:
    return torch.cat((freqs, freqs), dim=-1)


def _in_pairs(freqs: Tensor) -> Tensor:
    return freqs.repeat_interleave(2, dim=-1)


def rotation(cfg: ModelConfig):
    """The rotation of `cfg`'s layout: `Rotary.rotate` (rotate half) or `Rotary.rotate_adjacent`, for the
    cos / sin its `Rotary` makes."""
    return Rotary.rotate_adjacent if cfg.rotary_adjacent_pairs else Rotary.rotate
