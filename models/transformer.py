"""The hookable transformer: blocks, the model, and its forward pass.

Attention in every layer runs fused (SDPA) unless something asks for that layer's scores or
pattern (a hook, or a `run_with_cache` whose filter names them); only those layers go through the
instrumented path. `with model.attention("instrumented"):` or `model.attention_backend = ...`
forces a backend for all (or some) layers.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Literal, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .cache import ActivationCache, KVCache
from .hooks import HookedRootModule, HookPoint, NamesFilter, caching_hook
from interp.kernels.attention import AttentionMask

from .attention import BACKEND_CHOICES, Attention, BackendChoice
from .components import (
    Embed,
    PosEmbed,
    SinusoidalPosEmbed,
    TiedUnembed,
    Unembed,
    init_weights,
    make_mlp,
    make_norm,
)
from .config import ModelConfig
from .positions import Rotary

ReturnType = Literal["logits", "loss", "both", None]


class TransformerBlock(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.hook_resid_pre = HookPoint()  # declared first: hook_dict follows the order of computation
        self.ln1 = make_norm(cfg)
        self.attn = Attention(cfg, layer)
        self.mlp = make_mlp(cfg)
        self.ln2 = make_norm(cfg) if self.mlp is not None else None
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

    def hook_point_aliases(self) -> dict[str, str]:
        """The bridge's names for the split-input hook points (`attn.hook_q_input`, ...)."""
        names = {"qkv": ("hook_q_input", "hook_k_input", "hook_v_input"), "attn_in": ("hook_attn_in",)}
        return {f"attn.{n}": n for n in names.get(self.split_input, ())}

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
        """The rest of the block, given resid_pre and the attention output: -> resid_post.

        Lets an analysis that changes only the attention output resume mid-block (the head-ablation
        sweep adds one head's change of output to a cached attn_out instead of re-running attention)."""
        attn_out = self.hook_attn_out(attn_out)
        if self.mlp is None:
            return self.hook_resid_post(resid + attn_out)
        if self.parallel:
            mlp_in = self.hook_mlp_in(resid.clone()) if self.mlp_in else resid
            mlp_out = self.hook_mlp_out(self.mlp(self.ln2(mlp_in)))
            return self.hook_resid_post(resid + attn_out + mlp_out)
        mid = self.hook_resid_mid(resid + attn_out)
        mlp_in = self.hook_mlp_in(mid.clone()) if self.mlp_in else mid
        return self.hook_resid_post(mid + self.hook_mlp_out(self.mlp(self.ln2(mlp_in))))


