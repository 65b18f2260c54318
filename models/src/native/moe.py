"""Mixture-of-experts MLPs (Shazeer et al. 2017; Mixtral, Jiang et al. 2024), and the choice of a
block's MLP (`make_mlp`): a mixture when `cfg.num_experts` is set, else the dense MLP of
`components.make_mlp`.

A mixture holds `num_experts` experts, each an MLP of width d_mlp (`components.GatedMLP` or `MLP`;
gpt-oss's clamped SwiGLU: `ClampedGatedMLP`), and a linear router. For each token:

    weights = softmax(x W_gate + b_gate)                 [batch, pos, experts]  hook_expert_weights
    indices = the experts_per_token largest weights      [batch, pos, k]        hook_expert_indices
    chosen  = weights at indices (/ their sum when norm_topk_prob)
    out     = sum_i chosen_i * expert_{indices_i}(x)   (+ sigmoid(x W_shared_gate) * shared_expert(x))

The names are TransformerLens's HookedTransformer MoE's: the router is `mlp.W_gate` [d_model, experts]
(each expert's own gate is `mlp.experts.E.W_gate`), `hook_expert_weights` fires on the softmax over
every expert before the choice (so a hook that raises an expert's weight re-routes the token), and
each expert's `hook_pre` / `hook_pre_linear` / `hook_post` fire on the tokens routed to it,
[tokens routed, d_mlp] (a hooked expert fires even when no token chose it, on an empty tensor, so every
hook point fires once per forward).
Hugging Face's gpt-oss computes its weights as a softmax over the chosen logits only: the same
numbers (up to float round-off) as the renormalised softmax here. TransformerLens 4's bridge fires its
routing hooks on the router submodule instead (`mlp.gate.hook_out`: the logits; its `hook_expert_weights`:
the chosen weights scattered over [tokens, experts]), so they are not aliases of these.

The experts run one at a time over the tokens each was chosen by (one sort of the choices, then a
gather per expert), as Hugging Face's eager experts do; no Python loop over tokens.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from .components import MLP, GatedMLP, _affine
from .components import make_mlp as dense_mlp
from ..config import ModelConfig
from ..hooks import HookPoint
from ..readouts.weights import OptionalBias, stored


class ClampedGatedMLP(GatedMLP):
    """gpt-oss's expert: the gate clamped to <= limit and the linear branch to [-limit, limit], then
    gate * sigmoid(alpha * gate) * (linear + 1). hook_pre / hook_pre_linear fire before the clamps."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg)
        self.limit, self.alpha = cfg.swiglu_limit, cfg.swiglu_alpha

    def forward(self, x: Tensor) -> Tensor:
        gate = self.hook_pre(_affine(x, self.W_gate, stored(self, "b_gate"))).clamp(max=self.limit)
        lin = self.hook_pre_linear(_affine(x, self.W_in, stored(self, "b_in"))).clamp(-self.limit, self.limit)
        post = self.hook_post(gate * torch.sigmoid(gate * self.alpha) * (lin + 1))
        return _affine(post, self.W_out, stored(self, "b_out"))


def _expert_class(cfg: ModelConfig) -> type[nn.Module]:
    if cfg.swiglu_limit is not None:
        return ClampedGatedMLP
    return GatedMLP if cfg.gated_mlp else MLP


