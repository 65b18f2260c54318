"""The hookable transformer: blocks, the model, and its forward pass.

Attention in every layer runs fused (SDPA) unless something asks for that layer's scores or
pattern (a hook, or a `run_with_cache` whose filter names them); only those layers go through the
instrumented path. `with model.attention("instrumented"):` or `model.attention_backend = ...`
forces a backend for all (or some) layers.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.utils.checkpoint
from torch import Tensor, nn

from interp.errors import BadValue
from interp.kernels.attention import AttentionMask

from .attention_layer import Attention
from ..base import HookedModel, _nll, lm_loss, masked_nll
from .components import (
    Embed,
    PosEmbed,
    SinusoidalPosEmbed,
    TiedUnembed,
    Unembed,
    init_weights,
    make_norm,
)
from ..config import ModelConfig, RopeScaling
from ..generate import generate
from ..hooks import HookPoint
from ..kv.cache import KVCache
from ..kv.policy_cache import PolicyKVCache
from ..kv.policies import is_window, window_policy
from .moe import make_mlp
from ..placement import device_map as device_maps
from ..placement.offload import OffloadRefused
from ..positions import Rotary
from .processing import process_weights
from ..placement.tensor_files import save_model
from ..readouts.weights import WeightViews

ReturnType = Literal["logits", "loss", "both", None]


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
        hook_attn_in whose first kv_head copies feed keys and values; k / v per query head when
        ungrouped, `set_ungroup_grouped_query_attention`), each normalised by ln1."""
        b, p, d = resid.shape
        h, kv = self.attn.n_heads, self.attn.kv_inputs
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