class HookedTransformer(HookedRootModule):
    """A decoder-only transformer with TransformerLens hook names and two attention paths.

    Build from a config (`HookedTransformer(cfg)`, random init), or load one: `interp.load(path)`,
    `interp.from_hf(hf_model)`.
    """

    def __init__(self, cfg: ModelConfig, *, seed: int | None = 0, tokenizer=None) -> None:
        super().__init__()
        self.cfg = cfg
        self._hook_flags = dict(use_split_qkv_input=False, use_attn_in=False, use_hook_mlp_in=False)
        self._processing: dict[str, bool] = {}  # the weight-processing steps applied (process_weights_)
        self._model_name: str | None = None  # what it was loaded as (interp.load / from_hf): cfg.model_name
        self.tokenizer = tokenizer
        self.embed = Embed(cfg)
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
        self._attach()  # cfg.device / cfg.dtype / cfg.default_prepend_bos, read by TransformerLens

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

    def _attach(self) -> None:
        """Re-attach the config to what this model is now: device, dtype, tokenizer, hook switches."""
        if "embed" not in self._modules:
            return  # still being built
        names = dict(model_name=self.__dict__.get("_model_name"),
                     tokenizer_name=getattr(self.tokenizer, "name_or_path", None) or None,
                     default_padding_side=getattr(self.tokenizer, "padding_side", None))
        self.cfg = self.cfg.attached(self.device, self.dtype, default_prepend_bos=self._bos_default(), **names,
                                     **self._hook_flags, **{f"processed_{k}": v for k, v in self._processing.items()})

    @property
    def tokenizer(self):
        """The tokenizer text goes through (any Hugging Face tokenizer, or the zoo's byte tokenizer)."""
        return self.__dict__.get("_tokenizer")

    @tokenizer.setter
    def tokenizer(self, tok) -> None:
        self.__dict__["_tokenizer"] = tok
        self._attach()  # default_prepend_bos follows the tokenizer's BOS

    # ---- weights, TransformerLens names -------------------------------------------------------
    @property
    def W_E(self) -> Tensor:
        return self.embed.W_E

    @property
    def W_U(self) -> Tensor:
        return self.unembed.W_U

    @property
    def W_pos(self) -> Tensor:
        if self.pos_embed is None:
            raise AttributeError(f"this model has {self.cfg.positional!r} positions, so no W_pos")
        return self.pos_embed.W_pos

    def _stack(self, attr: str) -> Tensor:
        return torch.stack([getattr(b.attn, attr) for b in self.blocks])

    W_Q = property(lambda self: self._stack("W_Q"), doc="[layer, head, d_model, d_head]")
    W_K = property(lambda self: self._stack("W_K"), doc="[layer, kv_head, d_model, d_head]")
    W_V = property(lambda self: self._stack("W_V"), doc="[layer, kv_head, d_model, d_head]")
    W_O = property(lambda self: self._stack("W_O"), doc="[layer, head, d_head, d_model]")
    b_Q = property(lambda self: self._stack("b_Q"), doc="[layer, head, d_head] (zeros without biases)")
    b_K = property(lambda self: self._stack("b_K"), doc="[layer, kv_head, d_head] (zeros without biases)")
    b_V = property(lambda self: self._stack("b_V"), doc="[layer, kv_head, d_head] (zeros without biases)")

    def _or_zeros(self, bias: Tensor | None, size: int) -> Tensor:
        """A bias the checkpoint lacks reads as zeros (as in TransformerLens's HookedTransformer)."""
        return bias if bias is not None else self.W_E.new_zeros(size)

    @property
    def b_O(self) -> Tensor:
        """[layer, d_model] (zeros without biases)."""
        return torch.stack([self._or_zeros(b.attn.b_O, self.cfg.d_model) for b in self.blocks])

    def _stack_mlp(self, attr: str, size: int | None = None) -> Tensor:
        if self.cfg.attn_only:
            raise AttributeError(f"{attr}: this model is attention-only, it has no MLPs")
        if attr == "W_gate" and not hasattr(self.blocks[0].mlp, "W_gate"):
            raise AttributeError("W_gate: this model's MLPs are not gated")
        out = []
        for b in self.blocks:
            w = getattr(b.mlp, attr, None)
            out.append(self._or_zeros(w, size))
        return torch.stack(out)

    W_in = property(lambda self: self._stack_mlp("W_in"), doc="[layer, d_model, d_mlp]")
    W_gate = property(lambda self: self._stack_mlp("W_gate"), doc="[layer, d_model, d_mlp] (gated MLPs)")
    W_out = property(lambda self: self._stack_mlp("W_out"), doc="[layer, d_mlp, d_model]")
    b_in = property(lambda self: self._stack_mlp("b_in", self.cfg.d_mlp), doc="[layer, d_mlp] (zeros without biases)")
    b_out = property(lambda self: self._stack_mlp("b_out", self.cfg.d_model), doc="[layer, d_model] (zeros without biases)")

    @property
    def b_U(self) -> Tensor:
        """[d_vocab] (zeros without an unembedding bias)."""
        b = self.unembed.b_U
        return self._or_zeros(b, self.cfg.d_vocab)

    @property
    def W_E_pos(self) -> Tensor:
        """[d_vocab + n_ctx, d_model]: W_E stacked on W_pos, the whole input space of a model with
        learned positions."""
        return torch.cat([self.W_E, self.W_pos], dim=0)

    def _kv_to_heads(self, w: Tensor, dim: int = 1) -> Tensor:
        """kv heads -> query heads along `dim` ([layer, kv_head, ...] by default): query head h reads
        kv head h // (n_heads / n_kv_heads)."""
        return w.repeat_interleave(self.cfg.n_heads // self.cfg.kv_heads, dim=dim)

    @property
    def QK(self) -> "FactoredMatrix":
        """W_Q W_K^T per head, [layer, head, d_model, d_model], factored (`interp.FactoredMatrix`);
        under GQA each query head with its kv head. Positions (rotary, ALiBi) are not included."""
        from .factored import FactoredMatrix

        return FactoredMatrix(self.W_Q, self._kv_to_heads(self.W_K).transpose(-2, -1))

    @property
    def OV(self) -> "FactoredMatrix":
        """W_V W_O per head, [layer, head, d_model, d_model], factored (`interp.FactoredMatrix`)."""
        from .factored import FactoredMatrix

        return FactoredMatrix(self._kv_to_heads(self.W_V), self.W_O)

    def tl_parameters(self) -> dict[str, Tensor]:
        """The weights under TransformerLens's names and per-head shapes, as the bridge's
        `tl_parameters()` (what `SVDInterpreter` and other TransformerLens tools read):
        `blocks.L.attn.W_Q` [head, d_model, d_head], W_K / W_V expanded to one per query head under
        GQA, absent biases as zeros, `blocks.L.ln1.w`, `unembed.W_U`, ... Views of the live
        weights, not copies."""
        out: dict[str, Tensor] = {"embed.W_E": self.W_E}
        if self.pos_embed is not None:
            out["pos_embed.W_pos"] = self.W_pos
        expand = lambda w: self._kv_to_heads(w, dim=0)  # noqa: E731
        for i, block in enumerate(self.blocks):
            a, pre = block.attn, f"blocks.{i}."
            out.update({
                pre + "attn.W_Q": a.W_Q, pre + "attn.W_K": expand(a.W_K), pre + "attn.W_V": expand(a.W_V),
                pre + "attn.W_O": a.W_O, pre + "attn.b_Q": a.b_Q, pre + "attn.b_K": expand(a.b_K),
                pre + "attn.b_V": expand(a.b_V),
                pre + "attn.b_O": self._or_zeros(a.b_O, self.cfg.d_model),
            })
            if block.mlp is not None:
                m = block.mlp
                out[pre + "mlp.W_in"], out[pre + "mlp.W_out"] = m.W_in, m.W_out
                out[pre + "mlp.b_in"] = self._or_zeros(m.b_in, self.cfg.d_mlp)
                out[pre + "mlp.b_out"] = self._or_zeros(m.b_out, self.cfg.d_model)
                if getattr(m, "W_gate", None) is not None:
                    out[pre + "mlp.W_gate"] = m.W_gate
            for norm in ("ln1", "ln2"):
                module = getattr(block, norm, None)
                for k, v in (module.named_parameters() if module is not None else ()):
                    out[f"{pre}{norm}.{k}"] = v
        for k, v in (self.ln_final.named_parameters() if self.ln_final is not None else ()):
            out[f"ln_final.{k}"] = v
        out["unembed.W_U"], out["unembed.b_U"] = self.W_U, self.b_U
        return out

    def tl_named_parameters(self):
        """`tl_parameters()` as (name, tensor) pairs, as the bridge's."""
        return iter(self.tl_parameters().items())

    def all_composition_scores(self, mode: str) -> Tensor:
        """[layer, head, layer, head] Q-, K- or V-composition scores (`mode` "Q", "K", "V") of every
        earlier head with every later one, zero where the first layer is not earlier, as
        TransformerLens's. `interp.analyses.composition_scores` gives them as a table, with a
        random baseline."""
        from .factored import composition_scores

        if mode not in ("Q", "K", "V"):
            raise ValueError(f"mode must be 'Q', 'K' or 'V', got {mode!r}")
        L, H = self.cfg.n_layers, self.cfg.n_heads
        # Only pairs with an earlier first layer are computed (half the work of all pairs); float32 at
        # least, as TransformerLens computes them in the weights' dtype.
        dtype = torch.float64 if self.dtype == torch.float64 else torch.float32
        scores = torch.zeros(L, H, L, H, device=self.device, dtype=dtype)
        with torch.no_grad():
            left = self.OV
            right = {"Q": self.QK, "K": self.QK.T, "V": left}[mode]
            for la in range(L - 1):
                scores[la, :, la + 1:] = composition_scores(left[la], right[la + 1:], dtype=dtype)
        return scores

    @property
    def device(self) -> torch.device:
        return self.embed.W_E.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.W_E.dtype

    def _apply(self, fn, *args, **kwargs):
        # Every move or cast (.to, .cuda, .half, to_empty) goes through here: keep cfg.device/.dtype true.
        out = super()._apply(fn, *args, **kwargs)
        self._attach()
        return out

    def accumulated_bias(self, layer: int, mlp_input: bool = False, include_mlp_biases: bool = True) -> Tensor:
        """[d_model]: the attention (b_O) and MLP (b_out) output biases added to the residual stream
        before block `layer` (with mlp_input, also block `layer`'s b_O). TransformerLens's signature."""
        total = torch.zeros(self.cfg.d_model, device=self.device, dtype=self.dtype)
        for i, block in enumerate(self.blocks[: layer + 1 if mlp_input else layer]):
            if block.attn.b_O is not None:
                total = total + block.attn.b_O
            mlp = block.mlp
            if include_mlp_biases and i < layer and mlp is not None and mlp.b_out is not None:
                total = total + mlp.b_out
        return total

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
        from .processing import process_weights

        steps = dict(fold_ln=fold_ln, center_writing_weights=center_writing_weights, center_unembed=center_unembed,
                     fold_value_biases=fold_value_biases, refactor_factored_attn_matrices=refactor_factored_attn_matrices)
        process_weights(self, **steps)
        self._processing = {k: bool(self._processing.get(k) or v) for k, v in steps.items()}
        self._attach()
        return self

    # ---- TransformerLens's optional hook points ---------------------------------------------------
    def set_use_split_qkv_input(self, use_split_qkv_input: bool) -> None:
        """Add (True) or remove `blocks.L.hook_q_input` [batch, pos, head, d_model] and `hook_k_input` /
        `hook_v_input` [batch, pos, kv_head, d_model]: the residual stream copied per head before ln1,
        so one head's query (or one KV head's key / value) input can be patched alone. Off (the
        default), the fused attention path is untouched."""
        if use_split_qkv_input and self._hook_flags["use_attn_in"]:
            raise ValueError("use_split_qkv_input and use_attn_in are mutually exclusive (as in TransformerLens): "
                             "call model.set_use_attn_in(False) first")
        self._set_hook_flag("use_split_qkv_input", use_split_qkv_input,
                            lambda b, on: b.set_split_input("qkv" if on else None))

    def set_use_attn_in(self, use_attn_in: bool) -> None:
        """Add (True) or remove `blocks.L.hook_attn_in` [batch, pos, head, d_model]: one per-head copy of
        the residual stream feeding queries, keys and values (keys and values read the first kv_head
        copies under GQA, as TransformerLens's bridge does)."""
        if use_attn_in and self._hook_flags["use_split_qkv_input"]:
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
        if self._hook_flags[flag] == on:
            return
        for block in self.blocks:
            apply(block, on)
        self._hook_flags[flag] = on
        self.setup_hooks()
        self._attach()

    def _set_prepend_bos(self, value: bool | None) -> None:
        self.cfg = self.cfg.replace(prepend_bos=value)
        self._attach()

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

    # ---- input checks -------------------------------------------------------------------------
    def _as_tokens(self, tokens, prepend_bos: bool | None = None) -> Tensor:
        """Token ids [batch, pos] from ids or text (BOS per the model's default). Texts that would need
        padding raise: the caller has no attention mask to give (see `_input_tokens`)."""
        if _is_text(tokens):
            ids, valid = self._encode(tokens, prepend_bos)
            if not bool(valid.all()):
                raise ValueError(
                    f"these {len(tokens)} texts tokenize to different lengths ({int(valid.sum(1).min())} to "
                    f"{valid.shape[1]} tokens) and this call takes no attention mask: pass texts of one length, "
                    "one text at a time, or token ids with attention_mask=model.to_text_mask(texts)"
                )
            return ids
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

    def _input_tokens(self, input, attention_mask: Tensor | None = None, prepend_bos: bool | None = None,
                      padding_side: str | None = None) -> tuple[Tensor, Tensor | None]:
        """(token ids, attention mask) from ids or text; texts of different lengths are padded and masked."""
        if not _is_text(input):
            return self._as_tokens(input), attention_mask
        tokens, valid = self._encode(input, prepend_bos, padding_side)
        if attention_mask is None and not bool(valid.all()):
            attention_mask = valid
        return tokens, attention_mask

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
            tokens, attention_mask = self._input_tokens(input, attention_mask, prepend_bos, padding_side)
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
            resid = self.hook_embed(self.embed(tokens))
            if self.pos_embed is not None:
                resid = resid + self.hook_pos_embed(self.pos_embed(positions))
        else:
            resid = input
        rope = self.rotary.cos_sin(positions, resid.dtype) if self.rotary is not None else None
        for block in self.blocks[start_at_layer:stop_at_layer]:
            resid = block(resid, mask, rope, kv_cache)
        if kv_cache is not None:
            kv_cache.commit(tokens, valid)
        if stop_at_layer is not None:
            return resid
        logits = self.unembed(self.ln_final(resid))
        if return_type == "logits":
            return logits
        if return_type is None:
            return None
        if tokens is None:
            raise ValueError("a loss needs the token ids: pass tokens=... along with a residual-stream input")
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
        for alias, own in self.hook_aliases.items():  # the bridge's second names, same tensors
            if own in store:
                store[alias] = store[own]
            if f"{own}_grad" in store:
                store[f"{alias}_grad"] = store[f"{own}_grad"]
        store = {n: store[n] for n in sorted(store, key=self._hook_order().get)}
        cache = ActivationCache(store, self) if return_cache_object else store
        if remove_batch_dim and return_cache_object:
            cache = cache.remove_batch_dim()
        if cache_type == "transformer_lens" and return_cache_object:
            from .cache import to_tl_cache

            cache = to_tl_cache(cache)
        return out, cache

    def _hook_order(self) -> dict[str, int]:
        order = {n: i for i, n in enumerate(self.hook_dict)}
        order.update({f"{n}_grad": len(order) + i for i, n in enumerate(self.hook_dict)})
        return order

    def new_kv_cache(
        self, batch_size: int, max_len: int | None = None, capture_queries: bool = False, n_sink: int = 0,
        precision=None, default: str = "fp32",
    ) -> KVCache:
        """A preallocated KV cache for `max_len` tokens (default n_ctx), in the model's dtype and device.

        n_sink > 0 keeps the first n_sink keys visible past sliding windows (StreamingLLM).
        precision: None (the model's dtype, unquantized), a name ("int8", "fp8", "int4", "fp16", "bf16",
        "fp32") for every KV head, or a {(layer, kv_head): name} map with `default` for the rest: a
        `QuantizedKVCache` (`interp.models.kv_cache_quant`)."""
        cfg = self.cfg
        args = (cfg.n_layers, batch_size, max_len or cfg.n_ctx, cfg.kv_heads, cfg.head_dim)
        kwargs = dict(n_heads=cfg.n_heads, capture_queries=capture_queries, dtype=self.dtype, device=self.device,
                      n_sink=n_sink)
        if precision is None:
            return KVCache(*args, **kwargs)
        from .kv_cache_quant import QuantizedKVCache

        return QuantizedKVCache(*args, precision=precision, default=default, **kwargs)

    def attention_stats(
        self, tokens=None, *, kv_cache: KVCache | None = None, attention_mask: Tensor | None = None,
        layers: Sequence[int] | None = None, n_sink: int = 1, backend: str = "torch",
    ) -> dict:
        """Exact per-query head statistics of every layer without materialising a pattern:
        {layer: AttentionStats} with float32 [batch, head, pos] fields sink, previous, duplicate,
        induction, entropy, max, distance (see `interp.kernels.attention_stats`).

        From `tokens`: one fused forward that hands each layer's rotated q/k to the streaming kernel
        as the layer is computed, then drops them. From `kv_cache` (made with capture_queries=True):
        after a forward or a generation, without re-running the model. `interp.models.stats.stats_frame`
        turns the result into a tidy table."""
        from .stats import kv_cache_attention_stats, model_attention_stats

        if (tokens is None) == (kv_cache is None):
            raise ValueError("give exactly one of tokens or kv_cache=...")
        if kv_cache is not None:
            return kv_cache_attention_stats(self, kv_cache, layers=layers, n_sink=n_sink, backend=backend)
        return model_attention_stats(self, tokens, attention_mask=attention_mask, layers=layers, n_sink=n_sink, backend=backend)

    def generate(self, tokens, max_new_tokens: int = 20, **kwargs) -> Tensor:
        """Greedy or sampled continuation through a KV cache; see `interp.models.generate.generate`."""
        from .generate import generate

        return generate(self, tokens, max_new_tokens, **kwargs)

    # ---- tokenizer helpers --------------------------------------------------------------------
    def _need_tokenizer(self):
        if self.tokenizer is None:
            raise ValueError(
                "this model has no tokenizer; pass token ids, or attach one: model.tokenizer = tok "
                "(any Hugging Face tokenizer, or interp.from_hf(model, tokenizer=tok))"
            )
        return self.tokenizer

    def _bos_default(self) -> bool:
        """`cfg.prepend_bos` if the config says; otherwise TransformerLens's rule: BOS when the tokenizer has one."""
        if self.cfg.prepend_bos is not None:
            return self.cfg.prepend_bos
        return getattr(self.tokenizer, "bos_token_id", None) is not None

    def _bos_id(self, prepend_bos: bool | None) -> int | None:
        """The BOS id to put first (None: no BOS), for a call's `prepend_bos` (None: the model's default)."""
        want = self.cfg.default_prepend_bos if prepend_bos is None else bool(prepend_bos)
        if not want:
            return None
        bos = getattr(self._need_tokenizer(), "bos_token_id", None)
        if bos is None:
            where = "prepend_bos=True was passed" if prepend_bos else "this model's config sets prepend_bos=True"
            raise ValueError(
                f"{where}, but the tokenizer ({type(self.tokenizer).__name__}) has no BOS token: pass "
                "prepend_bos=False, load the model with default_prepend_bos=False, or give the tokenizer a "
                "bos_token"
            )
        return int(bos)

    def _pad_id(self) -> int:
        tok = self.tokenizer
        for attr in ("pad_token_id", "eos_token_id", "bos_token_id"):  # TransformerLens pads with EOS when there is no pad
            value = getattr(tok, attr, None)
            if value is not None:
                return int(value)
        raise ValueError(
            "these texts have different lengths and the tokenizer has no pad, EOS or BOS token to pad them with; "
            "set tokenizer.pad_token_id, or tokenize them one at a time"
        )

    def _encode(self, text, prepend_bos: bool | None = None, padding_side: str | None = None,
                truncate: bool = True) -> tuple[Tensor, Tensor]:
        """Text -> (token ids [batch, pos], real-token mask [batch, pos]), BOS and padding as `to_tokens`."""
        tok = self._need_tokenizer()
        if isinstance(text, str):
            texts = [text]
        elif isinstance(text, (list, tuple)) and text and all(isinstance(t, str) for t in text):
            texts = list(text)
        else:
            raise TypeError(f"text must be a string or a non-empty list of strings, got {_describe(text)}")
        side = padding_side if padding_side is not None else getattr(tok, "padding_side", "right")
        if side not in ("left", "right"):
            raise ValueError(f"padding_side must be 'left' or 'right', got {side!r}")
        bos = self._bos_id(prepend_bos)
        ids = [list(tok.encode(t, add_special_tokens=False) if hasattr(tok, "encode") else tok(t)) for t in texts]
        ids = [([bos] if bos is not None else []) + i for i in ids]
        if truncate:  # as TransformerLens: at most n_ctx tokens
            ids = [i[: self.cfg.n_ctx] for i in ids]
        if not all(ids):
            raise ValueError("a text tokenized to no tokens at all: give non-empty text (or prepend_bos=True)")
        width = max(len(i) for i in ids)
        pad = self._pad_id() if any(len(i) < width for i in ids) else 0
        rows, valid = [], []
        for i in ids:
            fill = [pad] * (width - len(i))
            rows.append(i + fill if side == "right" else fill + i)
            real = [True] * len(i)
            valid.append(real + [False] * len(fill) if side == "right" else [False] * len(fill) + real)
        return (torch.tensor(rows, dtype=torch.long, device=self.device),
                torch.tensor(valid, dtype=torch.bool, device=self.device))

    def to_tokens(self, input: str | list[str], prepend_bos: bool | None = None, padding_side: str | None = None,
                  move_to_device: bool = True, truncate: bool = True) -> Tensor:
        """Text -> token ids [batch, pos], as TransformerLens's `to_tokens`.

        prepend_bos   None: the model's default (`model.cfg.default_prepend_bos`: True when the tokenizer
                      has a BOS token, unless the model's config or `interp.load(..., default_prepend_bos=)`
                      says otherwise); True / False for this call.
        padding_side  for texts of different lengths: "right" or "left" (default: the tokenizer's, else
                      right). Padding is the tokenizer's pad id (its EOS when it has none). Passing the
                      texts themselves to the model (`model(texts)`) builds the attention mask too.
        truncate      keep at most n_ctx tokens."""
        return self._encode(input, prepend_bos, padding_side, truncate)[0]

    def to_text_mask(self, input: str | list[str], prepend_bos: bool | None = None,
                     padding_side: str | None = None) -> Tensor:
        """The attention mask [batch, pos] (1 for real tokens) of `to_tokens(input, ...)`: what
        TransformerLens's `utils.get_attention_mask` gives, from the true lengths rather than pad ids."""
        return self._encode(input, prepend_bos, padding_side)[1].long()

    def to_string(self, tokens) -> str | list[str]:
        tok = self._need_tokenizer()
        t = torch.as_tensor(tokens)
        if t.dim() <= 1:
            return tok.decode(t.tolist())
        return [tok.decode(row.tolist()) for row in t]

    def to_str_tokens(self, input, prepend_bos: bool | None = None, padding_side: str | None = None):
        """One string per token, as TransformerLens: text (BOS per `prepend_bos`, default the model's),
        token ids [pos] / [1, pos], or a list of texts / a [batch, pos] tensor (a list per row).
        Special tokens keep their names ("<bos>", "<|endoftext|>"): a position is never shown as ""."""
        tok = self._need_tokenizer()
        if isinstance(input, (list, tuple)) and input and all(isinstance(t, str) for t in input):
            return [self.to_str_tokens(t, prepend_bos, padding_side) for t in input]
        if isinstance(input, str):
            ids = self.to_tokens(input, prepend_bos, padding_side)[0]
        else:
            ids = torch.as_tensor(input)
            if ids.dim() == 2 and ids.shape[0] > 1:
                return [self.to_str_tokens(row) for row in ids]
            ids = ids.reshape(-1)
        return [tok.decode([i], skip_special_tokens=False) for i in ids.tolist()]

    def to_single_token(self, string: str) -> int:
        """The id of the one token `string` encodes to (raises if it is not exactly one token)."""
        ids = self.to_tokens(string, prepend_bos=False)[0]
        if ids.numel() != 1:
            raise ValueError(f"{string!r} is {ids.numel()} tokens, not one: {ids.tolist()}")
        return int(ids.item())

    def to_single_str_token(self, int_token: int) -> str:
        """The string of one token id."""
        if not isinstance(int_token, int):
            raise TypeError(f"to_single_str_token takes one int token id, got {_describe(int_token)}")
        return self.to_str_tokens(torch.tensor([int_token]))[0]

    def get_token_position(self, single_token, input, mode: str = "first", prepend_bos: bool | None = None,
                           padding_side: str | None = None) -> int:
        """Where `single_token` (a one-token string or an id) occurs in `input` (a text, or ids [pos] /
        [1, pos]): its first or last position (`mode`). Text gets BOS per `prepend_bos`, as in
        TransformerLens."""
        if mode not in ("first", "last"):
            raise ValueError(f"mode must be 'first' or 'last', got {mode!r}")
        ids = self.to_tokens(input, prepend_bos, padding_side) if isinstance(input, str) else torch.as_tensor(input)
        if ids.dim() == 2:
            if ids.shape[0] != 1:
                raise ValueError(f"get_token_position takes one sequence, got a batch of {ids.shape[0]}")
            ids = ids[0]
        token = self.to_single_token(single_token) if isinstance(single_token, str) else int(single_token)
        where = (ids == token).nonzero()[:, 0]
        if where.numel() == 0:
            raise ValueError(f"token {token} ({self.to_single_str_token(token) if self.tokenizer else token!r}) "
                             "does not occur in the input")
        return int(where[0] if mode == "first" else where[-1])

    def loss_fn(self, logits: Tensor, tokens: Tensor, attention_mask: Tensor | None = None,
                per_token: bool = False) -> Tensor:
        """Next-token cross-entropy of `logits` on `tokens` (TransformerLens's `loss_fn`): the mean over
        positions whose token and next token are real (per `attention_mask`), or [batch, pos - 1]."""
        valid = None if attention_mask is None else attention_mask.to(logits.device).bool()
        return lm_loss(logits, torch.as_tensor(tokens), valid, per_token=per_token)

    def tokens_to_residual_directions(self, tokens) -> Tensor:
        """The unembedding directions W_U[:, token]: [*tokens.shape, d_model], or [d_model] for a single
        token (a str, an int or any one-element tensor, as TransformerLens does)."""
        if isinstance(tokens, str):
            tokens = self.to_single_token(tokens)
        t = torch.as_tensor(tokens, device=self.device)
        if t.numel() == 1:
            return self.W_U[:, int(t.item())]
        return self.W_U[:, t].movedim(0, -1)

    # ---- saving -------------------------------------------------------------------------------
    def save(self, path) -> None:
        """Write `config.json` + `model.safetensors` (our format; `interp.load(path)` reads it back)."""
        from .checkpoint import save_model

        save_model(self, path)

    def __repr__(self) -> str:
        c = self.cfg
        kind = "MHA" if c.kv_heads == c.n_heads else ("MQA" if c.kv_heads == 1 else f"GQA({c.kv_heads} kv)")
        return (
            f"HookedTransformer({c.model_type}: {c.n_layers} layers, d_model={c.d_model}, {c.n_heads} heads {kind}, "
            f"{'attn-only' if c.attn_only else f'd_mlp={c.d_mlp}'}, {c.positional} positions, "
            f"{c.n_params() / 1e6:.2f}M params, attention={self._backend})"
        )


def _is_text(x) -> bool:
    return isinstance(x, str) or (isinstance(x, (list, tuple)) and len(x) > 0 and isinstance(x[0], str))


def _describe(x) -> str:
    return f"{type(x).__name__} {x!r}"[:80]


def _grad_hook(store: dict, device):
    def hook(grad: Tensor, hook: HookPoint) -> None:
        store[f"{hook.name}_grad"] = grad.detach() if device is None else grad.detach().to(device)

    return hook


def lm_loss(logits: Tensor, tokens: Tensor, valid: Tensor | None = None, per_token: bool = False) -> Tensor:
    """Next-token cross-entropy: logits at position i predict tokens[i + 1].

    Averaged over the pairs where both positions are real tokens; per_token=True returns
    [batch, pos - 1] (zeros at masked pairs)."""
    logprobs = F.log_softmax(logits[:, :-1].float(), dim=-1)
    nll = -logprobs.gather(-1, tokens[:, 1:, None].to(logits.device))[..., 0]
    if valid is None:
        return nll if per_token else nll.mean()
    pair = (valid[:, :-1] & valid[:, 1:]).to(nll.dtype)
    nll = nll * pair
    return nll if per_token else nll.sum() / pair.sum().clamp(min=1)
