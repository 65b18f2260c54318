"""The hookable transformer: blocks, the model, and its forward pass.

Attention in every layer runs fused (SDPA) unless something asks for that layer's scores or
pattern (a hook, or a `run_with_cache` whose filter names them); only those layers go through the
instrumented path. `with model.attention("instrumented"):` or `model.attention_backend = ...`
forces a backend for all (or some) layers.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator, Literal, Sequence

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import Tensor, nn

from .cache import ActivationCache, to_tl_cache
from .kv.cache import KVCache
from .kv.policy_cache import PolicyKVCache
from .kv.policies import is_window, window_policy
from .hooks import HookedRootModule, HookPoint, NamesFilter, caching_hook
from interp.kernels.attention import BACKEND_CHOICES, AttentionMask

from .attention import Attention, BackendChoice
from .components import (
    Embed,
    PosEmbed,
    SinusoidalPosEmbed,
    TiedUnembed,
    Unembed,
    init_weights,
    make_norm,
)
from .config import ModelConfig, RopeScaling
from interp.errors import BadValue, UserError
from .generate import generate as _generate
from .positions import Rotary
from .moe import make_mlp
from .processing import process_weights
from .runtime import Runtime
from .stats import kv_cache_attention_stats, model_attention_stats
from .tensor_files import save_model
from .text import TextMixin, _is_text
from .weights import WeightViews

ReturnType = Literal["logits", "loss", "both", None]



@dataclass(frozen=True)
class TokenBatch:
    """Token ids [batch, pos] on the model's device and their attention mask (1 / True for real tokens;
    None: every position is real), as `HookedTransformer.prepare` builds them for every entry point."""

    tokens: Tensor
    attention_mask: Tensor | None = None

    @property
    def valid(self) -> Tensor:
        """bool [batch, pos]: True for real tokens."""
        if self.attention_mask is None:
            return torch.ones(self.tokens.shape, dtype=torch.bool, device=self.tokens.device)
        return self.attention_mask.to(device=self.tokens.device, dtype=torch.bool)

class TransformerBlock(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.hook_resid_pre = HookPoint()  # declared first: hook_dict follows the order of computation
        # Without pre_norms (OLMo 2) attention and MLP read the stream as it is: ln1 / ln2 are identities.
        pre_norm = make_norm if cfg.pre_norms else lambda cfg: nn.Identity()
        self.ln1 = pre_norm(cfg)
        self.attn = Attention(cfg, layer)
        # Sandwich norms (Gemma 2 / 3): ln1_post and ln2_post normalise the attention and MLP outputs before
        # they join the residual stream; hook_attn_out and hook_mlp_out read them after these norms, as
        # TransformerLens's (its names ln1_post / ln2_post).
        self.ln1_post = make_norm(cfg) if cfg.sandwich_norms else None
        self.mlp = make_mlp(cfg)
        self.ln2 = pre_norm(cfg) if self.mlp is not None else None
        self.ln2_post = make_norm(cfg) if cfg.sandwich_norms and self.mlp is not None else None
        self.parallel = cfg.parallel_attn_mlp and self.mlp is not None
        self.hook_attn_out = HookPoint()
        if self.mlp is not None:
            self.hook_mlp_out = HookPoint()
            if not self.parallel:
                self.hook_resid_mid = HookPoint()
        self.hook_resid_post = HookPoint()

    def forward(self, resid: Tensor, mask: AttentionMask, rope=None, kv_cache: KVCache | None = None) -> Tensor:
        resid = self.hook_resid_pre(resid)
        if self.split_input is None:
            return self.after_attention(resid, self.attn(self.ln1(resid), mask, rope, kv_cache))
        return self.after_attention(resid, self.attn(None, mask, rope, kv_cache, per_head=self._per_head_inputs(resid)))

    # ---- TransformerLens's optional hook points (off: the fused path above is untouched) ----------
    split_input: str | None = None  # None, "qkv" (hook_q_input / k / v) or "attn_in" (hook_attn_in)
    mlp_in: bool = False  # hook_mlp_in

    def set_split_input(self, kind: str | None) -> None:
        for name in ("hook_q_input", "hook_k_input", "hook_v_input", "hook_attn_in"):
            if name in self._modules:
                del self._modules[name]
        self.split_input = kind
        if kind == "qkv":
            self.hook_q_input, self.hook_k_input, self.hook_v_input = HookPoint(), HookPoint(), HookPoint()
        elif kind == "attn_in":
            self.hook_attn_in = HookPoint()

    def set_mlp_in(self, on: bool) -> None:
        if "hook_mlp_in" in self._modules:
            del self._modules["hook_mlp_in"]
        self.mlp_in = bool(on) and self.mlp is not None
        if self.mlp_in:
            self.hook_mlp_in = HookPoint()

    def _per_head_inputs(self, resid: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """The residual stream copied once per head (TransformerLens's hook_q_input / k / v, or one
        hook_attn_in whose first kv_head copies feed keys and values), each normalised by ln1."""
        b, p, d = resid.shape
        h, kv = self.attn.n_heads, self.attn.n_kv_heads
        if self.split_input == "qkv":
            xq = self.hook_q_input(resid[:, :, None].expand(b, p, h, d).clone())
            xk = self.hook_k_input(resid[:, :, None].expand(b, p, kv, d).clone())
            xv = self.hook_v_input(resid[:, :, None].expand(b, p, kv, d).clone())
            return self.ln1(xq), self.ln1(xk), self.ln1(xv)
        x = self.ln1(self.hook_attn_in(resid[:, :, None].expand(b, p, h, d).clone()))
        return x, x[:, :, :kv], x[:, :, :kv]

    def after_attention(self, resid: Tensor, attn_out: Tensor) -> Tensor:
        """The rest of the block, given resid_pre and the attention layer's output: -> resid_post.

        `attn_out` is what `self.attn` returns (the sum over heads of z W_O, plus b_O): `hook_attn_out`
        in a block without sandwich norms, the input of `ln1_post` in one with them. Lets an analysis
        that changes only the attention output resume mid-block (the head-ablation sweep adds one head's
        change of output to the attention output instead of re-running attention)."""
        if self.ln1_post is not None:
            attn_out = self.ln1_post(attn_out)
        attn_out = self.hook_attn_out(attn_out)
        if self.mlp is None:
            return self.hook_resid_post(resid + attn_out)
        if self.parallel:
            mlp_in = self.hook_mlp_in(resid.clone()) if self.mlp_in else resid
            return self.hook_resid_post(resid + attn_out + self._mlp_out(mlp_in))
        mid = self.hook_resid_mid(resid + attn_out)
        mlp_in = self.hook_mlp_in(mid.clone()) if self.mlp_in else mid
        return self.hook_resid_post(mid + self._mlp_out(mlp_in))

    def _mlp_out(self, mlp_in: Tensor) -> Tensor:
        out = self.mlp(self.ln2(mlp_in))
        return self.hook_mlp_out(out if self.ln2_post is None else self.ln2_post(out))


class HookedTransformer(WeightViews, TextMixin, HookedRootModule):
    """A decoder-only transformer with TransformerLens hook names and two attention paths.

    Build from a config (`HookedTransformer(cfg)`, random init), or load one: `interp.load(path)`,
    `interp.from_hf(hf_model)`.
    """

    native = True  # interp's own implementation (a `WrappedModel` is transformers' model with our hooks)

    def __init__(self, cfg: ModelConfig, *, seed: int | None = 0, tokenizer=None) -> None:
        super().__init__()
        self.cfg = cfg
        # What the model holds besides its shape and weights (name, tokenizer, text defaults, hook
        # switches, processing), in one visible place; `cfg` presents TransformerLens's view of it.
        self.runtime = Runtime(tokenizer=tokenizer)
        self.embed = Embed(cfg)
        # Bloom's norm of the token embeddings (TransformerLens's `embed_ln`); hook_embed reads its output.
        self.embed_ln = make_norm(cfg) if cfg.post_embedding_ln else None
        self.hook_embed = HookPoint()
        self.pos_embed = {"learned": PosEmbed, "sinusoidal": SinusoidalPosEmbed}.get(cfg.positional, lambda c: None)(cfg)
        if self.pos_embed is not None:
            self.hook_pos_embed = HookPoint()
        self.rotary = Rotary(cfg) if cfg.positional == "rotary" else None
        self.blocks = nn.ModuleList(TransformerBlock(cfg, l) for l in range(cfg.n_layers))
        self.ln_final = make_norm(cfg)
        self.unembed = TiedUnembed(cfg, self.embed) if cfg.tie_embeddings else Unembed(cfg)
        self._backend: BackendChoice = "auto"
        if seed is not None:  # seed=None: leave the weights uninitialised (a loader fills them)
            init_weights(self, cfg, torch.Generator().manual_seed(seed))
        self.setup_hooks()
        self._refresh_view()  # cfg.device / cfg.dtype / cfg.default_prepend_bos, read by TransformerLens

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

    def _refresh_view(self) -> None:
        """Give the config the view of this model as it is now (device, dtype, `runtime`): TransformerLens
        reads them off `model.cfg`. Called by every change of either."""
        if "embed" not in self._modules or "runtime" not in self.__dict__:
            return  # still being built
        self.cfg = self.cfg.with_view(self.runtime.view(self.cfg, self.device, self.dtype))

    @property
    def tokenizer(self):
        """The tokenizer text goes through (any Hugging Face tokenizer, or the zoo's byte tokenizer)."""
        return self.runtime.tokenizer

    @tokenizer.setter
    def tokenizer(self, tok) -> None:
        self.runtime.tokenizer = tok
        self._refresh_view()  # default_prepend_bos follows the tokenizer's BOS

    def loaded_as(self, name: str | None, *, default_prepend_bos: bool | None = None) -> "HookedTransformer":
        """Record what this model was loaded as (`cfg.model_name`) and, unless None, override whether text
        gets BOS first by default (`cfg.default_prepend_bos`). Returns the model."""
        self.runtime.name = name
        if default_prepend_bos is not None:
            self.runtime.prepend_bos = bool(default_prepend_bos)
        self._refresh_view()
        return self

    @property
    def device(self) -> torch.device:
        return self.embed.W_E.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.W_E.dtype

    def _apply(self, fn, *args, **kwargs):
        # Every move or cast (.to, .cuda, .half, to_empty) goes through here: keep cfg.device/.dtype true.
        out = super()._apply(fn, *args, **kwargs)
        self._refresh_view()
        return out

    def rescale_rope_(self, scaling: RopeScaling | None) -> "HookedTransformer":
        """Run the rotary positions with `scaling` from now on (None: plain RoPE), in place of the config's
        own, and say so (`runtime.rope_chosen`). `interp.load(..., rope_scaling=)` is the checked way, from
        any spelling and before the weights load (`interp.models.rope.choice`). Returns the model."""
        if not self.native:
            raise UserError("rope scaling at inference is interp's own transformer's; this model is wrapped "
                            "(transformers runs it): set rope_parameters in its config instead")
        if self.rotary is None:
            raise BadValue(f"rope scaling rescales rotary positions; this model's are {self.cfg.positional or 'none'}")
        self.cfg = self.cfg.replace(rope_scaling=scaling)  # checked by ModelConfig
        self.rotary = Rotary(self.cfg).to(self.device)  # frequencies in float32, as built
        self.runtime.rope_chosen = True
        self._refresh_view()
        return self

    # ---- weight processing ----------------------------------------------------------------------
    def process_weights_(
        self, fold_ln: bool = True, center_writing_weights: bool = True, center_unembed: bool = True,
        fold_value_biases: bool = True, refactor_factored_attn_matrices: bool = False,
    ) -> "HookedTransformer":
        """Process the weights in place as TransformerLens does (its defaults), keeping log-probs.

        fold_ln: norm weights (and LayerNorm biases) into the matrices that read them; the norms then
        only normalise. center_writing_weights (LayerNorm models): writes to the residual stream lose
        their mean. center_unembed: W_U loses its mean over the vocabulary. fold_value_biases: b_V into
        b_O. refactor_factored_attn_matrices: balanced SVD factors of W_Q W_K^T and W_V W_O (not for
        rotary / ALiBi / GQA). See `interp.models.processing`. Returns the model."""
        steps = dict(fold_ln=fold_ln, center_writing_weights=center_writing_weights, center_unembed=center_unembed,
                     fold_value_biases=fold_value_biases, refactor_factored_attn_matrices=refactor_factored_attn_matrices)
        process_weights(self, **steps)
        done = self.runtime.processing
        self.runtime.processing = {k: bool(done.get(k) or v) for k, v in steps.items()}
        self._refresh_view()
        return self

    def enable_compatibility_mode(self, disable_warnings: bool = False, no_processing: bool = False,
                                  **_ignored) -> "HookedTransformer":
        """TransformerLens 4's `TransformerBridge.enable_compatibility_mode`, so its tutorials run with
        only the model line changed: its weight processing (`process_weights_` with TransformerLens's
        defaults) unless `no_processing`, centring the unembedding only where the logits are not soft-capped
        (as its bridge). Our hook names and aliases need no switching. Returns the model."""
        if no_processing:
            return self
        return self.process_weights_(center_unembed=self.cfg.output_logits_soft_cap is None)

    # ---- TransformerLens's optional hook points ---------------------------------------------------
    def set_use_split_qkv_input(self, use_split_qkv_input: bool) -> None:
        """Add (True) or remove `blocks.L.hook_q_input` [batch, pos, head, d_model] and `hook_k_input` /
        `hook_v_input` [batch, pos, kv_head, d_model]: the residual stream copied per head before ln1,
        so one head's query (or one KV head's key / value) input can be patched alone. Off (the
        default), the fused attention path is untouched."""
        if use_split_qkv_input and self.runtime.hook_flags["use_attn_in"]:
            raise ValueError("use_split_qkv_input and use_attn_in are mutually exclusive (as in TransformerLens): "
                             "call model.set_use_attn_in(False) first")
        self._set_hook_flag("use_split_qkv_input", use_split_qkv_input,
                            lambda b, on: b.set_split_input("qkv" if on else None))

    def set_use_attn_in(self, use_attn_in: bool) -> None:
        """Add (True) or remove `blocks.L.hook_attn_in` [batch, pos, head, d_model]: one per-head copy of
        the residual stream feeding queries, keys and values (keys and values read the first kv_head
        copies under GQA, as TransformerLens's bridge does)."""
        if use_attn_in and self.runtime.hook_flags["use_split_qkv_input"]:
            raise ValueError("use_attn_in and use_split_qkv_input are mutually exclusive (as in TransformerLens): "
                             "call model.set_use_split_qkv_input(False) first")
        self._set_hook_flag("use_attn_in", use_attn_in, lambda b, on: b.set_split_input("attn_in" if on else None))

    def set_use_hook_mlp_in(self, use_hook_mlp_in: bool) -> None:
        """Add (True) or remove `blocks.L.hook_mlp_in` [batch, pos, d_model]: the MLP's input before ln2."""
        if use_hook_mlp_in and self.cfg.attn_only:
            raise ValueError("this model is attention-only: it has no MLP, so no hook_mlp_in")
        self._set_hook_flag("use_hook_mlp_in", use_hook_mlp_in, lambda b, on: b.set_mlp_in(on))

    def set_use_attn_result(self, use_attn_result: bool) -> None:
        """Accepted for TransformerLens code: `attn.hook_result` [batch, pos, head, d_model] always exists
        here and is computed only while something hooks or caches it."""

    def _set_hook_flag(self, flag: str, on: bool, apply) -> None:
        on = bool(on)
        if self.runtime.hook_flags[flag] == on:
            return
        for block in self.blocks:
            apply(block, on)
        self.runtime.hook_flags[flag] = on
        self.setup_hooks()
        self._refresh_view()

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
    def attention(self, backend: BackendChoice, layers: Sequence[int] | None = None) -> Iterator["HookedTransformer"]:
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
                padding_side: str | None = None, padding: bool = True) -> "TokenBatch":
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

    def _positions(self, valid: Tensor, kv_cache: KVCache | None) -> Tensor:
        """Position ids [batch, pos]: real tokens count 0, 1, 2, ... per row (left padding is skipped)."""
        start = kv_cache.n_seen[:, None] if kv_cache is not None else 0
        pos = (valid.long().cumsum(1) - 1).clamp(min=0) + start
        if self.cfg.positional in ("learned", "sinusoidal") and pos.numel() and int(pos.max()) >= self.cfg.n_ctx:
            raise ValueError(
                f"sequence too long: positions reach {int(pos.max())} but this model's {self.cfg.positional} position "
                f"embeddings cover n_ctx={self.cfg.n_ctx} tokens; truncate the input (e.g. tokens[:, -{self.cfg.n_ctx}:])"
            )
        return pos

    # ---- forward ------------------------------------------------------------------------------
    def forward(
        self,
        input,
        return_type: ReturnType = "logits",
        *,
        attention_mask: Tensor | None = None,
        kv_cache: KVCache | None = None,
        loss_per_token: bool = False,
        start_at_layer: int | None = None,
        stop_at_layer: int | None = None,
        tokens: Tensor | None = None,
        prepend_bos: bool | None = None,
        padding_side: str | None = None,
    ):
        """Run the model.

        input          token ids [batch, pos] (or [pos], or text when a tokenizer is attached), or the
                       residual stream [batch, pos, d_model] with `start_at_layer`.
        attention_mask [batch, pos], 1 for real tokens, 0 for padding (left or right). Positions
                       count real tokens only, so left-padded rows get the positions they would alone.
        kv_cache       a `KVCache`: this call's keys/values are appended and the queries attend to
                       everything cached; returns logits for the new tokens only.
        return_type    "logits" [batch, pos, vocab], "loss" (mean next-token cross-entropy over
                       real tokens), "both", or None.
        start_at_layer / stop_at_layer: run blocks [start, stop) only; with stop_at_layer the
                       residual stream before block `stop` is returned.
        tokens         the token ids, when `input` is a residual stream and a loss is wanted.
        prepend_bos / padding_side: for text input, as `to_tokens` (default: BOS when the model's
                       `cfg.default_prepend_bos`); texts of different lengths get an attention mask.
        """
        if start_at_layer is None:
            prepared = self.prepare(input, attention_mask, prepend_bos=prepend_bos, padding_side=padding_side)
            tokens, attention_mask = prepared.tokens, prepared.attention_mask
            batch, n = tokens.shape
        else:
            if not (isinstance(input, Tensor) and input.is_floating_point() and input.dim() == 3):
                raise TypeError("with start_at_layer, input must be the residual stream [batch, pos, d_model]")
            batch, n = input.shape[:2]
            tokens = None if tokens is None else self._as_tokens(tokens)
        valid = self._valid(attention_mask, batch, n)
        if kv_cache is not None:
            kv_cache.reserve(n, batch)
        positions = self._positions(valid, kv_cache)
        past = kv_cache.length if kv_cache is not None else 0
        key_valid = None
        if attention_mask is not None or (kv_cache is not None and not bool(kv_cache.valid().all())):
            key_valid = valid if kv_cache is None else torch.cat([kv_cache.valid(), valid], dim=1)
        mask = AttentionMask(n_q=n, n_k=past + n, key_valid=key_valid, n_sink=kv_cache.n_sink if kv_cache is not None else 0)

        if start_at_layer is None:
            resid = self.embed(tokens)
            resid = self.hook_embed(resid if self.embed_ln is None else self.embed_ln(resid))
            if self.pos_embed is not None:
                resid = resid + self.hook_pos_embed(self.pos_embed(positions))
        else:
            resid = input
        # cos/sin per layer: one table for most models, a second for Gemma 3's local layers
        ropes = self.rotary.per_layer(positions, resid.dtype) if self.rotary is not None else None
        for block in self.blocks[start_at_layer:stop_at_layer]:
            resid = block(resid, mask, ropes[block.layer] if ropes is not None else None, kv_cache)
        if kv_cache is not None:
            kv_cache.commit(tokens, valid)
        if stop_at_layer is not None:
            return resid
        if return_type is None:
            return None
        if return_type != "logits" and tokens is None:
            raise ValueError("a loss needs the token ids: pass tokens=... along with a residual-stream input")
        if return_type == "loss":  # no [batch, pos, vocab] tensor (2.5 GiB at Gemma's 262k vocabulary x 2,560 tokens)
            return masked_nll(unembed_nll(self.unembed, self.ln_final(resid), tokens), valid, loss_per_token)
        logits = self.unembed(self.ln_final(resid))
        if return_type == "logits":
            return logits
        loss = lm_loss(logits, tokens, valid, per_token=loss_per_token)
        return loss if return_type == "loss" else (logits, loss)

    def _valid(self, attention_mask: Tensor | None, batch: int, n: int) -> Tensor:
        if attention_mask is None:
            return torch.ones(batch, n, dtype=torch.bool, device=self.device)
        if tuple(attention_mask.shape) != (batch, n):
            raise ValueError(
                f"attention_mask must be [batch, pos] = {(batch, n)}, one entry per token of this call (with a "
                f"kv_cache: the new tokens only, the cache remembers earlier padding); got {tuple(attention_mask.shape)}"
            )
        return attention_mask.to(device=self.device, dtype=torch.bool)

    # ---- caches -------------------------------------------------------------------------------
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

    def new_kv_cache(
        self, batch_size: int, max_len: int | None = None, capture_queries: bool = False, n_sink: int = 0,
        precision=None, default: str | None = None, policy=None,
    ) -> KVCache:
        """A preallocated KV cache for `max_len` tokens (default n_ctx), in the model's dtype and device.

        n_sink > 0 keeps the first n_sink keys visible past sliding windows (StreamingLLM).
        precision: None (the model's dtype, unquantized), a name ("int8", "fp8", "int4", "fp16", "bf16",
        "fp32") for every KV head, or a {(layer, kv_head): name} map with `default` (fp32) for the rest: a
        spelling of `policy=` (a precision is a policy that keeps every token in it).
        policy: what each KV head keeps ("full", "kivi4", "streaming(4,128)", "h2o(256)", "snapkv(256)",
        "knorm(256)", "tova(256)", a precision, a `Policy`, or a {layer: ..., (layer, kv_head): ...} map with
        `default`, "full", for the rest): a `PolicyKVCache` (`interp.models.kv.policy_cache`; policies in
        `interp.models.kv.policies`). policy="window": each layer holds what it can see: a layer with a sliding
        window (Gemma's local layers, Mistral) a rolling buffer of its last `window` positions, the others
        every token."""
        cfg = self.cfg
        args = (cfg.n_layers, batch_size, max_len or cfg.n_ctx, cfg.kv_heads, cfg.head_dim)
        kwargs = dict(n_heads=cfg.n_heads, capture_queries=capture_queries, dtype=self.dtype, device=self.device,
                      n_sink=n_sink)
        if precision is not None and policy is not None:
            raise ValueError("give precision= (a quantized cache) or policy= (per-head policies, precisions "
                             "included), not both")
        if precision is None and policy is None:
            return KVCache(*args, **kwargs)
        if is_window(policy):
            policy = self.window_policy(args[2])
        cache = PolicyKVCache(*args, policy=policy if policy is not None else precision,
                              default=default or ("fp32" if policy is None else "full"), **kwargs)
        if self.cfg.positional == "alibi" and not all(p.holds_all for row in cache.policies for p in row):
            raise ValueError("per-head cache policies that drop tokens mask by cache slot and do not carry ALiBi's "
                             "distances; this model uses ALiBi (precisions and KIVI work)")
        if self.cfg.attn_scores_soft_cap is not None and any(p.reads_queries for row in cache.policies for p in row):
            raise ValueError("cache policies that choose by attention (H2O, SnapKV, TOVA) score keys without soft-capping; "
                             "this model soft-caps its attention scores (precisions, KIVI, streaming and KNorm work)")
        return cache

    def window_policy(self, max_len: int) -> dict:
        """{layer: streaming(0, window)} for every layer whose own window is shorter than `max_len`: the
        cache policy that holds exactly what each layer can see (`new_kv_cache(policy="window")`)."""
        return window_policy(self.cfg.windows(), max_len)

    def attention_stats(
        self, tokens=None, *, kv_cache: KVCache | None = None, attention_mask: Tensor | None = None,
        layers: Sequence[int] | None = None, n_sink: int = 1, backend: str = "auto",
    ) -> dict:
        """Exact per-query head statistics of every layer without materialising a pattern:
        {layer: AttentionStats} with float32 [batch, head, pos] fields sink, previous, duplicate,
        induction, entropy, max, distance (see `interp.kernels.attention_stats`).

        From `tokens`: one fused forward that hands each layer's rotated q/k to the streaming kernel
        as the layer is computed, then drops them. From `kv_cache` (made with capture_queries=True):
        after a forward or a generation, without re-running the model. `interp.models.stats.stats_frame`
        turns the result into a tidy table."""
        if (tokens is None) == (kv_cache is None):
            raise ValueError("give exactly one of tokens or kv_cache=...")
        if kv_cache is not None:
            return kv_cache_attention_stats(self, kv_cache, layers=layers, n_sink=n_sink, backend=backend)
        return model_attention_stats(self, tokens, attention_mask=attention_mask, layers=layers, n_sink=n_sink, backend=backend)

    def generate(self, tokens, max_new_tokens: int = 20, **kwargs) -> Tensor:
        """Greedy or sampled continuation through a KV cache; see `interp.models.generate.generate`."""
        return _generate(self, tokens, max_new_tokens, **kwargs)

    def loss_fn(self, logits: Tensor, tokens: Tensor, attention_mask: Tensor | None = None,
                per_token: bool = False) -> Tensor:
        """Next-token cross-entropy of `logits` on `tokens` (TransformerLens's `loss_fn`): the mean over
        positions whose token and next token are real (per `attention_mask`), or [batch, pos - 1]."""
        valid = None if attention_mask is None else attention_mask.to(logits.device).bool()
        return lm_loss(logits, torch.as_tensor(tokens), valid, per_token=per_token)

    # ---- saving -------------------------------------------------------------------------------
    def save(self, path) -> None:
        """Write `config.json` + `model.safetensors` (our format; `interp.load(path)` reads it back)."""
        save_model(self, path)

    def __repr__(self) -> str:
        c = self.cfg
        kind = "MHA" if c.kv_heads == c.n_heads else ("MQA" if c.kv_heads == 1 else f"GQA({c.kv_heads} kv)")
        return (
            f"HookedTransformer({c.model_type}: {c.n_layers} layers, d_model={c.d_model}, {c.n_heads} heads {kind}, "
            f"{'attn-only' if c.attn_only else f'd_mlp={c.d_mlp}'}, {c.positional} positions, "
            f"{c.n_params() / 1e6:.2f}M params, attention={self._backend})"
        )


