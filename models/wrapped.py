"""Any Hugging Face causal LM whose attention goes through transformers' attention interface, wrapped.

transformers' model files call whichever attention function the registry holds
(`ALL_ATTENTION_FUNCTIONS[config._attn_implementation]`). `WrappedModel` registers one of its own,
"interp", and points the model at it, so one function reaches every architecture that uses the
interface (Phi, Cohere, Granite, StarCoder2, GLM, Nemotron, ...) without a family file:

    fused         transformers' own SDPA call (exactly what the model runs by default), while nothing
                  asks for this layer's scores or pattern; soft-capped or sink-logit layers (which SDPA
                  cannot express) run the explicit computation in blocks of queries, never the whole
                  [q, k] pattern.
    instrumented  explicit scores -> hook_attn_scores -> softmax -> hook_pattern -> z, for the layers whose
                  scores or pattern are hooked or cached (or all, under `model.attention("instrumented")`).

On top sit TransformerLens's hook names, fired from the model's own modules:

    hook_embed                       the token embedding module's output
    blocks.{l}.hook_resid_pre        the decoder layer's input
    blocks.{l}.attn.hook_q / hook_k  [batch, pos, head | kv_head, d_head]: what attention receives, i.e.
                                     AFTER the model's RoPE and QK-norms (a native model's hook_q is before
                                     RoPE, its hook_rot_q after); editing them changes what attention sees
    blocks.{l}.attn.hook_v / hook_z  values, and each head's output before the output projection
    blocks.{l}.attn.hook_attn_scores / hook_pattern   [batch, head, q, k]
    blocks.{l}.hook_attn_out         the attention module's output (before a post-attention norm, where the
                                     model has one); blocks.{l}.hook_mlp_out: the MLP module's output
    blocks.{l}.hook_resid_post       the decoder layer's output

There is no `ln_final.hook_normalized`: TransformerLens's is the normalised stream before the norm's
weight, which a wrapped norm module does not expose (its output is after the weight), and a hook of the
same name with another meaning would be a silent error.

Everything that reads only hooks works on a wrapped model: `run_with_cache`, `run_with_hooks`, head
ablation through hook_z, `attention_stats` (the streaming kernel on the q/k attention received), the
views, `generate` (transformers' own). What needs interp's own implementation of the model (per-head
weights W_Q / W_O / ..., weight processing, GGUF, KV-cache policies, saving in our format) raises
`NativeOnly`, one line naming the native families.
"""

from __future__ import annotations

import inspect
import sys
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from interp.kernels.attention import Needs, choose

from interp.errors import CheckpointError, UserError, check_int

from .base import HookedModel, NativeOnly, lm_loss, native_families, native_only, native_only_method, rope_refusal
from .config import ModelConfig
from .families import FAMILIES
from .generate import Prompt, Sampling, cache_policy
from .hooks import HookPoint

INTERFACE = "interp"  # the name our attention function is registered under in transformers
QUERY_BLOCK = 512  # queries per block of the explicit fused path (soft-capping, sink logits)


class Bypasses(UserError, NotImplementedError):
    """An architecture whose attention does not go through transformers' attention interface."""


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


def _heads_last(x: Tensor, hook: HookPoint) -> Tensor:
    """Run hook on [batch, pos, head, d] for an [batch, head, pos, d] tensor (only when hooked)."""
    return hook(x.transpose(1, 2)).transpose(1, 2) if hook.active else x


def _repeat_kv(x: Tensor, heads: int) -> Tensor:
    groups = heads // x.shape[1]
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