class MoE(nn.Module):
    """A router and `num_experts` experts (and Qwen2-MoE's gated shared expert); see the module docstring."""

    b_gate = OptionalBias("W_gate")  # the router's bias (gpt-oss); zeros without one

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.num_experts, self.experts_per_token = cfg.num_experts, cfg.experts_per_token
        self.norm_topk_prob = cfg.norm_topk_prob
        self.W_gate = nn.Parameter(torch.empty(cfg.d_model, cfg.num_experts))
        self.b_gate = nn.Parameter(torch.zeros(cfg.num_experts)) if cfg.router_bias else None
        # Hook points in the order they fire (hook_dict and caches follow it).
        self.hook_expert_weights = HookPoint()  # [batch, pos, experts]: the softmax over every expert
        self.hook_expert_indices = HookPoint()  # [batch, pos, experts_per_token]: the chosen experts
        expert = _expert_class(cfg)
        self.experts = nn.ModuleList(expert(cfg) for _ in range(cfg.num_experts))
        if cfg.d_mlp_shared is not None:
            self.W_shared_gate = nn.Parameter(torch.empty(cfg.d_model, 1))
            self.hook_shared_gate = HookPoint()  # [batch, pos, 1]: sigmoid(x W_shared_gate)
            self.shared_expert = (GatedMLP if cfg.gated_mlp else MLP)(cfg.replace(d_mlp=cfg.d_mlp_shared))
        else:
            self.shared_expert = None

    def __getattr__(self, name: str):
        # A dense MLP's TransformerLens names have no single meaning here: say where each expert's are.
        if name in ("W_in", "W_out", "b_in", "b_out"):
            raise AttributeError(f"{name}: this MLP is a mixture of {self.num_experts} experts, each with its own "
                                 f"{name} (mlp.experts[e].{name}); mlp.W_gate is the router")
        return super().__getattr__(name)

    def input_weights(self) -> list[tuple[str, str | None]]:
        """(weight, bias) names, relative to this module, of every matrix that reads its input (the router,
        each expert's W_in / W_gate, the shared expert and its gate): what folding ln2 scales."""
        out = [("W_gate", "b_gate")]
        for e, expert in enumerate(self.experts):
            out += [(f"experts.{e}.W_in", f"experts.{e}.b_in")]
            out += [(f"experts.{e}.W_gate", f"experts.{e}.b_gate")] if hasattr(expert, "W_gate") else []
        if self.shared_expert is not None:
            out += [("shared_expert.W_in", "shared_expert.b_in"), ("W_shared_gate", None)]
            out += [("shared_expert.W_gate", "shared_expert.b_gate")] if hasattr(self.shared_expert, "W_gate") else []
        return out

    def forward(self, x: Tensor) -> Tensor:
        """x: [batch, pos, d_model] -> [batch, pos, d_model]."""
        k = self.experts_per_token
        weights = self.hook_expert_weights(torch.softmax(_affine(x, self.W_gate, stored(self, "b_gate")).float(), dim=-1))
        indices = self.hook_expert_indices(torch.topk(weights, k, dim=-1).indices)
        chosen = weights.gather(-1, indices)  # after the indices hook: a re-routed token gets its new expert's weight
        if self.norm_topk_prob:
            chosen = chosen / chosen.sum(-1, keepdim=True)
        flat_x = x.reshape(-1, x.shape[-1])
        out = torch.zeros_like(flat_x)
        # Every (token, slot) choice sorted by expert: expert e takes the slice of `order` its count says,
        # its tokens in order (a stable sort), so each expert's rows are added as Hugging Face adds them.
        flat = indices.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        token_of, weight_of = order // k, chosen.reshape(-1)[order].to(x.dtype)
        # An expert no token chose still runs (on no rows) while its hooks are on, or under autograd (its
        # gradients are then zeros, not missing); otherwise it is skipped.
        idle_runs = torch.is_grad_enabled()
        start = 0
        for expert, n in zip(self.experts, counts):
            rows = slice(start, start + n)
            start += n
            if n == 0 and not idle_runs and not _hooked(expert):
                continue
            tokens = token_of[rows]
            out.index_add_(0, tokens, expert(flat_x[tokens]) * weight_of[rows, None])
        out = out.view(x.shape)
        if self.shared_expert is None:
            return out
        gate = self.hook_shared_gate(torch.sigmoid(torch.matmul(x, self.W_shared_gate)))
        return out + gate * self.shared_expert(x)


def _hooked(module: nn.Module) -> bool:
    return any(h.active for h in module.modules() if isinstance(h, HookPoint))


def make_mlp(cfg: ModelConfig) -> nn.Module | None:
    """A block's MLP, chosen once when the model is built: None (attention-only), a mixture of experts
    (`cfg.num_experts`), or the dense MLP (`components.make_mlp`)."""
    if cfg.attn_only or cfg.num_experts is None:
        return dense_mlp(cfg)
    return MoE(cfg)