def _grad_hook(store: dict, device):
    def hook(grad: Tensor, hook: HookPoint) -> None:
        store[f"{hook.name}_grad"] = grad.detach() if device is None else grad.detach().to(device)

    return hook


def lm_loss(logits: Tensor, tokens: Tensor, valid: Tensor | None = None, per_token: bool = False) -> Tensor:
    """Next-token cross-entropy: logits at position i predict tokens[i + 1].

    Averaged over the pairs where both positions are real tokens; per_token=True returns
    [batch, pos - 1] (zeros at masked pairs)."""
    return masked_nll(_nll(logits[:, :-1], tokens[:, 1:]), valid, per_token)


def _nll(logits: Tensor, targets: Tensor) -> Tensor:
    logprobs = F.log_softmax(logits.float(), dim=-1)
    return -logprobs.gather(-1, targets[..., None].to(logits.device))[..., 0]


# `unembed_nll`: logits a slab of 2^27 floats (512 MiB) at a time; under autograd the whole logits
# up to 2^29 floats (2 GiB), past that checkpointed slabs (each slab's logits recomputed in backward:
# +40% time on Gemma's importance gradients, so only where memory asks for it).
_NLL_SLAB = 1 << 27
_NLL_GRAD_WHOLE = 1 << 29


def unembed_nll(unembed: nn.Module, normalized: Tensor, tokens: Tensor) -> Tensor:
    """[batch, pos - 1] next-token NLL from the final normalized residual, the logits made a slab of
    rows at a time, so no [batch, pos, vocab] tensor exists (the same numbers as `lm_loss` on the full
    logits: each row's log-softmax is the same computation). Under autograd the slabs are
    checkpointed (their logits recomputed in the backward pass instead of kept) when the whole logits
    would pass `_NLL_GRAD_WHOLE` floats; below that they are made at once, which is faster."""
    b, n, d = normalized.shape
    vocab = unembed.W_U.shape[-1]
    grad = torch.is_grad_enabled() and (normalized.requires_grad or any(p.requires_grad for p in unembed.parameters()))
    step = max(1, _NLL_SLAB // vocab)
    if b * (n - 1) <= step or (grad and b * (n - 1) * vocab <= _NLL_GRAD_WHOLE):
        # exactly lm_loss's computation (same matmul shapes: training stays bitwise reproducible)
        return _nll(unembed(normalized)[:, :-1], tokens[:, 1:])
    rows, targets = normalized[:, :-1].reshape(-1, d), tokens[:, 1:].reshape(-1)
    parts = []
    for i in range(0, rows.shape[0], step):
        r, t = rows[i:i + step], targets[i:i + step]
        if grad:
            parts.append(torch.utils.checkpoint.checkpoint(lambda r, t: _nll(unembed(r), t), r, t, use_reentrant=False))
        else:
            parts.append(_nll(unembed(r), t))
    return torch.cat(parts).view(b, n - 1)


def masked_nll(nll: Tensor, valid: Tensor | None, per_token: bool) -> Tensor:
    """The loss of `lm_loss` from per-pair NLL [batch, pos - 1]: its mean over pairs of real tokens, or
    per pair (zeros at masked pairs)."""
    if valid is None:
        return nll if per_token else nll.mean()
    pair = (valid[:, :-1] & valid[:, 1:]).to(nll.dtype)
    nll = nll * pair
    return nll if per_token else nll.sum() / pair.sum().clamp(min=1)