def _explicit(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, causal: bool, *, scaling: float,
              softcap: float | None, sinks: Tensor | None, scores_hook=None, pattern_hook=None) -> Tensor:
    """softmax(cap(q k^T * scaling) masked [, sink]) v in float32 -> [batch, head, q, d] (v's dtype).

    `mask`: transformers' bool mask (True: attend) or an additive float one; None with `causal`: the
    queries are the last q of the k keys. A sink logit per head (gpt-oss) joins each row's softmax and is
    dropped after it, so a row's pattern sums to less than 1, as transformers' eager attention shows it.
    A query that sees no key gets a zero row (its output is zero, never NaN)."""
    heads, n_q, n_k = q.shape[1], q.shape[2], k.shape[2]
    scores = torch.matmul(q, _repeat_kv(k, heads).transpose(-1, -2)).float() * scaling
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask.float()
    elif causal and n_q > 1:
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
    return torch.matmul(pattern.to(v.dtype), _repeat_kv(v, heads))


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
        q = _heads_last(q, self.hook_q)
        k = _heads_last(k, self.hook_k)
        v = _heads_last(v, self.hook_v)
        if self.instrumented_now():
            z = _explicit(q, k, v, mask, causal, scaling=scaling, softcap=softcap, sinks=sinks,
                          scores_hook=self.hook_attn_scores if self.hook_attn_scores.active else None,
                          pattern_hook=self.hook_pattern if self.hook_pattern.active else None)
        elif softcap is None and sinks is None:
            from transformers.integrations.sdpa_attention import sdpa_attention_forward

            z = sdpa_attention_forward(module, q, k, v, mask, dropout=dropout, scaling=scaling, is_causal=is_causal,
                                       **kwargs)[0].transpose(1, 2)
        else:  # SDPA cannot soft-cap or add a sink: the same arithmetic, a block of queries at a time
            n_q, n_k = q.shape[2], k.shape[2]
            parts = []
            for s in range(0, n_q, QUERY_BLOCK):
                e = min(n_q, s + QUERY_BLOCK)
                if mask is not None:
                    m = mask[:, :, s:e]
                elif causal and n_q > 1:
                    m = torch.arange(n_k, device=q.device)[None, :] <= torch.arange(n_k - n_q + s, n_k - n_q + e,
                                                                                    device=q.device)[:, None]
                else:
                    m = None
                parts.append(_explicit(q[:, :, s:e], k, v, m, False, scaling=scaling, softcap=softcap, sinks=sinks))
            z = torch.cat(parts, dim=2)
        z = z.transpose(1, 2)  # [batch, q, head, d]
        return self.hook_z(z) if self.hook_z.active else z


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


# ---- finding the parts of a Hugging Face model --------------------------------------------------

_ATTN_NAMES = ("self_attn", "attn", "attention", "self_attention")
_MLP_NAMES = ("mlp", "feed_forward", "block_sparse_moe", "ffn")
_NORM_NAMES = ("norm", "ln_f", "final_layernorm", "final_layer_norm", "norm_f")


def _text_config(hf_config):
    return hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config


def _decoder_layers(hf) -> tuple[nn.Module, nn.ModuleList]:
    """(the module holding the decoder layers, the layers)."""
    n = _first(_text_config(hf.config), "num_hidden_layers", "n_layer", "num_layers")
    for name, mod in hf.named_modules():
        if isinstance(mod, nn.ModuleList) and len(mod) == n and name.rsplit(".", 1)[-1] in ("layers", "h", "blocks", "layer"):
            parent = hf.get_submodule(name.rsplit(".", 1)[0]) if "." in name else hf
            return parent, mod
    raise refusal(_text_config(hf.config).model_type, f"interp finds no ModuleList of its {n} decoder layers "
                  "(called layers / h / blocks) in {type(hf).__name__}")


def _child(module: nn.Module, names) -> tuple[str, nn.Module] | tuple[None, None]:
    for name in names:
        child = getattr(module, name, None)
        if isinstance(child, nn.Module):
            return name, child
    return None, None


def _first(cfg, *keys, default=None):
    for key in keys:
        value = getattr(cfg, key, None) if not isinstance(cfg, dict) else cfg.get(key)
        if value is not None:
            return value
    return default


def uses_interface(attn_cls: type) -> bool:
    """Whether an attention class's module calls transformers' attention registry."""
    return "ALL_ATTENTION_FUNCTIONS" in vars(sys.modules[attn_cls.__module__])


