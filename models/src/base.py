"""What every interp model is, native or wrapped: `HookedModel`.

Two classes stand on it:

    HookedTransformer  interp's own transformer (`interp.models.native.transformer`): it computes every layer,
                       so it also gives what needs its own implementation: GGUF and our format, the KV
                       cache and its per-head policies, TransformerLens's weight processing and weight
                       views, RoPE rescaled at inference, the split-input hook points.
    WrappedModel       a transformers causal LM run by transformers, with interp's attention function and
                       these hook names on its modules (`interp.models.wrapped`): it refuses each of those
                       native-only capabilities in one line (`NativeOnly`, made by `native_only`).

What they share lives here: hook points and their scoping (`HookedRootModule`), text in and out
(`TextMixin`), what a caller's input becomes (`prepare` -> `TokenBatch`), the attention backend and its
`with model.attention(...)`, `run_with_cache`, `attention_stats`, `loss_fn`, the model's `runtime` and
TransformerLens's view of it on `cfg`. Code that accepts "a model" checks `isinstance(model, HookedModel)`
and asks `model.native` for the native-only part. Each class brings its forward, its `device` / `dtype`
and its `generate` (native: `interp.models.generate.generate` through interp's KV cache; wrapped:
transformers' own `generate` through interp's attention), both taking the same `Sampling`.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator, Literal, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from interp.errors import UserError
from interp.kernels.attention import BACKEND_CHOICES

from interp.kernels.attention import BackendChoice
from .readouts.activation_cache import ActivationCache, to_tl_cache
from .families import FAMILIES
from .hooks import HookedRootModule, HookPoint, NamesFilter, caching_hook
from .saes.splice import SAEMixin
from .rope.choice import rope_spec
from .runtime import Runtime
from .readouts.head_statistics import kv_cache_attention_stats, model_attention_stats
from .placement.tensor_files import check_files, mapped_files
from .text import TextMixin, _is_text


# ---- what only interp's own transformer gives, refused in one line ------------------------------------------
class NativeOnly(UserError, NotImplementedError):
    """Something only a native family gives (interp's own implementation), asked of a wrapped model."""


def native_families() -> list[str]:
    return sorted(FAMILIES)


def native_only(what: str, model_type: str) -> NativeOnly:
    """The one line a wrapped model says when asked for `what`, which needs interp's own implementation."""
    return NativeOnly(
        f"{what} needs interp's own implementation of the model; model_type {model_type!r} is wrapped (transformers "
        f"runs it, interp hooks its attention). Native families: {', '.join(native_families())}"
    )


def native_only_method(what: str):
    """A method of the native class as a wrapped model has it: one line refusing `what`, whatever its arguments."""

    def refuse(self, *args, **kwargs):
        raise native_only(what, self.cfg.model_type)

    refuse.__doc__ = f"Native models only ({what}); a wrapped model refuses it in one line."
    return refuse


def rope_refusal(model_type: str, what: str = "this", rope_scaling=None) -> NativeOnly:
    """The one line refusing RoPE scaling at inference for a wrapped model (`what`: the model or its path;
    transformers applies its own rope_parameters). A given `rope_scaling` is checked first, so a bad
    spelling is said as such."""
    if rope_scaling is not None:
        rope_spec(rope_scaling)
    return NativeOnly(f"rope_scaling is interp's own transformer's, and {what} is a {model_type} model that "
                      "transformers runs (wrapped): set rope_parameters in its config (config.json) instead")


# ---- what a caller's input becomes -------------------------------------------------------------------------
@dataclass(frozen=True)
class TokenBatch:
    """Token ids [batch, pos] on the model's device and their attention mask (1 / True for real tokens;
    None: every position is real), as `HookedModel.prepare` builds them for every entry point."""

    tokens: Tensor
    attention_mask: Tensor | None = None

    @property
    def valid(self) -> Tensor:
        """bool [batch, pos]: True for real tokens."""
        if self.attention_mask is None:
            return torch.ones(self.tokens.shape, dtype=torch.bool, device=self.tokens.device)
        return self.attention_mask.to(device=self.tokens.device, dtype=torch.bool)


class HookedModel(TextMixin, SAEMixin, HookedRootModule):
    """The model interface every interp model has (see the module docstring). Subclasses set `native`,
    `_core` (the submodule whose presence says the model is built) and `cfg`, and give `forward`, `device`,
    `dtype` and `generate`."""

    native: bool  # interp's own implementation (True), or transformers' model with our hooks (False)
    offload = None  # `interp.models.placement.offload.Offload` when the weights stay off the device (load(offload=))
    device_map = None  # {unit: torch.device} of a model loaded with load(device_map=) (`interp.models.placement.device_map`)
    _core: str  # a submodule that exists once the model is built (`_refresh_view` waits for it)

    def __init__(self, *, tokenizer=None) -> None:
        super().__init__()
        # What the model holds besides its shape and weights (name, tokenizer, text defaults, hook
        # switches, processing), in one visible place; `cfg` presents TransformerLens's view of it.
        self.runtime = Runtime(tokenizer=tokenizer)
        self._backend: BackendChoice = "auto"

    def __getattr__(self, name: str):
        # A property that raises AttributeError (W_pos on a rotary model, W_in on an attention-only
        # one) would otherwise surface as nn.Module's bare "no attribute"; re-raise its own message.
        modules = self.__dict__.get("_modules")
        if modules is not None and name in modules:  # the common case (self.blocks, ...), first
            return modules[name]
        try:
            return super().__getattr__(name)
        except AttributeError:
            prop = getattr(type(self), name, None)
            if isinstance(prop, property):
                prop.fget(self)
            raise

    _weight_files: tuple | None = None  # the mapped checkpoint files the weights are views of (None: not looked yet)

    def check_weight_files(self) -> None:
        """Refuse in one line (`tensor_files.CheckpointChanged`) when a checkpoint file this model's weights are
        memory-mapped from was written over or truncated in place since the load, before anything reads a
        weight; warn once when the path now holds another file (the model keeps what it loaded). The native
        forward calls it first. One os.stat per mapped file; a model whose weights were copied has none. Which
        files those are is found once (the tensors' addresses against the live mappings) and again after a
        move or a cast (`_apply`) or weight processing. See `interp.models.placement.tensor_files` for what is caught."""
        files = self._weight_files
        if files is None:
            held = [*self.parameters(), *self.buffers()]
            files = mapped_files(held)
            if self.offload is not None:  # the offloaded units' sources: their blocks check them again as they run
                files = tuple(dict.fromkeys(files + self.offload.files))
            self._weight_files = files
        check_files(files)

    def holding(self, *layers):
        """Hold the blocks `layers` (ints, or unit names: "unembed") on the device for the `with` block: for code
        that reads an offloaded model's weights outside its forward (`model.blocks[3].attn.W_O`). On a model
        held whole (not offloaded) it does nothing."""
        if self.offload is None:
            return contextlib.nullcontext()
        return self.offload.holding(*(f"blocks.{l}" if isinstance(l, int) else l for l in layers))

    def require_native(self, what: str) -> None:
        """Raise `native_only(what)` unless this is interp's own transformer."""
        if not self.native:
            raise native_only(what, self.cfg.model_type)

    # ---- the runtime and TransformerLens's view of it ---------------------------------------------
    def _refresh_view(self) -> None:
        """Give the config the view of this model as it is now (device, dtype, `runtime`): TransformerLens
        reads them off `model.cfg`. Called by every change of either."""
        if self._core not in self._modules or "cfg" not in self.__dict__:
            return  # still being built
        self.cfg = self.cfg.with_view(self.runtime.view(self.cfg, self.device, self.dtype, owner=self))

    @property
    def tokenizer(self):
        """The tokenizer text goes through (any Hugging Face tokenizer, or the zoo's byte tokenizer)."""
        return self.runtime.tokenizer

    @tokenizer.setter
    def tokenizer(self, tok) -> None:
        self.runtime.tokenizer = tok
        self._refresh_view()  # default_prepend_bos follows the tokenizer's BOS

    def loaded_as(self, name: str | None, *, default_prepend_bos: bool | None = None) -> "HookedModel":
        """Record what this model was loaded as (`cfg.model_name`) and, unless None, override whether text
        gets BOS first by default (`cfg.default_prepend_bos`). Returns the model."""
        self.runtime.name = name
        if default_prepend_bos is not None:
            self.runtime.prepend_bos = bool(default_prepend_bos)
        self._refresh_view()
        return self

    def _apply(self, fn, *args, **kwargs):
        # Every move or cast (.to, .cuda, .half, to_empty) goes through here: keep cfg.device/.dtype true.
        out = super()._apply(fn, *args, **kwargs)
        self._weight_files = None  # a cast or a move may have copied the weights out of their files
        self._refresh_view()
        return out

    def enable_compatibility_mode(self, disable_warnings: bool = False, no_processing: bool = False,
                                  **_ignored) -> "HookedModel":
        """TransformerLens 4's `TransformerBridge.enable_compatibility_mode`, so its tutorials run with
        only the model line changed: its weight processing (`process_weights_` with TransformerLens's
        defaults) unless `no_processing`, centring the unembedding only where the logits are not soft-capped
        (as its bridge). Our hook names and aliases need no switching. Returns the model."""
        if no_processing:
            return self
        return self.process_weights_(center_unembed=self.cfg.output_logits_soft_cap is None)

    def set_use_attn_result(self, use_attn_result: bool) -> None:
        """TransformerLens's switch: `attn.hook_result` [batch, pos, head, d_model] always exists here and is
        computed while something hooks or caches it; with this on, every native layer computes it and calls it on
        every forward (so PyTorch module hooks and nnsight, which interp cannot see, read it: docs/interop.md)."""
        for module in self.modules():
            if hasattr(module, "use_attn_result"):
                module.use_attn_result = bool(use_attn_result)

    # ---- attention backend --------------------------------------------------------------------
    @property
    def attention_backend(self) -> BackendChoice:
        return self._backend

    @attention_backend.setter
    def attention_backend(self, backend: BackendChoice) -> None:
        self._set_backend(backend, None)

    def _set_backend(self, backend: str, layers: Sequence[int] | None) -> None:
        if backend not in BACKEND_CHOICES:
            raise ValueError(f"unknown attention backend {backend!r}; choose one of {BACKEND_CHOICES}")
        if layers is None:
            self._backend = backend
        for l in range(self.cfg.n_layers) if layers is None else layers:
            self.blocks[l].attn.backend = backend

    @contextlib.contextmanager
    def attention(self, backend: BackendChoice, layers: Sequence[int] | None = None) -> Iterator["HookedModel"]:
        """Force an attention backend (for `layers`, default all) inside a `with` block."""
        saved = self._backend, [b.attn.backend for b in self.blocks]
        self._set_backend(backend, layers)
        try:
            yield self
        finally:
            self._backend = saved[0]
            for b, old in zip(self.blocks, saved[1]):
                b.attn.backend = old

    # ---- input: the one path from what a caller gives to what the blocks read ----------------------
    def prepare(self, input, attention_mask: Tensor | None = None, *, prepend_bos: bool | None = None,
                padding_side: str | None = None, padding: bool = True) -> TokenBatch:
        """What forward, generate, the statistics and every analysis feed the model, decided here once:
        token ids [batch, pos] (checked against the vocabulary, on the model's device) from ids or text
        (BOS per `prepend_bos`, default the model's), and the real-token mask.

        Texts of different lengths are padded (`padding_side`, default the tokenizer's) and masked;
        with `padding=False` (a caller that takes no mask) they raise instead. A given `attention_mask`
        is checked against the tokens' shape."""
        if _is_text(input):
            tokens, valid = self._encode(input, prepend_bos, padding_side)
            if not bool(valid.all()):
                if not padding:
                    raise ValueError(
                        f"these {len(input)} texts tokenize to different lengths ({int(valid.sum(1).min())} to "
                        f"{valid.shape[1]} tokens) and this call takes no attention mask: pass texts of one length, "
                        "one text at a time, or token ids with attention_mask=model.to_text_mask(texts)")
                attention_mask = valid if attention_mask is None else attention_mask
        else:
            tokens = self._as_tokens(input)
        if attention_mask is not None:
            self._valid(attention_mask, *tokens.shape)  # the shape, said before any work
        return TokenBatch(tokens, attention_mask)

    def _as_tokens(self, tokens, prepend_bos: bool | None = None) -> Tensor:
        """Token ids [batch, pos] from ids or text (BOS per the model's default). Texts that would need
        padding raise: the caller has no attention mask to give (see `prepare`)."""
        if _is_text(tokens):
            return self.prepare(tokens, prepend_bos=prepend_bos, padding=False).tokens
        if not isinstance(tokens, Tensor):
            tokens = torch.as_tensor(tokens)
        if tokens.is_floating_point() or tokens.dtype == torch.bool:
            raise TypeError(
                f"tokens must be an integer tensor of token ids, got {tokens.dtype}; to feed residual-stream "
                "activations instead, pass start_at_layer=..."
            )
        if tokens.dim() == 1:
            tokens = tokens[None]
        if tokens.dim() != 2 or tokens.shape[1] == 0:
            raise ValueError(f"tokens must be [batch, pos] (or [pos]) with at least one position, got shape {tuple(tokens.shape)}")
        if tokens.numel() and (int(tokens.min()) < 0 or int(tokens.max()) >= self.cfg.d_vocab):
            bad = tokens[(tokens < 0) | (tokens >= self.cfg.d_vocab)]
            raise ValueError(
                f"token ids must lie in [0, {self.cfg.d_vocab}) for this model's vocabulary; got {bad.unique()[:5].tolist()}"
            )
        return tokens.to(device=self.device, dtype=torch.long)  # int8/16/32 ids index the embedding too

    def _valid(self, attention_mask: Tensor | None, batch: int, n: int) -> Tensor:
        if attention_mask is None:
            return torch.ones(batch, n, dtype=torch.bool, device=self.device)
        if tuple(attention_mask.shape) != (batch, n):
            raise ValueError(
                f"attention_mask must be [batch, pos] = {(batch, n)}, one entry per token of this call (with a "
                f"kv_cache: the new tokens only, the cache remembers earlier padding); got {tuple(attention_mask.shape)}"
            )
        return attention_mask.to(device=self.device, dtype=torch.bool)

    # ---- caches and statistics ---------------------------------------------------------------------
    def run_with_cache(
        self,
        *model_args,
        names_filter: NamesFilter = None,
        device=None,
        remove_batch_dim: bool = False,
        incl_bwd: bool = False,
        reset_hooks_end: bool = True,
        return_cache_object: bool = True,
        cache_type: Literal["interp", "transformer_lens"] = "interp",
        **model_kwargs,
    ):
        """Run the model and keep activations: returns (output, ActivationCache).

        cache_type="transformer_lens" returns TransformerLens's own ActivationCache instead (for its
        helpers: decompose_resid, logit_attrs, ...; needs transformer-lens installed).

        names_filter: None (every hook point: all layers go instrumented), a name, a list of names, or a
        predicate. Only layers whose attention scores/pattern are named leave the fused path.
        incl_bwd: also cache gradients (the output must be a scalar, e.g. return_type="loss")."""
        if cache_type not in ("interp", "transformer_lens"):
            raise ValueError(f"cache_type must be 'interp' or 'transformer_lens', got {cache_type!r}")
        names = self.resolve_hook_names(names_filter)
        store: dict[str, Tensor] = {}
        fwd = [(n, caching_hook(store, device=device)) for n in names]
        bwd = [(n, _grad_hook(store, device)) for n in names] if incl_bwd else []
        with self.hooks(fwd, bwd, reset_hooks_end=reset_hooks_end):
            out = self(*model_args, **model_kwargs)
            if incl_bwd:
                if not (isinstance(out, Tensor) and out.dim() == 0):
                    raise ValueError("incl_bwd=True differentiates the output, which must be a scalar: pass return_type='loss'")
                out.backward()
        store = {n: store[n] for n in sorted(store, key=self._hook_order().get)}
        cache = ActivationCache(store, self) if return_cache_object else store
        if remove_batch_dim and return_cache_object:
            cache = cache.remove_batch_dim()
        if cache_type == "transformer_lens" and return_cache_object:
            cache = to_tl_cache(cache)
        return out, cache

    def _hook_order(self) -> dict[str, int]:
        order = {n: i for i, n in enumerate(self.hook_dict)}
        order.update({f"{n}_grad": len(order) + i for i, n in enumerate(self.hook_dict)})
        return order

    def attention_stats(
        self, tokens=None, *, kv_cache=None, attention_mask: Tensor | None = None,
        layers: Sequence[int] | None = None, n_sink: int = 1, backend: str = "auto",
    ) -> dict:
        """Exact per-query head statistics of every layer without materialising a pattern:
        {layer: AttentionStats} with float32 [batch, head, pos] fields sink, previous, duplicate,
        induction, entropy, max, distance (see `interp.kernels.attention_stats`).

        From `tokens`: one fused forward that hands each layer's q/k (as attention receives them) to the
        streaming kernel as the layer is computed, then drops them. From `kv_cache` (native models; made
        with capture_queries=True): after a forward or a generation, without re-running the model.
        `interp.models.readouts.head_statistics.stats_frame` turns the result into a tidy table."""
        if (tokens is None) == (kv_cache is None):
            raise ValueError("give exactly one of tokens or kv_cache=...")
        if kv_cache is not None:
            self.require_native("statistics from an interp KV cache")
            return kv_cache_attention_stats(self, kv_cache, layers=layers, n_sink=n_sink, backend=backend)
        return model_attention_stats(self, tokens, attention_mask=attention_mask, layers=layers, n_sink=n_sink, backend=backend)

    def loss_fn(self, logits: Tensor, tokens: Tensor, attention_mask: Tensor | None = None,
                per_token: bool = False) -> Tensor:
        """Next-token cross-entropy of `logits` on `tokens` (TransformerLens's `loss_fn`): the mean over
        positions whose token and next token are real (per `attention_mask`), or [batch, pos - 1]."""
        valid = None if attention_mask is None else attention_mask.to(logits.device).bool()
        return lm_loss(logits, torch.as_tensor(tokens), valid, per_token=per_token)


def _grad_hook(store: dict, device):
    def hook(grad: Tensor, hook: HookPoint) -> None:
        store[f"{hook.name}_grad"] = grad.detach() if device is None else grad.detach().to(device)

    return hook


# ---- the language-model loss every model reports ------------------------------------------------------------
def lm_loss(logits: Tensor, tokens: Tensor, valid: Tensor | None = None, per_token: bool = False) -> Tensor:
    """Next-token cross-entropy: logits at position i predict tokens[i + 1].

    Averaged over the pairs where both positions are real tokens; per_token=True returns
    [batch, pos - 1] (zeros at masked pairs)."""
    return masked_nll(_nll(logits[:, :-1], tokens[:, 1:]), valid, per_token)


def _nll(logits: Tensor, targets: Tensor) -> Tensor:
    logprobs = F.log_softmax(logits.float(), dim=-1)
    return -logprobs.gather(-1, targets[..., None].to(logits.device))[..., 0]


def masked_nll(nll: Tensor, valid: Tensor | None, per_token: bool) -> Tensor:
    """The loss of `lm_loss` from per-pair NLL [batch, pos - 1]: its mean over pairs of real tokens, or
    per pair (zeros at masked pairs)."""
    if valid is None:
        return nll if per_token else nll.mean()
    pair = (valid[:, :-1] & valid[:, 1:]).to(nll.dtype)
    nll = nll * pair
    return nll if per_token else nll.sum() / pair.sum().clamp(min=1)
