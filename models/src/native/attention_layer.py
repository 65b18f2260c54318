"""The attention layer: projections, rotary, the backend call (fused or instrumented), output.

Weights live in two matrices so the projections are one GEMM each (`W_qkv: [d_model, (head + 2
kv_head) * d_head]`, `W_O_flat: [head * d_head, d_model]`); the TransformerLens per-head views
`W_Q: [head, d_model, d_head]`, `W_K / W_V: [kv_head, d_model, d_head]`, `W_O: [head, d_head,
d_model]` are views of them (no copy; in-place edits through them change the model).
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Iterator

import torch
from torch import Tensor, nn

from ..hooks import HookPoint
from interp.kernels.attention import AttentionBackend, AttentionMask, BackendChoice, Needs, choose
from interp.kernels.stats import Scoring

from .components import ProjectionRMSNorm, RMSNorm
from ..config import ModelConfig
from ..positions import alibi_slopes, rotation
from ..readouts.weights import OptionalBias, stored

if TYPE_CHECKING:
    from ..kv.cache import KVCache



class Attention(nn.Module):
    b_O = OptionalBias("W_O_flat")  # zeros when the architecture has no output bias

    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.cfg, self.layer = cfg, layer
        h, kv, dh = cfg.n_heads, cfg.kv_heads, cfg.head_dim
        self.n_heads, self.n_kv_heads, self.d_head = h, kv, dh
        # The window this layer attends through: the model's own (`cfg.window(layer)`), or narrower
        # while an analysis narrows it (`narrow_windows`); never wider.
        self.window = cfg.window(layer)
        self.scale = cfg.scale
        self.W_qkv = nn.Parameter(torch.empty(cfg.d_model, (h + 2 * kv) * dh))
        self.b_qkv = nn.Parameter(torch.zeros((h + 2 * kv) * dh)) if cfg.qkv_bias else None
        self.W_O_flat = nn.Parameter(torch.empty(h * dh, cfg.d_model))
        self.b_O = nn.Parameter(torch.zeros(cfg.d_model)) if cfg.attn_out_bias else None
        # Learned sink logits (gpt-oss), one per head: each joins its head's softmax denominator and gives no
        # value (`cfg.learned_sinks`; `Scoring.sink_logits`). None: none.
        self.sinks = nn.Parameter(torch.zeros(h)) if cfg.learned_sinks else None
        # Gated attention (`cfg.attn_output_gate`, Qiu et al. 2025): z * sigmoid(x W_gate_attn) per head before W_O.
        if cfg.attn_output_gate:
            self.W_gate_attn = nn.Parameter(torch.empty(cfg.d_model, h * dh))
            self.hook_attn_gate = HookPoint()  # the gate sigmoid(x W_gate_attn) [batch, pos, head, d_head]
        else:
            self.W_gate_attn = None
        self.rotary = cfg.positional == "rotary"
        self.rotate = rotation(cfg)  # rotate half, or adjacent pairs (GPT-J)
        # Gemma 2's soft-capping of the scores (cap * tanh(scores / cap)); None: none.
        self.softcap = cfg.attn_scores_soft_cap
        if cfg.positional == "alibi":
            self.register_buffer("alibi_slopes", alibi_slopes(h), persistent=False)
        else:
            self.alibi_slopes = None
        self.backend: BackendChoice = "auto"

        self.hook_q, self.hook_k, self.hook_v = HookPoint(), HookPoint(), HookPoint()
        # QK-norm: RMSNorm over d_head of each query and key head (Gemma 3), or over the whole query and
        # key projections (OLMo 2, `qk_norm_over="projection"`), after hook_q / hook_k and before RoPE.
        # TransformerLens's names: the norms `q_norm` / `k_norm` (with their hook_scale and
        # hook_normalized, as its HookedTransformer) and their outputs `hook_q_normed` / `hook_k_normed`
        # (as its TransformerBridge).
        self.qk_norm = cfg.qk_norm
        if cfg.qk_norm and cfg.qk_norm_over == "head":
            self.q_norm, self.k_norm = RMSNorm(cfg, length=dh), RMSNorm(cfg, length=dh)
        elif cfg.qk_norm:
            self.q_norm, self.k_norm = ProjectionRMSNorm(cfg, h * dh), ProjectionRMSNorm(cfg, kv * dh)
        if cfg.qk_norm:
            self.hook_q_normed, self.hook_k_normed = HookPoint(), HookPoint()
        if self.rotary:
            self.hook_rot_q, self.hook_rot_k = HookPoint(), HookPoint()
        self.hook_attn_scores = HookPoint()
        self.hook_pattern = HookPoint()
        self.hook_z = HookPoint()
        self.hook_result = HookPoint()

    # TransformerLens 3's ungroup_grouped_query_attention (the model's `set_ungroup_grouped_query_attention`):
    # keys and values, and their split inputs, per query head instead of per KV head.
    ungroup: bool = False
    # Whether hook_result is computed (and called as a module) on every call, not only while an interp hook is
    # on it: TransformerLens's `use_attn_result`, for readers that do not add interp hooks (PyTorch module hooks,
    # nnsight). It costs [batch, pos, head, d_model] per call, so it is off by default.
    use_attn_result: bool = False

    @property
    def kv_inputs(self) -> int:
        """How many key (and value) heads the hooks see: `n_kv_heads`, or `n_heads` when ungrouped."""
        return self.n_heads if self.ungroup else self.n_kv_heads

    def _per_query_head(self, *kv: Tensor, dim: int = 2) -> list[Tensor]:
        """[batch, pos, kv_head, ...] -> [batch, pos, head, ...] (the KV head axis `dim`), each KV head copied
        for its group."""
        group = self.n_heads // self.n_kv_heads
        return [t.repeat_interleave(group, dim=dim) for t in kv]

    def _as_expanded(self, *kv: Tensor) -> list[Tensor]:
        """Per-query-head keys / values [batch, head, pos, d_head] for the backend: while each is its KV head's
        copies (no hook made them differ), as the backends expand KV heads themselves (`_AsExpanded`), so the
        outputs are the grouped ones bit for bit; else as they are."""
        group = self.n_heads // self.n_kv_heads
        if all(torch.equal(t, t[:, ::group].repeat_interleave(group, dim=1)) for t in kv):
            return [_AsExpanded.apply(t, group) for t in kv]
        return [t.contiguous() for t in kv]

    def _regrouped(self, *kv: Tensor) -> list[Tensor]:
        """The per-query-head keys / values back to one per KV head, for the KV cache that holds those."""
        group = self.n_heads // self.n_kv_heads
        out = [t[:, ::group] for t in kv]  # [batch, head, pos, d_head]
        if any(not torch.equal(t, o.repeat_interleave(group, dim=1)) for t, o in zip(kv, out)):
            raise ValueError(f"layer {self.layer}: a KV cache holds one key and value per KV head, but a hook made the "
                             "query heads' copies differ (ungroup_grouped_query_attention); run without the cache")
        return out

    @property
    def scoring(self) -> Scoring:
        """How this layer scores a (query, key) pair, for the statistics kernels (`interp.kernels.Scoring`):
        see `scoring_of`."""
        return scoring_of(self)

    # ---- TransformerLens weight views -------------------------------------------------------
    def _split(self, t: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        h, kv, dh = self.n_heads, self.n_kv_heads, self.d_head
        return t.split([h * dh, kv * dh, kv * dh], dim=-1)

    @property
    def W_Q(self) -> Tensor:
        return self._split(self.W_qkv)[0].unflatten(-1, (self.n_heads, self.d_head)).permute(1, 0, 2)

    @property
    def W_K(self) -> Tensor:
        return self._split(self.W_qkv)[1].unflatten(-1, (self.n_kv_heads, self.d_head)).permute(1, 0, 2)

    @property
    def W_V(self) -> Tensor:
        return self._split(self.W_qkv)[2].unflatten(-1, (self.n_kv_heads, self.d_head)).permute(1, 0, 2)

    @property
    def W_O(self) -> Tensor:
        return self.W_O_flat.view(self.n_heads, self.d_head, -1)

    def _bias(self, i: int, n: int) -> Tensor:
        if self.b_qkv is None:
            return self.W_qkv.new_zeros(n, self.d_head)
        return self._split(self.b_qkv)[i].view(n, self.d_head)

    @property
    def b_Q(self) -> Tensor:
        return self._bias(0, self.n_heads)

    @property
    def b_K(self) -> Tensor:
        return self._bias(1, self.n_kv_heads)

    @property
    def b_V(self) -> Tensor:
        return self._bias(2, self.n_kv_heads)

    # ---- forward ------------------------------------------------------------------------------
    def needs(self, device: torch.device | str, n_sink: int = 0) -> Needs:
        """What this layer's next call asks of a backend: its hooks, window, sinks, ALiBi, device."""
        return Needs(pattern=self.hook_attn_scores.active or self.hook_pattern.active, window=self.window is not None,
                     sinks=bool(n_sink) and self.window is not None, alibi=self.alibi_slopes is not None,
                     softcap=self.softcap is not None, sink_logits=self.sinks is not None,
                     device=torch.device(device).type)

    def backend_now(self, device: torch.device | str | None = None, n_sink: int = 0) -> AttentionBackend:
        """The backend this call runs, chosen by capability (see `kernels.attention.choose`)."""
        device = device if device is not None else self.W_qkv.device
        return choose(self.backend, self.needs(device, n_sink), where=f"layer {self.layer}")

    def instrumented_now(self) -> bool:
        """Whether this call will materialise its pattern (and can hand it to hooks)."""
        return self.backend_now().gives_pattern

    def forward(
        self,
        x: Tensor,
        mask: AttentionMask,
        rope: tuple[Tensor, Tensor] | None = None,
        kv_cache: "KVCache | None" = None,
        per_head: tuple[Tensor, Tensor, Tensor] | None = None,
    ) -> Tensor:
        """x: [batch, pos, d_model] -> [batch, pos, d_model].

        per_head: instead of x, the normalised inputs of each query head [batch, pos, head, d_model]
        and of each KV head (keys, values) [batch, pos, kv_head, d_model] (of each query head when
        ungrouped), for TransformerLens's split-input hooks (`set_use_split_qkv_input`,
        `set_use_attn_in`); x is then ignored."""
        h, kv, dh = self.n_heads, self.n_kv_heads, self.d_head
        if per_head is None:
            b, p, _ = x.shape
            qkv = torch.matmul(x, self.W_qkv) if self.b_qkv is None else torch.addmm(
                self.b_qkv, x.reshape(b * p, -1), self.W_qkv
            ).view(b, p, -1)
            q, k, v = self._split(qkv)
            q, k, v = q.view(b, p, h, dh), k.view(b, p, kv, dh), v.view(b, p, kv, dh)
            if self.ungroup and kv != h:
                k, v = self._per_query_head(k, v)
        else:
            xq, xk, xv = per_head
            b, p = xq.shape[:2]
            W_K, b_K, W_V, b_V = self.W_K, self.b_K, self.W_V, self.b_V
            if xk.shape[2] != kv:  # ungrouped: one key / value input per query head
                W_K, b_K, W_V, b_V = self._per_query_head(W_K, b_K, W_V, b_V, dim=0)
            q = torch.einsum("bphm,hmd->bphd", xq, self.W_Q) + self.b_Q
            k = torch.einsum("bphm,hmd->bphd", xk, W_K) + b_K
            v = torch.einsum("bphm,hmd->bphd", xv, W_V) + b_V
        q = self.hook_q(q)
        k = self.hook_k(k)
        v = self.hook_v(v)
        if self.qk_norm:
            q = self.hook_q_normed(self.q_norm(q))
            k = self.hook_k_normed(self.k_norm(k))
        if self.rotary:
            cos, sin = rope
            q = self.hook_rot_q(self.rotate(q, cos, sin))
            k = self.hook_rot_k(self.rotate(k, cos, sin))
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [batch, head, pos, d_head]
        if k.shape[1] != kv and kv_cache is None:
            k, v = self._as_expanded(k, v)
        backend = self.backend_now(q.device, mask.n_sink)  # asked once per call
        scoring, own = scoring_of(self, live=True), self.cfg.window(self.layer)  # live: its gradient reaches the sinks
        # The instrumented path calls its hook points as modules, hooked or not, so PyTorch module hooks and
        # nnsight (which wraps each module's forward) see scores and pattern whenever the path runs (forced, or
        # chosen because an interp hook is on them); the fused path builds neither and calls neither.
        hooks = dict(scores_hook=self.hook_attn_scores, pattern_hook=self.hook_pattern) if backend.gives_pattern else {}

        def run(q: Tensor, k: Tensor, v: Tensor, mask: AttentionMask, scoring: Scoring) -> Tensor:
            # the StreamingLLM sink keys stay inside the layer's own window (`sink_limit`), however narrowed; a
            # cache's call over one group of heads (heads holding different tokens) has no whole pattern to show
            whole = hooks if q.shape[1] == h else {}
            return backend(q, k, v, mask, scoring, sink_limit=own if mask.n_sink else None, **whole)

        if kv_cache is None:
            z = run(q, k, v, mask, scoring)
        else:  # the cache writes this call's keys/values and runs the backend over what it holds
            if k.shape[1] != kv:
                k, v = self._regrouped(k, v)
            z = kv_cache.attend(self.layer, q, k, v, mask, run, scoring=scoring, own_window=own,
                                hooked=self.hook_attn_scores.active or self.hook_pattern.active)
        z = z.transpose(1, 2)  # [batch, pos, head, d_head]
        if self.W_gate_attn is not None:
            z = z * self.hook_attn_gate(self._gate(x, per_head, h, dh))
        z = self.hook_z(z)
        if self.hook_result.active or self.use_attn_result:
            result = self.hook_result(torch.einsum("bphd,hdm->bphm", z, self.W_O))
            out, b_O = result.sum(2), stored(self, "b_O")
            return out if b_O is None else out + b_O
        z = z.reshape(b, p, h * dh)
        b_O = stored(self, "b_O")
        if b_O is None:
            return torch.matmul(z, self.W_O_flat)
        return torch.addmm(b_O, z.view(b * p, -1), self.W_O_flat).view(b, p, -1)

    def _gate(self, x: Tensor, per_head: tuple[Tensor, Tensor, Tensor] | None, h: int, dh: int) -> Tensor:
        """sigmoid(x W_gate_attn) [batch, pos, head, d_head]; with split inputs, each head's from its query input."""
        if per_head is None:
            return torch.sigmoid(torch.matmul(x, self.W_gate_attn)).unflatten(-1, (h, dh))
        W = self.W_gate_attn.unflatten(-1, (h, dh)).permute(1, 0, 2)  # [head, d_model, d_head]
        return torch.sigmoid(torch.einsum("bphm,hmd->bphd", per_head[0], W))


