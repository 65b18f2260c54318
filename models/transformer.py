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
        return self.after_attention(resid, self.attn(self.ln1(resid), mask, rope, kv_cache))

    def after_attention(self, resid: Tensor, attn_out: Tensor) -> Tensor:
        """The rest of the block, given resid_pre and the attention output: -> resid_post.

        Lets an analysis that changes only the attention output resume mid-block (the head-ablation
        sweep adds one head's change of output to a cached attn_out instead of re-running attention)."""
        attn_out = self.hook_attn_out(attn_out)
        if self.mlp is None:
            return self.hook_resid_post(resid + attn_out)
        if self.parallel:
            mlp_out = self.hook_mlp_out(self.mlp(self.ln2(resid)))
            return self.hook_resid_post(resid + attn_out + mlp_out)
        mid = self.hook_resid_mid(resid + attn_out)
        return self.hook_resid_post(mid + self.hook_mlp_out(self.mlp(self.ln2(mid))))


class HookedTransformer(HookedRootModule):
    """A decoder-only transformer with TransformerLens hook names and two attention paths.

    Build from a config (`HookedTransformer(cfg)`, random init), or load one: `interp.load(path)`,
    `interp.from_hf(hf_model)`.
    """

    def __init__(self, cfg: ModelConfig, *, seed: int | None = 0, tokenizer=None) -> None:
        super().__init__()
        self.cfg = cfg
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
        self.cfg = cfg.attached(self.device, self.dtype)  # cfg.device / cfg.dtype, read by TransformerLens

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

    @property
    def device(self) -> torch.device:
        return self.embed.W_E.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.W_E.dtype

    def _apply(self, fn, *args, **kwargs):
        # Every move or cast (.to, .cuda, .half, to_empty) goes through here: keep cfg.device/.dtype true.
        out = super()._apply(fn, *args, **kwargs)
        self.cfg = self.cfg.attached(self.device, self.dtype)
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
    def _as_tokens(self, tokens) -> Tensor:
        if isinstance(tokens, (str, list)) and (isinstance(tokens, str) or (tokens and isinstance(tokens[0], str))):
            return self.to_tokens(tokens)
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
        """
        if start_at_layer is None:
            tokens = self._as_tokens(input)
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

    def to_tokens(self, text: str | list[str], prepend_bos: bool = False, padding_side: str = "right") -> Tensor:
        tok = self._need_tokenizer()
        texts = [text] if isinstance(text, str) else list(text)
        ids = [tok.encode(t, add_special_tokens=False) if hasattr(tok, "encode") else tok(t) for t in texts]
        if prepend_bos:
            bos = getattr(tok, "bos_token_id", None)
            if bos is None:
                raise ValueError("prepend_bos=True but the tokenizer has no bos_token_id")
            ids = [[bos] + list(i) for i in ids]
        width = max(len(i) for i in ids)
        pad = getattr(tok, "pad_token_id", None) or 0
        rows = [list(i) + [pad] * (width - len(i)) if padding_side == "right" else [pad] * (width - len(i)) + list(i) for i in ids]
        return torch.tensor(rows, dtype=torch.long, device=self.device)

    def to_string(self, tokens) -> str | list[str]:
        tok = self._need_tokenizer()
        t = torch.as_tensor(tokens)
        if t.dim() <= 1:
            return tok.decode(t.tolist())
        return [tok.decode(row.tolist()) for row in t]

    def to_str_tokens(self, input) -> list[str]:
        """One string per token. Special tokens keep their names ("<bos>", "<|endoftext|>"), as in
        TransformerLens: a position is never shown as "" (the byte tokenizer's `decode` drops them)."""
        tok = self._need_tokenizer()
        t = self.to_tokens(input)[0] if isinstance(input, str) else torch.as_tensor(input).reshape(-1)
        return [tok.decode([i], skip_special_tokens=False) for i in t.tolist()]

    def to_single_token(self, string: str) -> int:
        """The id of the one token `string` encodes to (raises if it is not exactly one token)."""
        ids = self.to_tokens(string)[0]
        if ids.numel() != 1:
            raise ValueError(f"{string!r} is {ids.numel()} tokens, not one: {ids.tolist()}")
        return int(ids.item())

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
