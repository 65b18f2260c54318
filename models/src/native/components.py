"""Building blocks of the transformer, in dependency order: embeddings, norms, MLPs, unembedding.

Weights use TransformerLens's per-head / input-major layout (W_in: [d_model, d_mlp], W_U:
[d_model, vocab]) so analyses index instead of reshape. Each component is chosen once, when the
model is built (`make_norm`, `make_mlp`); no forward pass branches on a config string.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..hooks import HookPoint

from ..config import ModelConfig
from ..positions import sinusoidal_table
from ..readouts.weights import OptionalBias, stored


class Embed(nn.Module):
    """Token embeddings, times `cfg.embed_scale` when set (Gemma's sqrt(d_model)): the scale is rounded
    to the embedding's dtype first and multiplies in it, as Hugging Face's Gemma does."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.W_E = nn.Parameter(torch.empty(cfg.d_vocab, cfg.d_model))
        self.scale = cfg.embed_scale

    def forward(self, tokens: Tensor) -> Tensor:
        x = F.embedding(tokens, self.W_E)
        if self.scale is None:
            return x
        return x * torch.tensor(self.scale, dtype=torch.float32, device=x.device).to(x.dtype)


class PosEmbed(nn.Module):
    """Learned absolute positions (GPT-2)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.W_pos = nn.Parameter(torch.empty(cfg.n_ctx, cfg.d_model))

    def forward(self, positions: Tensor) -> Tensor:
        return F.embedding(positions, self.W_pos)


class SinusoidalPosEmbed(nn.Module):
    """Fixed sinusoidal positions (Vaswani et al. 2017); a buffer, not a parameter."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.register_buffer("W_pos", sinusoidal_table(cfg.n_ctx, cfg.d_model), persistent=False)

    def forward(self, positions: Tensor) -> Tensor:
        return F.embedding(positions, self.W_pos)


class LayerNorm(nn.Module):
    """LayerNorm with TransformerLens's hooks: hook_scale = sqrt(var + eps), hook_normalized = output."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.eps = cfg.norm_eps
        self.w = nn.Parameter(torch.ones(cfg.d_model))
        self.b = nn.Parameter(torch.zeros(cfg.d_model))
        self.hook_scale = HookPoint()
        self.hook_normalized = HookPoint()

    def forward(self, x: Tensor) -> Tensor:
        if self.hook_scale.active:  # the explicit form, only when someone looks at the scale
            x = x - x.mean(-1, keepdim=True)
            scale = self.hook_scale((x.pow(2).mean(-1, keepdim=True) + self.eps).sqrt())
            return self.hook_normalized(x / scale * self.w + self.b)
        return self.hook_normalized(F.layer_norm(x, x.shape[-1:], self.w, self.b, self.eps))


class RMSNorm(nn.Module):
    """RMSNorm (Zhang & Sennrich 2019) computed in float32 and cast back, as Llama does. Over d_model,
    or over `length` (QK-norm: d_head). Gemma's (1 + weight) convention is converted on load: `w` holds
    the whole multiplier, as TransformerLens stores it."""

    def __init__(self, cfg: ModelConfig, length: int | None = None) -> None:
        super().__init__()
        self.eps = cfg.norm_eps
        self.w = nn.Parameter(torch.ones(length or cfg.d_model))
        self.hook_scale = HookPoint()
        self.hook_normalized = HookPoint()

    def forward(self, x: Tensor) -> Tensor:
        dtype = x.dtype
        h = x.float()
        scale = self.hook_scale((h.pow(2).mean(-1, keepdim=True) + self.eps).sqrt())
        return self.hook_normalized(self.w * (h / scale).to(dtype))


class ProjectionRMSNorm(RMSNorm):
    """RMSNorm over a whole projection [..., head, d_head] at once, the heads flattened (OLMo 2's QK-norm:
    over n_heads * d_head of the queries, kv_heads * d_head of the keys); hook_scale and hook_normalized
    see the flat [..., head * d_head], as Hugging Face's norm does."""

    def __init__(self, cfg: ModelConfig, length: int) -> None:
        super().__init__(cfg, length=length)

    def forward(self, x: Tensor) -> Tensor:
        return super().forward(x.flatten(-2)).view_as(x)


def make_norm(cfg: ModelConfig) -> nn.Module:
    return {"layernorm": LayerNorm, "rmsnorm": RMSNorm, None: lambda cfg: nn.Identity()}[cfg.normalization](cfg)


def _gelu_new(x: Tensor) -> Tensor:
    return F.gelu(x, approximate="tanh")


def _gelu_fast(x: Tensor) -> Tensor:
    return 0.5 * x * (1.0 + torch.tanh(x * 0.7978845608 * (1.0 + 0.044715 * x * x)))


ACTIVATIONS = {
    "gelu": F.gelu,  # exact erf GELU (GPT-NeoX, BERT)
    "gelu_new": _gelu_new,  # tanh approximation (GPT-2)
    "gelu_fast": _gelu_fast,
    "relu": F.relu,
    "silu": F.silu,  # with gated_mlp: SwiGLU (Llama, Mistral, Qwen2)
}


def _out_major(d_in: int, d_out: int) -> nn.Parameter:
    """An input-major [d_in, d_out] weight (TransformerLens's layout, `x @ W`) stored out-major, as
    nn.Linear stores it: a transposed view of a contiguous [d_out, d_in] tensor. Same values and API;
    on CPU BLAS the up-projections run faster this way (768 -> 2048: 2.7 ms vs 3.8 ms, one thread; see
    `relayout_mlp_`)."""
    return nn.Parameter(torch.empty(d_out, d_in).t())


def relayout_mlp_(mlp: nn.Module | None) -> None:
    """Store an MLP's up-projections (W_in, W_gate) out-major again, after something replaced them with
    contiguous tensors (a checkpoint adopted with `load_state_dict(assign=True)`). Values unchanged."""
    for name in ("W_in", "W_gate"):
        p = getattr(mlp, name, None) if mlp is not None else None
        if p is not None and p.dim() == 2 and p.stride(0) != 1 and p.device.type != "meta":
            p.data = p.data.t().contiguous().t()


class MLP(nn.Module):
    """x -> act(x W_in + b_in) W_out + b_out. hook_pre: pre-activation, hook_post: post-activation."""

    b_in, b_out = OptionalBias("W_in"), OptionalBias("W_out")  # zeros when the architecture has none

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.act = ACTIVATIONS[cfg.act_fn]
        self.W_in = _out_major(cfg.d_model, cfg.d_mlp)
        self.W_out = nn.Parameter(torch.empty(cfg.d_mlp, cfg.d_model))
        self.b_in = nn.Parameter(torch.zeros(cfg.d_mlp)) if cfg.mlp_bias else None
        self.b_out = nn.Parameter(torch.zeros(cfg.d_model)) if cfg.mlp_bias else None
        self.hook_pre = HookPoint()
        self.hook_post = HookPoint()

    def forward(self, x: Tensor) -> Tensor:
        pre = self.hook_pre(_affine(x, self.W_in, stored(self, "b_in")))
        return _affine(self.hook_post(self.act(pre)), self.W_out, stored(self, "b_out"))


class GatedMLP(nn.Module):
    """x -> (act(x W_gate) * (x W_in)) W_out (SwiGLU with silu; Shazeer 2020).

    hook_pre: gate pre-activation, hook_pre_linear: x W_in, hook_post: their product."""

    b_gate, b_in, b_out = OptionalBias("W_gate"), OptionalBias("W_in"), OptionalBias("W_out")

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.act = ACTIVATIONS[cfg.act_fn]
        self.W_gate = _out_major(cfg.d_model, cfg.d_mlp)
        self.W_in = _out_major(cfg.d_model, cfg.d_mlp)
        self.W_out = nn.Parameter(torch.empty(cfg.d_mlp, cfg.d_model))
        self.b_gate = nn.Parameter(torch.zeros(cfg.d_mlp)) if cfg.mlp_bias else None
        self.b_in = nn.Parameter(torch.zeros(cfg.d_mlp)) if cfg.mlp_bias else None
        self.b_out = nn.Parameter(torch.zeros(cfg.d_model)) if cfg.mlp_bias else None
        self.hook_pre = HookPoint()
        self.hook_pre_linear = HookPoint()
        self.hook_post = HookPoint()

    def forward(self, x: Tensor) -> Tensor:
        gate = self.hook_pre(_affine(x, self.W_gate, stored(self, "b_gate")))
        lin = self.hook_pre_linear(_affine(x, self.W_in, stored(self, "b_in")))
        return _affine(self.hook_post(self.act(gate) * lin), self.W_out, stored(self, "b_out"))


def make_mlp(cfg: ModelConfig) -> nn.Module | None:
    if cfg.attn_only:
        return None
    return GatedMLP(cfg) if cfg.gated_mlp else MLP(cfg)


def _capped(logits: Tensor, cap: float | None) -> Tensor:
    """Gemma 2's final soft-capping, cap * tanh(logits / cap) (divide, tanh, multiply, as Hugging Face's);
    the logits as they are without a cap."""
    return logits if cap is None else torch.tanh(logits / cap) * cap


class Unembed(nn.Module):
    """logits = x W_U (+ b_U), soft-capped when `cfg.output_logits_soft_cap` is set (Gemma 2): every path
    to the logits (forward, the loss in slabs, generation, an analysis calling `model.unembed`) caps
    them. W_U stays the linear map before the cap (direct logit attribution reads it)."""

    b_U = OptionalBias("W_U")  # zeros without an unembedding bias, as the bridge's

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.W_U = nn.Parameter(torch.empty(cfg.d_model, cfg.d_vocab))
        self.b_U = nn.Parameter(torch.zeros(cfg.d_vocab)) if cfg.unembed_bias else None
        self.soft_cap = cfg.output_logits_soft_cap

    def forward(self, x: Tensor) -> Tensor:
        return _capped(_affine(x, self.W_U, stored(self, "b_U")), self.soft_cap)


class TiedUnembed(nn.Module):
    """Unembedding that shares the embedding matrix: logits = x W_E^T (+ b_U), soft-capped as `Unembed`'s."""

    b_U = OptionalBias("W_U")

    def __init__(self, cfg: ModelConfig, embed: Embed) -> None:
        super().__init__()
        self._embed = [embed]  # a list, so the shared parameter is registered once (under embed)
        self.b_U = nn.Parameter(torch.zeros(cfg.d_vocab)) if cfg.unembed_bias else None
        self.soft_cap = cfg.output_logits_soft_cap

    @property
    def W_U(self) -> Tensor:
        return self._embed[0].W_E.T

    def forward(self, x: Tensor) -> Tensor:
        return _capped(F.linear(x, self._embed[0].W_E, stored(self, "b_U")), self.soft_cap)


def _affine(x: Tensor, w: Tensor, b: Tensor | None) -> Tensor:
    """x @ w + b with w stored input-major ([in, out]); one BLAS call."""
    if b is None:
        return torch.matmul(x, w)
    if x.dim() == 2:
        return torch.addmm(b, x, w)
    return torch.addmm(b, x.reshape(-1, x.shape[-1]), w).view(*x.shape[:-1], w.shape[-1])


def init_weights(module: nn.Module, cfg: ModelConfig, generator: torch.Generator | None = None) -> None:
    """GPT-2-style initialisation: N(0, init_range) for matrices, with output projections scaled by
    1/sqrt(2 n_layers); zeros for biases; ones for norm weights."""
    out_std = cfg.init_range / math.sqrt(2 * cfg.n_layers)
    for name, p in module.named_parameters():
        leaf = name.rsplit(".", 1)[-1]
        if leaf.startswith("b") or leaf.startswith("b_"):
            nn.init.zeros_(p)
        elif leaf == "w":
            nn.init.ones_(p)
        else:
            std = out_std if leaf in ("W_O_flat", "W_out") else cfg.init_range
            with torch.no_grad():
                # Drawn in the logical (row-major) order whatever the storage layout (`_out_major`), so
                # a seed gives the same weights as it always has.
                draw = torch.empty(p.shape, dtype=p.dtype, device=p.device).normal_(0.0, std, generator=generator)
                p.copy_(draw)
