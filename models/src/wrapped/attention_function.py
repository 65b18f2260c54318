"""The attention function interp registers in transformers' attention interface ("interp"), and each layer's
hook points behind it (`WrappedAttention`): fused (transformers' own SDPA call) while nothing asks for the
layer's scores or pattern, the explicit computation when something does (see `interp.models.wrapped`)."""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor, nn

from interp.kernels.attention import Needs, choose
from interp.kernels.stats import Scoring

from ..native.attention_layer import scoring_of
from ..base import native_only
from ..hooks import HookPoint

INTERFACE = "interp"  # the name our attention function is registered under in transformers
QUERY_BLOCK = 512  # queries per block of the explicit fused path (soft-capping, sink logits)

# ---- the attention function registered in transformers -------------------------------------------

_registered = False


def register_interface() -> None:
    """Register "interp" in transformers' attention and mask registries (once). The masks are
    transformers' SDPA masks: bool [batch, 1, q, k] (True: attend), or None for a plain causal call."""
    global _registered
    if _registered:
        return
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(INTERFACE, _attention)
    AttentionMaskInterface.register(INTERFACE, sdpa_mask)
    _registered = True


def _attention(module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
               dropout: float = 0.0, scaling: float | None = None, softcap: float | None = None,
               s_aux: Tensor | None = None, is_causal: bool | None = None, **kwargs):
    """transformers' attention-function signature: query [batch, head, q, d], key / value
    [batch, kv_head, k, d] -> (output [batch, q, head, d], None)."""
    site = module.__dict__.get("_interp_site")
    if site is None:
        raise RuntimeError(f"{type(module).__name__} runs interp's attention but is not part of a WrappedModel; "
                           "wrap the model with interp.from_hf(model)")
    return site.attend(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, softcap=softcap,
                       sinks=s_aux, is_causal=is_causal, **kwargs), None


def _heads_last(x: Tensor, hook: HookPoint, shown: bool = False) -> Tensor:
    """Run hook on [batch, pos, head, d] for an [batch, head, pos, d] tensor (only when hooked, or `shown`)."""
    return hook(x.transpose(1, 2)).transpose(1, 2) if shown or hook.active else x


def _repeat_kv(x: Tensor, heads: int) -> Tensor:
    groups = heads // x.shape[1]
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


def _explicit(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, scoring: Scoring, *, scores_hook=None,
              pattern_hook=None, dropout: float = 0.0) -> Tensor:
    """softmax(cap(q k^T * scale) masked [, sink]) v in float32 -> [batch, head, q, d] (v's dtype).
    `dropout`: the probability transformers passes in training mode (0 otherwise), applied to the pattern
    after `hook_pattern` sees it, as transformers' eager attention applies it after the softmax.

    `scoring`: the call's scale, soft cap, sink logits and causality, as transformers passed them
    (`WrappedAttention.attend`); the window and any bias are in `mask`: transformers' bool mask (True:
    attend) or an additive float one; None with `scoring.causal`: the queries are the last q of the k keys.
    A sink logit per head (gpt-oss) joins each row's softmax and is dropped after it, so a row's pattern sums
    to less than 1, as transformers' eager attention shows it. A query that sees no key gets a zero row (its
    output is zero, never NaN)."""
    heads, n_q, n_k = q.shape[1], q.shape[2], k.shape[2]
    softcap, sinks = scoring.softcap, scoring.sink_logits
    scores = torch.matmul(q, _repeat_kv(k, heads).transpose(-1, -2)).float() * scoring.scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask.float()
    elif scoring.causal and n_q > 1:
        rows = torch.arange(n_k - n_q, n_k, device=q.device)[:, None]
        scores = scores.masked_fill(torch.arange(n_k, device=q.device)[None, :] > rows, float("-inf"))
    if scores_hook is not None:
        scores = scores_hook(scores)
    if sinks is None:
        pattern = torch.softmax(scores, dim=-1)
    else:
        sink = sinks.float().view(1, heads, 1, 1).expand(scores.shape[0], heads, n_q, 1)
        pattern = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    pattern = torch.nan_to_num(pattern, nan=0.0)
    if pattern_hook is not None:
        pattern = pattern_hook(pattern)
    pattern = pattern.to(v.dtype)
    if dropout:
        pattern = torch.nn.functional.dropout(pattern, p=dropout, training=True)
    return torch.matmul(pattern, _repeat_kv(v, heads))


