"""`WrappedModel`: a transformers causal LM run by transformers, with interp's attention and
TransformerLens's hook names fired from its own modules (see `interp.models.wrapped`), and `generate_wrapped`,
transformers' own generate with interp's settings."""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import Tensor, nn

from interp.errors import check_int

from ..base import HookedModel, lm_loss, native_only, native_only_method, rope_refusal
from ..generate import Prompt, Sampling, cache_policy
from ..hooks import HookPoint
from .architectures import _NORM_NAMES, _child, _text_config, check_structure, config_windows, refusal, wrapped_config
from .attention_function import INTERFACE, WrappedAttention, register_interface


class WrappedBlock(nn.Module):
    """One decoder layer's hook points (the HF layer itself stays in the HF model)."""

    def __init__(self, attn: WrappedAttention, has_mlp: bool) -> None:
        super().__init__()
        self.hook_resid_pre = HookPoint()
        self.attn = attn
        self.hook_attn_out = HookPoint()
        if has_mlp:
            self.hook_mlp_out = HookPoint()
        self.hook_resid_post = HookPoint()


class _Stop(Exception):
    def __init__(self, resid: Tensor) -> None:
        self.resid = resid


@torch.no_grad()
def generate_wrapped(model: WrappedModel, tokens, max_new_tokens: int = 20, sampling: Sampling | None = None, *,
                     policy=None, attention_mask: Tensor | None = None, capture_queries: bool = False,
                     return_kv_cache: bool = False, **settings):
    """`interp.models.generate.generate`'s arguments, run by transformers' own `generate` through interp's
    attention (hooks fire at every step): the same `Sampling` (its seed seeds torch's generator for the
    call; `use_past_kv_cache` is transformers' `use_cache`), text or ids in, the same answer out. What needs
    interp's KV cache (a cache policy, captured queries, the returned cache) and TransformerLens's
    freq_penalty, which transformers does not have, are refused in one line."""
    cache_args = cache_policy(policy, settings)
    s = Sampling.of(sampling, settings)
    asked = {"a KV-cache policy (policy=, kv_precision=)": bool(cache_args), "capture_queries": capture_queries,
             "return_kv_cache": return_kv_cache, "freq_penalty (use repetition_penalty)": s.freq_penalty > 0}
    refused = [what for what, given in asked.items() if given]
    if refused:
        raise native_only(f"generate with {', '.join(refused)}", model.cfg.model_type)
    check_int("max_new_tokens", max_new_tokens, minimum=0)
    prompt = Prompt.of(model, tokens, attention_mask, s)
    if max_new_tokens == 0:
        return prompt.answer(model, prompt.tokens, s)
    stops, pad = s.stops(model)
    sample = {}
    if s.do_sample and s.temperature != 0:  # temperature 0 is greedy, as natively
        sample = dict(temperature=s.temperature, top_k=s.top_k or None, top_p=s.top_p)
    mask = prompt.real.long()
    extra = {}  # what is not asked for stays as the model's generation config has it
    if s.repetition_penalty != 1.0:
        extra["repetition_penalty"] = s.repetition_penalty
    if not s.use_past_kv_cache:
        extra["use_cache"] = False
    seeded = s.seed is not None and bool(sample)  # the seed is for sampling, as natively; the caller's RNG untouched
    with torch.random.fork_rng(devices=[model.device] if model.device.type == "cuda" else [], enabled=seeded):
        if seeded:
            torch.manual_seed(s.seed)
        out = model.hf.generate(prompt.tokens, attention_mask=mask, max_new_tokens=max_new_tokens,
                                do_sample=bool(sample), eos_token_id=stops or None, pad_token_id=pad,
                                **sample, **extra)
    return prompt.answer(model, out, s)