class _AsExpanded(torch.autograd.Function):
    """The identity on per-query-head keys or values [batch, head, pos, d_head] that are copies of their KV
    heads, laid out as the backends' own expansion of the KV heads lays them (`kernels.attention.expand_kv`:
    a copy per group, a broadcast view for one KV head), since a matmul's bits follow its operands' layout.
    The gradient passes through per query head, so each copy keeps its own."""

    @staticmethod
    def forward(ctx, x: Tensor, group: int) -> Tensor:
        first = x[:, ::group].clone()  # [batch, kv_head, pos, d_head]
        b, kv, n, d = first.shape
        return first[:, :, None].expand(b, kv, group, n, d).reshape(b, kv * group, n, d)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return grad, None


def scoring_of(attn, *, live: bool = False) -> Scoring:
    """The `Scoring` of an attention layer, native (`Attention`) or wrapped (`interp.models.wrapped.WrappedAttention`):
    its scale, window (narrowed, while `narrow_windows` narrows it), ALiBi slopes, soft cap and learned sink
    logits as the layer holds them now (on its device), causal. Built from the attributes every attention
    layer has, so the statistics need no per-kind geometry. The sink logits are detached, for readers; `live`:
    the layer's parameter itself, as a native layer's forward hands it to its backend (the gradient reaches it)."""
    sinks = attn.sinks
    return Scoring(scale=attn.scale, window=attn.window, alibi_slopes=attn.alibi_slopes, softcap=attn.softcap,
                   sink_logits=sinks if sinks is None or live else sinks.detach())


def effective_window(own: int | None, asked: int | None) -> int | None:
    """The window a layer attends through when an analysis asks for `asked` on a layer whose own
    window is `own` (None: full attention): the smaller, so an analysis can narrow a model's window
    (a Gemma local layer, a Mistral model) but never widen it."""
    if own is None:
        return asked
    return own if asked is None else min(own, asked)


@contextlib.contextmanager
def narrow_windows(model, window: int | None) -> Iterator[None]:
    """Inside the block every attention layer attends through `effective_window(own, window)`; with
    `window=None` the model as configured (its own windows, per layer). Restored on exit, even on an
    exception."""
    saved = [b.attn.window for b in model.blocks]
    try:
        for b in model.blocks:
            b.attn.window = effective_window(model.cfg.window(b.attn.layer), window)
        yield
    finally:
        for b, w in zip(model.blocks, saved):
            b.attn.window = w