class WrappedAttention(nn.Module):
    """One layer's attention hook points and the computation behind transformers' call (see the module
    docstring). `scale`, `window` and `alibi_slopes` describe the layer to the statistics kernel."""

    alibi_slopes = None

    def __init__(self, module: nn.Module, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.backend = "auto"
        self.__dict__["_module"] = module  # not a submodule: the HF model owns it
        for m in module.modules():  # whichever of them calls the attention function (BERT-like: an inner one)
            m.__dict__["_interp_site"] = self
        for name in ("hook_q", "hook_k", "hook_v", "hook_attn_scores", "hook_pattern", "hook_z"):
            setattr(self, name, HookPoint())
        self.called = False

    @property
    def scale(self) -> float:
        m = self._module
        return float(getattr(m, "scaling", None) or getattr(m, "head_dim", 0) ** -0.5)

    @property
    def window(self) -> int | None:
        """The layer's sliding window: what the model passed at its last call (`sliding_window=`), else
        its attention module's attribute, else the config's (`config_windows`)."""
        if "seen_window" in self.__dict__:
            return self.__dict__["seen_window"]
        return getattr(self._module, "sliding_window", None) or self.__dict__.get("config_window")

    @property
    def softcap(self) -> float | None:
        cap = getattr(self._module, "attn_logit_softcapping", None)
        return cap or getattr(getattr(self._module, "config", None), "attn_logit_softcapping", None) or None

    scoring = property(scoring_of, doc="The layer's `Scoring` for the statistics kernels, as a native layer's.")

    @property
    def sinks(self) -> Tensor | None:
        """The layer's learned sink logits [head] (gpt-oss), None without."""
        sinks = getattr(self._module, "sinks", None)
        return sinks if isinstance(sinks, Tensor) else None

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name.startswith(("W_", "b_")) or name in ("qk_norm", "q_norm", "k_norm", "rotary"):
                raise native_only(f"attn.{name} (per-head weights)", self._model_type) from None
            raise

    _model_type = "?"

    def instrumented_now(self) -> bool:
        needs = Needs(pattern=self.hook_attn_scores.active or self.hook_pattern.active, device="cpu")
        return choose(self.backend, needs, where=f"layer {self.layer}").gives_pattern

    def attend(self, module, q, k, v, mask, *, dropout, scaling, softcap, sinks, is_causal, **kwargs) -> Tensor:
        self.called = True
        if "sliding_window" in kwargs:
            self.__dict__["seen_window"] = kwargs["sliding_window"] or None
        scaling = q.shape[-1] ** -0.5 if scaling is None else scaling
        causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
        # the call's scoring as transformers passed it (the window and any bias are in its mask)
        scoring = Scoring(scale=scaling, softcap=softcap, sink_logits=sinks, causal=causal)
        # The instrumented path calls every hook point of the layer as a module, hooked or not, so PyTorch module
        # hooks and nnsight (which wraps each module's forward) see them whenever it runs; the fused path calls
        # only the hooked ones.
        shown = self.instrumented_now()
        q = _heads_last(q, self.hook_q, shown)
        k = _heads_last(k, self.hook_k, shown)
        v = _heads_last(v, self.hook_v, shown)
        # transformers passes the module's dropout in training mode, 0.0 otherwise; every path applies it
        dropout = float(dropout or 0.0) if module.training else 0.0
        if shown or dropout and (softcap is not None or sinks is not None):
            # one block: the dropout mask is drawn over the whole pattern, as transformers' eager draws it
            z = _explicit(q, k, v, mask, scoring, dropout=dropout,
                          scores_hook=self.hook_attn_scores if shown else None,
                          pattern_hook=self.hook_pattern if shown else None)
        elif softcap is None and sinks is None:
            from transformers.integrations.sdpa_attention import sdpa_attention_forward

            z = sdpa_attention_forward(module, q, k, v, mask, dropout=dropout, scaling=scaling, is_causal=is_causal,
                                       **kwargs)[0].transpose(1, 2)
        else:  # SDPA cannot soft-cap or add a sink: the same arithmetic, a block of queries at a time
            n_q, n_k = q.shape[2], k.shape[2]
            blocked, parts = dataclasses.replace(scoring, causal=False), []  # each block's mask is made here
            for s in range(0, n_q, QUERY_BLOCK):
                e = min(n_q, s + QUERY_BLOCK)
                if mask is not None:
                    m = mask[:, :, s:e]
                elif causal and n_q > 1:
                    m = torch.arange(n_k, device=q.device)[None, :] <= torch.arange(n_k - n_q + s, n_k - n_q + e,
                                                                                    device=q.device)[:, None]
                else:
                    m = None
                parts.append(_explicit(q[:, :, s:e], k, v, m, blocked))
            z = torch.cat(parts, dim=2)
        z = z.transpose(1, 2)  # [batch, q, head, d]
        return self.hook_z(z) if shown or self.hook_z.active else z