class WrappedModel(HookedModel):
    """A transformers causal LM run by transformers, with interp's attention and TransformerLens's hook
    names (see the module docstring): everything an interp model has (`interp.models.base.HookedModel`),
    and each native-only capability refused in one line. Made by `interp.from_hf(model)` for a non-native
    architecture, or `interp.load(folder)`. `model.hf` is the transformers model itself."""

    native = False
    _core = "hf"

    def __init__(self, hf, *, tokenizer=None, name: str | None = None) -> None:
        super().__init__(tokenizer=tokenizer)
        register_interface()
        hf.eval()
        self.hf = hf
        model_type = str(_text_config(hf.config).model_type)
        base, layers, attns, mlps = check_structure(hf)
        sites = [WrappedAttention(a, l) for l, a in enumerate(attns)]
        for s, w in zip(sites, config_windows(_text_config(hf.config), len(sites))):
            s._model_type = model_type
            s.__dict__["config_window"] = w
        self.hook_embed = HookPoint()  # before the blocks: hook_dict follows the order of computation
        self.blocks = nn.ModuleList(WrappedBlock(s, m is not None) for s, m in zip(sites, mlps))
        self.cfg = wrapped_config(hf.config, [s.window for s in sites])
        self._plumb(hf.get_input_embeddings(), layers, attns, mlps, _child(base, _NORM_NAMES)[1])
        for sub in hf.modules():  # every config the model holds (a multimodal one's text config too)
            cfg = getattr(sub, "config", None)
            if cfg is not None and hasattr(cfg, "_attn_implementation_internal"):
                cfg._attn_implementation_internal = INTERFACE
        self.setup_hooks()
        self.runtime.name = name
        self._refresh_view()

    # ---- hook plumbing on the HF modules --------------------------------------------------------
    def _plumb(self, embed, layers, attns, mlps, final_norm) -> None:
        def output(hook: HookPoint):
            def fn(module, args, out):
                if not hook.active:
                    return None
                if isinstance(out, tuple):
                    return (hook(out[0]), *out[1:])
                return hook(out)
            return fn

        def resid_pre(hook: HookPoint, stop_here):
            def fn(module, args, kwargs):
                x = args[0] if args else kwargs["hidden_states"]
                if stop_here():
                    raise _Stop(x)
                if not hook.active:
                    return None
                x = hook(x)
                return ((x, *args[1:]), kwargs) if args else (args, {**kwargs, "hidden_states": x})
            return fn

        handles = [embed.register_forward_hook(output(self.hook_embed))]
        for l, (layer, attn, mlp, block) in enumerate(zip(layers, attns, mlps, self.blocks)):
            handles.append(layer.register_forward_pre_hook(resid_pre(block.hook_resid_pre, lambda l=l: self._stop == l),
                                                           with_kwargs=True))
            handles.append(attn.register_forward_hook(output(block.hook_attn_out)))
            if mlp is not None:
                handles.append(mlp.register_forward_hook(output(block.hook_mlp_out)))
            handles.append(layer.register_forward_hook(output(block.hook_resid_post)))
        if final_norm is not None:
            n = len(layers)
            handles.append(final_norm.register_forward_pre_hook(
                resid_pre(HookPoint(), lambda: self._stop == n), with_kwargs=True))
        self.__dict__["_handles"] = handles  # the plumbing's hook handles (kept, never a submodule)

    _stop: int | None = None

    # ---- what a wrapped model is --------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return next(self.hf.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.hf.parameters()).dtype

    rotary = None  # hook_q / hook_k already carry the model's RoPE

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name.startswith(("W_", "b_")) or name in ("embed", "pos_embed", "unembed", "ln_final", "QK", "OV"):
                raise native_only(f"model.{name} (interp's weight views)", self.cfg.model_type) from None
            raise

    def __repr__(self) -> str:
        c = self.cfg
        return (f"WrappedModel({c.model_type} via transformers {type(self.hf).__name__}: {c.n_layers} layers, "
                f"d_model={c.d_model}, {c.n_heads} heads ({c.kv_heads} kv), attention={self._backend})")

    # ---- forward --------------------------------------------------------------------------------------
    def forward(self, input, return_type="logits", *, attention_mask: Tensor | None = None, kv_cache=None,
                loss_per_token: bool = False, start_at_layer: int | None = None, stop_at_layer: int | None = None,
                tokens: Tensor | None = None, prepend_bos: bool | None = None, padding_side: str | None = None):
        """`HookedTransformer.forward`'s arguments, run by transformers: token ids or text in; logits,
        loss, both or None out; `stop_at_layer` returns the residual stream before that layer. Positions
        count real tokens only (left-padded rows get the positions they would alone), as natively."""
        if kv_cache is not None:
            raise native_only("a KV cache of interp's (kv_cache=...)", self.cfg.model_type)
        if start_at_layer is not None:
            raise native_only("start_at_layer (resuming from a residual stream)", self.cfg.model_type)
        prepared = self.prepare(input, attention_mask, prepend_bos=prepend_bos, padding_side=padding_side)
        toks, mask = prepared.tokens, prepared.attention_mask
        kwargs: dict[str, Any] = {"use_cache": False}
        if mask is not None:
            valid = self._valid(mask, *toks.shape)
            kwargs["attention_mask"] = valid.long()
            if "position_ids" in inspect.signature(self.hf.forward).parameters:
                kwargs["position_ids"] = (valid.long().cumsum(1) - 1).clamp(min=0)
        for site in (b.attn for b in self.blocks):
            site.called = False
        if stop_at_layer is not None:
            if not 0 <= stop_at_layer <= self.cfg.n_layers:
                raise ValueError(f"stop_at_layer must lie in [0, {self.cfg.n_layers}], got {stop_at_layer}")
            self._stop = stop_at_layer
            try:
                self.hf(input_ids=toks, **kwargs)
            except _Stop as stop:
                return stop.resid
            finally:
                self._stop = None
            raise RuntimeError(f"the forward of {type(self.hf).__name__} never reached layer {stop_at_layer}")
        logits = self.hf(input_ids=toks, **kwargs).logits
        missed = [b.attn.layer for b in self.blocks if not b.attn.called]
        if missed:
            raise refusal(self.cfg.model_type, f"{type(self.hf).__name__}'s layers {missed} did not call transformers' "
                                               "attention interface, so interp cannot hook them")
        if return_type is None:
            return None
        if return_type == "logits":
            return logits
        valid = None if mask is None else self._valid(mask, *toks.shape)
        loss = lm_loss(logits, toks, valid, per_token=loss_per_token)
        return loss if return_type == "loss" else (logits, loss)

    generate = generate_wrapped  # transformers' own generate, through interp's attention

    # ---- native-only: one line each ------------------------------------------------------------------
    process_weights_ = native_only_method("TransformerLens's weight processing")
    new_kv_cache = native_only_method("interp's KV cache and its per-head policies")
    window_policy = native_only_method("window cache policies")
    save = native_only_method("saving in interp's format (save the transformers model with model.hf.save_pretrained)")
    set_use_split_qkv_input = set_use_attn_in = set_use_hook_mlp_in = native_only_method(
        "TransformerLens's split-input hook points (hook_q_input / hook_attn_in / hook_mlp_in)")
    set_ungroup_grouped_query_attention = native_only_method("keys and values per query head (ungroup_grouped_query_attention)")

    def rescale_rope_(self, scaling) -> "WrappedModel":
        """Native models only: transformers applies a wrapped model's own rope_parameters."""
        raise rope_refusal(self.cfg.model_type)