class HookedTransformer(WeightViews, HookedModel):
    """A decoder-only transformer with TransformerLens hook names and two attention paths: interp's own
    implementation, so besides what every model has (`interp.models.base.HookedModel`) it gives GGUF and
    our format, the KV cache and its per-head policies, TransformerLens's weight processing and weight
    views, RoPE rescaled at inference and the split-input hook points.

    Build from a config (`HookedTransformer(cfg)`, random init), or load one: `interp.load(path)`,
    `interp.from_hf(hf_model)`.
    """

    native = True  # interp's own implementation (a `WrappedModel` is transformers' model with our hooks)
    _core = "embed"

    def __init__(self, cfg: ModelConfig, *, seed: int | None = 0, tokenizer=None) -> None:
        super().__init__(tokenizer=tokenizer)
        self.cfg = cfg
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
        if seed is not None:  # seed=None: leave the weights uninitialised (a loader fills them)
            init_weights(self, cfg, torch.Generator().manual_seed(seed))
        self.setup_hooks()
        self._refresh_view()  # cfg.device / cfg.dtype / cfg.default_prepend_bos, read by TransformerLens

    @property
    def device(self) -> torch.device:
        """Where inputs go: the embedding's device (the first of a `device_map`'s)."""
        if self.device_map is not None:
            return self.device_map["embed"]
        return self.embed.W_E.device if self.offload is None else self.offload.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.W_E.dtype if self.offload is None else self.offload.dtype

    def _apply(self, fn, *args, **kwargs):
        if self.offload is not None:
            raise OffloadRefused(f"this model is offloaded ({self.offload.kind}): its weights stay where they are and "
                                 "each block runs on the device it was loaded for; load it again with the device= and "
                                 "dtype= wanted, or without offload")
        return super()._apply(fn, *args, **kwargs)

    def to(self, *args, **kwargs):
        if device_maps.is_split(self.device_map):
            device = torch._C._nn._parse_to(*args, **kwargs)[0]
            if device is not None:
                raise device_maps.DeviceMapRefused(
                    f"this model is split over devices by its device_map ({device_maps.describe(self.device_map)}): "
                    "moving it whole would leave its units' hooks pointing at the old devices; load it again with "
                    "the device= or device_map= wanted")
        return super().to(*args, **kwargs)

    def cuda(self, device=None):
        return self.to("cuda" if device is None else device)

    def cpu(self):
        return self.to("cpu")

    def rescale_rope_(self, scaling: RopeScaling | None) -> "HookedTransformer":
        """Run the rotary positions with `scaling` from now on (None: plain RoPE), in place of the config's
        own, and say so (`runtime.rope_chosen`). `interp.load(..., rope_scaling=)` is the checked way, from
        any spelling and before the weights load (`interp.models.rope.choice`). Returns the model."""
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
        rotary / ALiBi / GQA). See `interp.models.native.processing`. Returns the model."""
        self._refuse_offloaded("weight processing (fold_ln, centring, ...)")
        steps = dict(fold_ln=fold_ln, center_writing_weights=center_writing_weights, center_unembed=center_unembed,
                     fold_value_biases=fold_value_biases, refactor_factored_attn_matrices=refactor_factored_attn_matrices)
        process_weights(self, **steps)
        self._weight_files = None  # processing may have replaced mapped weights with copies: looked for again
        done = self.runtime.processing
        self.runtime.processing = {k: bool(done.get(k) or v) for k, v in steps.items()}
        self._refresh_view()
        return self

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

    def set_ungroup_grouped_query_attention(self, ungroup_grouped_query_attention: bool) -> None:
        """Under grouped-query attention, give keys and values per query head, as TransformerLens 3's switch of
        this name: `attn.hook_k` / `hook_v` (and `hook_rot_k`, `hook_k_normed`) [batch, pos, head, d_head], and
        with `set_use_split_qkv_input` `hook_k_input` / `hook_v_input` [batch, pos, head, d_model]. Each query
        head's are copies of its KV head's, so the outputs are unchanged, and an edit of one head's copy reaches
        that query head alone. Without GQA it changes nothing (as in TransformerLens)."""
        on = bool(ungroup_grouped_query_attention)
        if on and self.cfg.qk_norm and self.cfg.qk_norm_over == "projection" and self.cfg.kv_heads != self.cfg.n_heads:
            raise ValueError("ungroup_grouped_query_attention: this model's QK-norm spans the whole key projection of its "
                             "KV heads, so keys cannot be normalised per query head")
        self._set_hook_flag("ungroup_grouped_query_attention", on, lambda b, on: setattr(b.attn, "ungroup", on))

    def _set_hook_flag(self, flag: str, on: bool, apply) -> None:
        on = bool(on)
        if self.runtime.hook_flags[flag] == on:
            return
        for block in self.blocks:
            apply(block, on)
        self.runtime.hook_flags[flag] = on
        self.setup_hooks()
        self._refresh_view()

    # ---- input ----------------------------------------------------------------------------------
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
        self.check_weight_files()  # a checkpoint file written over under the model: one line, before a page is read
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
            device_maps.refuse_kv_cache(self)
            kv_cache.reserve(n, batch)
        positions = self._positions(valid, kv_cache)
        mask = self._attention_mask(valid, n, attention_mask is not None, kv_cache)

        split = device_maps.is_split(self.device_map)
        if start_at_layer is None:
            resid = self.embed(tokens)
            resid = self.hook_embed(resid if self.embed_ln is None else self.embed_ln(resid))
            if self.pos_embed is not None:
                pos = self.hook_pos_embed(self.pos_embed(positions))
                resid = resid + (device_maps.move(pos, resid.device) if split else pos)
        else:
            resid = input
        # cos/sin per layer: one table for most models, a second for Gemma 3's local layers
        ropes = self.rotary.per_layer(positions, resid.dtype) if self.rotary is not None else None
        if split:  # each layer's cos/sin on its layer's device (the blocks' hooks bring the rest)
            ropes = device_maps.spread(ropes, [self.device_map[f"blocks.{l}"] for l in range(self.cfg.n_layers)])
        for block in self.blocks[start_at_layer:stop_at_layer]:
            resid = block(resid, mask, ropes[block.layer] if ropes is not None else None, kv_cache)
        if kv_cache is not None:
            kv_cache.commit(tokens, valid)
        if stop_at_layer is not None:
            return resid
        return self._readout(resid, return_type, tokens, valid, loss_per_token, split)

    def _attention_mask(self, valid: Tensor, n: int, masked: bool, kv_cache: KVCache | None) -> AttentionMask:
        """The blocks' mask for this call's n queries against the cached keys and their own: per-key validity
        only when an attention mask was given (`masked`) or the cache holds padding, None (all real) otherwise."""
        past = kv_cache.length if kv_cache is not None else 0
        key_valid = None
        if masked or (kv_cache is not None and not bool(kv_cache.valid().all())):
            key_valid = valid if kv_cache is None else torch.cat([kv_cache.valid(), valid], dim=1)
        return AttentionMask(n_q=n, n_k=past + n, key_valid=key_valid, n_sink=kv_cache.n_sink if kv_cache is not None else 0)

    def _readout(self, resid: Tensor, return_type: ReturnType, tokens: Tensor | None, valid: Tensor,
                 loss_per_token: bool, split: bool):
        """`forward`'s result from the final residual stream: logits, the loss, both, or None (`return_type`)."""
        if return_type is None:
            return None
        if return_type != "logits" and tokens is None:
            raise ValueError("a loss needs the token ids: pass tokens=... along with a residual-stream input")
        if split and return_type != "logits":  # the loss is computed where the logits are
            tokens, valid = device_maps.move((tokens, valid), self.device_map["unembed"])
        if return_type == "loss":  # no [batch, pos, vocab] tensor (2.5 GiB at Gemma's 262k vocabulary x 2,560 tokens)
            return masked_nll(unembed_nll(self.unembed, self.ln_final(resid), tokens), valid, loss_per_token)
        logits = self.unembed(self.ln_final(resid))
        if return_type == "logits":
            return logits
        loss = lm_loss(logits, tokens, valid, per_token=loss_per_token)
        return loss if return_type == "loss" else (logits, loss)

    # ---- the KV cache and its policies -----------------------------------------------------------
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
        device_maps.refuse_kv_cache(self)
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

    generate = generate  # interp.models.generate.generate: greedy or sampled, through interp's KV cache

    # ---- saving -------------------------------------------------------------------------------
    def save(self, path) -> None:
        """Write `config.json` + `model.safetensors` (our format; `interp.load(path)` reads it back)."""
        self._refuse_offloaded("save()")
        save_model(self, path)

    def _refuse_offloaded(self, what: str) -> None:
        if self.offload is not None:
            raise OffloadRefused(f"{what} needs every weight in memory at once, and this model is offloaded "
                                 f"({self.offload.kind}): load it without offload for that")

    def __repr__(self) -> str:
        c = self.cfg
        kind = "MHA" if c.kv_heads == c.n_heads else ("MQA" if c.kv_heads == 1 else f"GQA({c.kv_heads} kv)")
        return (
            f"HookedTransformer({c.model_type}: {c.n_layers} layers, d_model={c.d_model}, {c.n_heads} heads {kind}, "
            f"{'attn-only' if c.attn_only else f'd_mlp={c.d_mlp}'}, {c.positional} positions, "
            f"{c.n_params() / 1e6:.2f}M params, attention={self._backend})"
        )


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