def causal_lm_class(model_type: str):
    """transformers' causal-LM class for `model_type`, or None when it has none."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type)
    return getattr(transformers, name, None) if name else None


def refusal(model_type, why: str) -> Bypasses:
    """The one line for an architecture interp cannot run: what, why, and what does run."""
    return Bypasses(f"unsupported architecture model_type={model_type!r}: {why}; interp converts "
                    f"{native_families()} natively and wraps any transformers causal LM whose attention goes through "
                    "its attention interface (interp info --architectures)")


def check_wrappable(model_type: str | None) -> None:
    """Raise `Bypasses` (one line) unless transformers has a causal LM for `model_type` whose attention
    goes through its attention interface. Needs transformers; reads no weights (`check_structure` then
    checks the model itself, built on the meta device where no weights exist yet)."""
    try:
        import transformers  # noqa: F401 - optional: only wrapped models need it
    except ImportError:
        raise UserError(f"model_type {model_type!r} is not a native family of interp ({', '.join(native_families())}); "
                        "running it wrapped needs transformers: pip install 'interp[hf]'") from None
    cls = causal_lm_class(model_type) if model_type else None
    if cls is None:
        raise refusal(model_type, "transformers has no causal language model for it")
    if "ALL_ATTENTION_FUNCTIONS" not in vars(sys.modules[cls.__module__]):
        raise refusal(model_type, f"{cls.__name__} computes attention in its own code, not through transformers' "
                                  "attention interface, so interp cannot hook it")


def check_structure(hf) -> tuple[nn.Module, nn.ModuleList, list[nn.Module], list[nn.Module | None]]:
    """(the module holding the decoder layers, the layers, each layer's attention and MLP modules) of a
    transformers model, or `Bypasses`: no decoder layers, an attention module that bypasses the
    interface, or attention that is not causal (an encoder such as BERT, whose causal-LM head is a
    decoder only when its config says so)."""
    model_type = str(_text_config(hf.config).model_type)
    base, layers = _decoder_layers(hf)
    attns, mlps = [], []
    for l, layer in enumerate(layers):
        attn = _child(layer, _ATTN_NAMES)[1]
        if attn is None:
            raise refusal(model_type, f"{type(layer).__name__} (layer {l}) has no attention module called "
                                      f"{' / '.join(_ATTN_NAMES)}")
        if not uses_interface(type(attn)):
            raise refusal(model_type, f"{type(attn).__name__} computes attention in its own code, not through "
                                      "transformers' attention interface")
        both_ways = [m for m in attn.modules() if getattr(m, "is_causal", True) is False]
        if both_ways:
            raise refusal(model_type, f"{type(both_ways[0]).__name__} attends both ways (is_causal=False): interp "
                                      "studies causal language models")
        attns.append(attn)
        mlps.append(_child(layer, _MLP_NAMES)[1])
    return base, layers, attns, mlps


# ---- the model -----------------------------------------------------------------------------------


def wrapped_config(hf_config, windows: list[int | None]) -> ModelConfig:
    """Our config's view of a wrapped model: its shape (layers, widths, heads, vocabulary, context,
    windows), for analyses that read sizes. The computation is transformers'; `model_type` says which."""
    c = _text_config(hf_config)
    d_model = _first(c, "hidden_size", "n_embd", "d_model")
    n_heads = _first(c, "num_attention_heads", "n_head", "num_heads")
    d_head = _first(c, "head_dim", default=d_model // n_heads)
    window = next((w for w in windows if w is not None), None)
    return ModelConfig(
        n_layers=len(windows), d_model=d_model, n_heads=n_heads, d_head=d_head,
        n_kv_heads=_first(c, "num_key_value_heads", "num_kv_heads", default=n_heads) if _first(c, "multi_query") is not True else 1,
        d_vocab=_first(c, "vocab_size"),
        n_ctx=_first(c, "max_position_embeddings", "n_positions", "seq_length", "max_sequence_length", default=2048),
        d_mlp=_first(c, "intermediate_size", "n_inner", "ffn_dim", default=4 * d_model),
        positional="rotary" if _first(c, "rope_parameters", "rope_theta", "rope_scaling") is not None else None,
        sliding_window=window,
        layer_types=tuple("sliding" if w is not None else "full" for w in windows) if window is not None else None,
        tie_embeddings=bool(_first(c, "tie_word_embeddings", default=False)),
        model_type=str(c.model_type),
    )


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

    def rescale_rope_(self, scaling) -> "WrappedModel":
        """Native models only: transformers applies a wrapped model's own rope_parameters."""
        raise rope_refusal(self.cfg.model_type)


def config_windows(c, n: int) -> list[int | None]:
    """Each layer's sliding window as a transformers config states it (`sliding_window`, with
    `layer_types` or `use_sliding_window` / `max_window_layers` where the config has them)."""
    window = _first(c, "sliding_window")
    types = _first(c, "layer_types")
    if window is None or _first(c, "use_sliding_window") is False:
        return [None] * n
    if types is not None:
        return [window if t == "sliding_attention" else None for t in types]
    return [window] * n


def config_from_hf(hf_config) -> ModelConfig:
    """`wrapped_config` of a transformers config object, its windows per layer as the config states them."""
    c = _text_config(hf_config)
    return wrapped_config(c, config_windows(c, _first(c, "num_hidden_layers", "n_layer", "num_layers")))


# The causal LMs the issue tracker listed, in its order: `interp info --architectures` and the README's table.
LISTED = ("gpt2", "gpt_neox", "llama", "mistral", "qwen2", "gemma3_text", "gemma", "gemma2", "qwen3", "olmo", "olmo2",
          "phi", "phi3", "gptj", "gpt_neo", "opt", "bloom", "falcon", "mpt", "stablelm", "starcoder2", "cohere",
          "granite", "mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "gpt_oss", "codegen", "gpt_bigcode", "exaone", "glm",
          "glm4", "smollm3", "apertus", "arcee", "ministral", "seed_oss", "nemotron", "xglm", "openai-gpt")


def architecture(model_type: str) -> tuple[str, str]:
    """(how interp runs `model_type`: "native", "wrapped" or "refused", and why, in a few words)."""
    if model_type in FAMILIES:
        return "native", f"converted by models/families ({FAMILIES[model_type].name})"
    try:
        check_wrappable(model_type)
    except UserError as e:
        reason = "no transformers causal LM" if causal_lm_class(model_type) is None else \
            "attention computed outside transformers' attention interface"
        return "refused", reason if "transformers" not in str(e) or "pip install" not in str(e) else "needs transformers"
    return "wrapped", f"transformers' {causal_lm_class(model_type).__name__}, interp's attention function"


def architecture_table(model_types=LISTED) -> str:
    """A Markdown table: model_type, transformers' class, how interp runs it and why."""
    rows = ["| model_type | transformers class | interp | how |", "|---|---|---|---|"]
    for t in model_types:
        status, why = architecture(t)
        cls = causal_lm_class(t)
        rows.append(f"| {t} | {cls.__name__ if cls else '-'} | {status} | {why} |")
    counts = {s: sum(architecture(t)[0] == s for t in model_types) for s in ("native", "wrapped", "refused")}
    rows.append("")
    rows.append(f"{counts['native']} native, {counts['wrapped']} wrapped, {counts['refused']} refused.")
    return "\n".join(rows)


def every_causal_lm() -> dict[str, list[str]]:
    """Every causal-LM model type of the installed transformers, by how interp runs it: "native";
    "wrapped" (its model, built on the meta device from its default config, passes `check_structure`);
    "refused" (attention outside the interface, or a structure interp cannot hook: recurrent or
    linear-attention hybrids, cross-attention layers, encoders); "unchecked" (its default config does not
    build, or its model file does not import here)."""
    import torch
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    out: dict[str, list[str]] = {"native": [], "wrapped": [], "refused": [], "unchecked": []}
    for t in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        try:
            status = architecture(t)[0]
            if status == "wrapped":
                with torch.device("meta"):
                    check_structure(causal_lm_class(t)(AutoConfig.for_model(t)))
        except UserError:
            status = "refused"
        except Exception:  # noqa: BLE001 - a default config that does not build, a missing optional dependency
            status = "unchecked"
        out[status].append(t)
    return out
