"""A KV cache whose heads keep what their policy says: per (layer, KV head), any registered policy
(`interp.models.kv.policies`: `full`, a precision, KIVI, or a subset of the tokens; `kv_policy`), held
for real.

    cache = model.new_kv_cache(1, 2048, policy="streaming(4,128)")                # every head
    cache = model.new_kv_cache(1, 2048, policy={(17, 1): "full"}, default="streaming(4,128)")
    cache.absorb(full_prefill_cache, model)   # a full prefill, compressed as this cache's own would be

How it is held. The heads of a layer that share a policy form a group with its own storage:
- dense precisions and KIVI hold every token, in slot order (slot = the token's index in the cache,
  as `KVCache`), so their queries use the model's own mask and, for `full`, the model's own tensors:
  a cache that is `full` everywhere computes bit for bit what the unmodified model computes.
- a `SubsetPolicy` (streaming, H2O, SnapKV, KNorm, TOVA, random, one of your own) holds a subset: keys and
  values [batch, heads, m, d_head] plus each entry's slot (int32; -1 marks padding, the per-head
  validity mask) and the per-entry values it keeps (`entry_names`: H2O's accumulated attention, float32). A call attends over the held entries and this call's new ones with a mask
  built from the slots (`kernels.visibility`), then keeps what the policy keeps (never a slot its
  `protect` names: `held_mask` shows it). Decoding reads only
  held entries. Heads of one group hold the same number of entries (padded with slot -1 where a
  batch row has fewer); the cost of that padding is `allocated_nbytes - nbytes`.

Keys are cached after RoPE, at their original positions: an evicted token leaves a gap, and the held
keys keep the positions they had (nothing is renumbered, unlike StreamingLLM's cache-position
variant), so a policy computes exactly what the full model computes with the evicted keys masked.

Prefill. A long prompt runs through the layer's backend once (fused by default): full attention for
heads whose prefill is the full model's (`Policy.shares_prefill`), each policy's own visibility for
the others (streaming's window); then each head keeps what its policy says (its class docstring:
KIVI quantizes every complete group of R tokens, a subset policy keeps by its `priority`). Calls with
several new tokens evict once per call.

`held_nbytes` (also `nbytes`) counts what is held now: codes, scales and zero points, full-precision
residuals, kept keys and values, their slots and scores; `allocated_nbytes` what the storage occupies
(dense and KIVI storage is preallocated for `max_len`). Both mean the same on every cache (`KVCache`).
`precision=` (a quantized cache) is a spelling of `policy=`: a precision is the policy `Dense(name)`.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import torch
from torch import Tensor

from interp.kernels.attention import AttentionMask
from interp.kernels.kv_quant import (
    code_dtype,
    code_shape,
    dequantize,
    quantize,
    kivi_dequantize_keys,
    kivi_dequantize_values,
    kivi_quantize_keys,
    kivi_quantize_values,
)
from interp.kernels.stats import Scoring
from interp.kernels.visibility import visible

from interp.errors import BadValue, UserError
from .cache import KVCache
from .policies import Candidates, Dense, Kivi, Policy, SubsetPolicy, resolve_policies, theory_bytes_per_token

_DTYPE_NAMES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


class PrecisionStore:
    """Codes (and scales) of a group of KV heads of one layer that share a precision."""

    def __init__(self, precision: str, heads: list[int], batch: int, max_len: int, d_head: int, device) -> None:
        self.precision, self.heads = precision, heads
        self.index = torch.tensor(heads, device=device)
        shape = (batch, len(heads), max_len)
        self.codes = [torch.zeros(*shape, code_shape(precision, d_head), dtype=code_dtype(precision), device=device)
                      for _ in range(2)]  # keys, values
        self.scales = [None if precision in ("fp32", "fp16", "bf16") else torch.zeros(shape, device=device)
                       for _ in range(2)]

    def write(self, which: int, x: Tensor, start: int) -> None:
        codes, scale = quantize(x[:, self.index], self.precision)
        self.codes[which][:, :, start : start + x.shape[2]] = codes
        if scale is not None:
            self.scales[which][:, :, start : start + x.shape[2]] = scale

    def read(self, which: int, end: int, dtype: torch.dtype) -> Tensor:
        scale = None if self.scales[which] is None else self.scales[which][:, :, :end]
        return dequantize(self.codes[which][:, :, :end], scale, self.precision, dtype)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.codes, *self.scales) if t is not None)


def _nbytes(*tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


class Held(NamedTuple):
    """What one call's queries read from a cache layer: keys and values [b, g, m, d] and each entry's slot (the
    token position it holds) [b, g, m], or None when the entries are slots 0..m-1 in order."""

    keys: Tensor
    values: Tensor
    slots: Tensor | None


class _CacheLayer:
    """The KV heads of one layer that share a policy, and what they hold."""

    contiguous = True  # holds every slot in order, so the model's own mask applies

    def __init__(self, policy: Policy, layer: int, heads: list[int], n_rep: int, n_kv: int, batch: int, max_len: int,
                 d_head: int, dtype: torch.dtype, device) -> None:
        self.policy, self.layer, self.heads, self.n_rep = policy, layer, heads, n_rep  # layer: a seeded policy's draw
        self.all_heads = heads == list(range(n_kv))
        self.index = torch.tensor(heads, device=device)
        self.q_index = torch.tensor([h * n_rep + r for h in heads for r in range(n_rep)], device=device)
        self.batch, self.max_len, self.d_head, self.dtype, self.device = batch, max_len, d_head, dtype, device

    def mine(self, x: Tensor) -> Tensor:
        """This group's heads of a [batch, kv_head, ...] tensor."""
        return x if self.all_heads else x[:, self.index]

    def update(self, k: Tensor, v: Tensor, start: int, valid: Tensor) -> "Held":
        """Write / stage this call's keys and values (every KV head, [b, kv, n, d]); return what the
        call's queries read (`Held`: keys, values [b, g, m, d] and each entry's slot [b, g, m], or None for
        slots 0..m-1 in order)."""
        raise NotImplementedError

    def after(self, q: Tensor | None, K: Tensor, V: Tensor, S: Tensor | None, ok: Tensor | None, scale: float,
              start: int, n: int) -> None:
        """After the call's attention: keep what the policy keeps. q: the group's queries of the call."""

    def visible(self, S: Tensor, start: int, n: int, window: int | None, own_window: int | None,
                own_at: int | None = None) -> Tensor:
        """bool [b, g, n, m]: which held entries the queries at slots start..start+n-1 see. The call's queries
        are the last n entries unless `own_at` says where the first one's own entry is (rows of a longer call)."""
        raise NotImplementedError

    def read(self, which: int, length: int) -> Tensor:
        """[b, g, length, d]: keys (0) or values (1) as held, zeros where a slot is not held."""
        raise NotImplementedError

    def held(self, length: int) -> Tensor:
        """bool [b, g, length]: which slots each head holds."""
        return torch.ones(self.batch, len(self.heads), length, dtype=torch.bool, device=self.device)

    def nbytes(self, length: int) -> int:
        raise NotImplementedError

    def allocated_nbytes(self) -> int:
        raise NotImplementedError


class _DenseLayer(_CacheLayer):
    """Every token in a precision (`PrecisionStore`)."""

    def __init__(self, policy: Dense, *args) -> None:
        super().__init__(policy, *args)
        precision = policy.precision
        if precision == "full":
            if self.dtype not in _DTYPE_NAMES:
                raise BadValue(f"KV-cache policies hold float32, float16 or bfloat16 caches; this model is {self.dtype}")
            precision = _DTYPE_NAMES[self.dtype]
        self.store = PrecisionStore(precision, self.heads, self.batch, self.max_len, self.d_head, self.device)

    def update(self, k, v, start, valid):
        self.store.write(0, k, start)
        self.store.write(1, v, start)
        end = start + k.shape[2]
        return Held(self.store.read(0, end, self.dtype), self.store.read(1, end, self.dtype), None)

    def read(self, which, length):
        return self.store.read(which, length, self.dtype)

    def nbytes(self, length):
        return self.store.nbytes * length // self.max_len  # the same bytes for every slot

    def allocated_nbytes(self):
        return self.store.nbytes


class _KiviLayer(_CacheLayer):
    """KIVI: a quantized part (slots 0..nq-1, complete groups) and a full-precision residual."""

    def __init__(self, policy: Kivi, *args) -> None:
        super().__init__(policy, *args)
        b, g, d, G, R = self.batch, len(self.heads), self.d_head, policy.group, policy.residual
        lq = self.max_len // R * R
        packed = d * policy.bits // 8
        z = lambda *shape, dtype=torch.float16: torch.zeros(*shape, dtype=dtype, device=self.device)
        self.key_codes, self.value_codes = z(b, g, lq, packed, dtype=torch.uint8), z(b, g, lq, packed, dtype=torch.uint8)
        self.key_scales, self.key_zeros = z(b, g, lq // G, d), z(b, g, lq // G, d)
        self.value_scales, self.value_zeros = z(b, g, lq, d // G), z(b, g, lq, d // G)
        self.residual_keys, self.residual_values = z(b, g, R, d, dtype=self.dtype), z(b, g, R, d, dtype=self.dtype)
        self.n_quantized = self.n_residual = 0

    def _quantized(self, which: int) -> Tensor:
        p, nq = self.policy, self.n_quantized
        if which == 0:
            return kivi_dequantize_keys(self.key_codes[:, :, :nq], self.key_scales[:, :, : nq // p.group], self.key_zeros[:, :, : nq // p.group],
                                        p.bits, p.group, self.dtype)
        return kivi_dequantize_values(self.value_codes[:, :, :nq], self.value_scales[:, :, :nq], self.value_zeros[:, :, :nq], p.bits, p.group,
                                      self.dtype)

    def _cat(self, which: int, new: Tensor | None) -> Tensor:
        parts = []
        if self.n_quantized:
            parts.append(self._quantized(which))
        if self.n_residual:
            parts.append((self.residual_keys, self.residual_values)[which][:, :, : self.n_residual])
        if new is not None:
            parts.append(new)
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=2)

    def update(self, k, v, start, valid):
        return Held(self._cat(0, self.mine(k)), self._cat(1, self.mine(v)), None)

    def after(self, q, K, V, S, ok, scale, start, n):
        p = self.policy
        fresh_k, fresh_v = K[:, :, self.n_quantized :], V[:, :, self.n_quantized :]  # residual + this call, full precision
        flush = fresh_k.shape[2] // p.residual * p.residual
        if flush:
            a, b = self.n_quantized, self.n_quantized + flush
            self.key_codes[:, :, a:b], ks, kz = kivi_quantize_keys(fresh_k[:, :, :flush], p.bits, p.group)
            self.key_scales[:, :, a // p.group : b // p.group], self.key_zeros[:, :, a // p.group : b // p.group] = ks, kz
            self.value_codes[:, :, a:b], self.value_scales[:, :, a:b], self.value_zeros[:, :, a:b] = kivi_quantize_values(
                fresh_v[:, :, :flush], p.bits, p.group)
            self.n_quantized = b
        self.n_residual = fresh_k.shape[2] - flush
        self.residual_keys[:, :, : self.n_residual] = fresh_k[:, :, flush:]
        self.residual_values[:, :, : self.n_residual] = fresh_v[:, :, flush:]

    def read(self, which, length):
        return self._cat(which, None) if self.n_quantized + self.n_residual else torch.zeros(
            self.batch, len(self.heads), 0, self.d_head, dtype=self.dtype, device=self.device)

    def nbytes(self, length):
        p, nq, g = self.policy, self.n_quantized, len(self.heads)
        codes = 2 * nq * self.key_codes.shape[-1]
        key_scales = 2 * (nq // p.group) * self.d_head * 2  # scale and zero, float16
        value_scales = 2 * nq * (self.d_head // p.group) * 2
        residual = 2 * self.n_residual * self.d_head * self.residual_keys.element_size()
        return self.batch * g * (codes + key_scales + value_scales + residual)

    def allocated_nbytes(self):
        return _nbytes(self.key_codes, self.value_codes, self.key_scales, self.key_zeros, self.value_scales, self.value_zeros, self.residual_keys, self.residual_values)


class _SubsetLayer(_CacheLayer):
    """A `SubsetPolicy`'s heads: the held entries, their slots (and the policy's per-entry values)."""

    contiguous = False

    def __init__(self, policy: SubsetPolicy, *args) -> None:
        super().__init__(policy, *args)
        self.k = self.v = self.slots = None
        self.state: dict = {}  # the policy's own, across calls (SnapKV's "done")
        self.entries: dict[str, Tensor] = {}  # per held entry, beside it (H2O's scores)

    def update(self, k, v, start, valid):
        k, v = self.mine(k), self.mine(v)
        b, g, n, _ = k.shape
        new = torch.arange(start, start + n, device=k.device).expand(b, g, n)
        new = torch.where(valid[:, None, :], new, torch.full_like(new, -1))
        if self.k is None:
            return Held(k, v, new)
        return Held(torch.cat([self.k, k], dim=2), torch.cat([self.v, v], dim=2),
                    torch.cat([self.slots.long(), new], dim=2))

    def visible(self, S, start, n, window, own_window, own_at=None):
        q_slots = torch.arange(start, start + n, device=S.device)[:, None]
        rel = q_slots - S[:, :, None, :]  # [b, g, n, m]: p - j
        w, sink = self.policy.visibility(rel, S, window, own_window)
        ok = visible(rel, causal=True, window=w, sink_key=sink) & (S >= 0)[:, :, None, :]
        # A query that sees no key (a padding query) is given its own, as `AttentionMask` does.
        empty = ~ok.any(-1, keepdim=True)
        if bool(empty.any()):
            m = S.shape[-1]
            first = m - n if own_at is None else own_at  # the entry of the first query's own token
            own = torch.arange(m, device=S.device)[None, :] == (first + torch.arange(n, device=S.device))[:, None]
            ok = ok | (own & empty)
        return ok

    def per_query_head(self, ok: Tensor) -> Tensor:
        """[b, g, n, m] per KV head -> per query head, or [b, 1, n, m] when every head of the group
        holds the same slots (streaming always; any policy at its prefill): a mask SDPA broadcasts
        instead of one per head (a 2048-token streaming prefill: 23 s -> 4 s on 2 cores)."""
        if ok.shape[1] == 1 or self.slots is None or bool((self.slots == self.slots[:, :1]).all()):
            return ok[:, :1]
        return ok.repeat_interleave(self.n_rep, dim=1)

    def after(self, q, K, V, S, ok, scale, start, n):
        view = Candidates(K, V, S, q, ok, scale, start, n, self.n_rep, self.state, self.entries, layer=self.layer,
                          heads=self.index)
        chosen = self.policy.evict(view)
        if chosen is None:  # every entry stays
            self.k, self.v, self.slots = K, V, S.to(torch.int32)
            self.entries = dict(view.entries)
            return
        idx, kept = chosen
        take = lambda x: x.gather(2, idx[..., None].expand(-1, -1, -1, x.shape[-1]))  # noqa: E731
        self.k, self.v = take(K), take(V)
        slots = S.gather(-1, idx)
        self.slots = (slots if kept is None else slots.masked_fill(~kept, -1)).to(torch.int32)
        self.entries = {name: x.gather(-1, idx) for name, x in view.entries.items()}

    def read(self, which, length):
        out = torch.zeros(self.batch, len(self.heads), length, self.d_head, dtype=self.dtype, device=self.device)
        if self.k is not None:
            where = (self.slots >= 0).nonzero(as_tuple=True)
            out[where[0], where[1], self.slots[where].long()] = (self.k, self.v)[which][where]
        return out

    def held(self, length):
        out = torch.zeros(self.batch, len(self.heads), length, dtype=torch.bool, device=self.device)
        if self.slots is not None:
            where = (self.slots >= 0).nonzero(as_tuple=True)
            out[where[0], where[1], self.slots[where].long()] = True
        return out

    def nbytes(self, length):
        if self.k is None:
            return 0
        per_entry = 2 * self.d_head * self.k.element_size() + 4 + sum(x.element_size() for x in self.entries.values())
        return int((self.slots >= 0).sum()) * per_entry

    def allocated_nbytes(self):
        return _nbytes(self.k, self.v, self.slots, *self.entries.values())


def _of_heads(scoring: Scoring, heads: Tensor) -> Scoring:
    """`scoring` for a group of a layer's query heads (`heads`, their indices): its per-head tensors (ALiBi
    slopes, learned sink logits) those heads' only."""
    per_head = {name: getattr(scoring, name)[heads] for name in ("alibi_slopes", "sink_logits")
                if getattr(scoring, name) is not None}
    return dataclasses.replace(scoring, **per_head) if per_head else scoring


_STORES = {"dense": _DenseLayer, "kivi": _KiviLayer, "subset": _SubsetLayer}  # by `Policy.layout`


class PolicyKVCache(KVCache):
    """`KVCache` whose (layer, KV head)s each hold what their policy keeps (module docstring).
    `policies[layer][kv_head]` is the Policy of each head; `k(layer)` / `v(layer)` read back
    [batch, kv_heads, length, d_head] with zeros where a head does not hold a slot, and
    `held_mask(layer)` says which it holds."""

    def __init__(self, *args, policy="full", default="full", **kwargs) -> None:
        self._policy_arg, self._default = policy, default
        self._n_heads = kwargs.get("n_heads")
        super().__init__(*args, **kwargs)

    def _allocate(self, shape: tuple, dtype: torch.dtype, device) -> None:
        n_layers, batch, kv, max_len, d_head = shape
        self.shape, self.device = shape, torch.device(device)
        self.policies = resolve_policies(self._policy_arg, n_layers, kv, default=self._default, max_len=max_len,
                                         d_head=d_head)
        n_rep = (self._n_heads or kv) // kv
        self.groups: list[list[_CacheLayer]] = []
        for layer, row in enumerate(self.policies):
            by_policy: dict[Policy, list[int]] = {}
            for head, p in enumerate(row):
                by_policy.setdefault(p, []).append(head)
            self.groups.append([_STORES[p.layout](p, layer, heads, n_rep, kv, batch, max_len, d_head, dtype, device)
                                for p, heads in by_policy.items()])

    # ---- attention ------------------------------------------------------------------------------
    def append(self, layer, k, v, q=None):
        raise UserError("a cache with per-head policies is written by attention calls (model(..., kv_cache=cache)), "
                        "since what each head keeps depends on the attention; read it with k(layer), v(layer)")

    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor, mask: AttentionMask, run, *, scoring: Scoring,
               own_window: int | None = None, hooked: bool = False) -> Tensor:
        """`KVCache.attend`, each group of KV heads holding what its policy keeps: one call over every head
        while every group holds every slot, else one call per group over what it holds (its query heads'
        part of `scoring`: `_of_heads`), masked by its policy's visibility through `scoring.window`."""
        groups, start, n = self.groups[layer], self.length, k.shape[2]
        scale, window = scoring.scale, scoring.window
        if self.queries is not None:
            self.queries[layer, :, :, start : start + n] = q
        valid = mask.key_valid[:, -n:].to(k.device) if mask.key_valid is not None else torch.ones(
            k.shape[0], n, dtype=torch.bool, device=k.device)
        if len(groups) == 1 and groups[0].contiguous:  # every head holds every slot: the layer's own call
            g = groups[0]
            K, V, _ = g.update(k, v, start, valid)
            z = run(q, K, V, mask, scoring)
            g.after(q, K, V, None, None, scale, start, n)
            return z
        if all(g.contiguous for g in groups):  # precisions per head: still one pattern, one call (hooks too)
            parts = [(g, *g.update(k, v, start, valid)[:2]) for g in groups]
            K = k.new_empty(*k.shape[:2], parts[0][1].shape[2], k.shape[3])
            V = torch.empty_like(K)
            for g, Kg, Vg in parts:
                K[:, g.index], V[:, g.index] = Kg, Vg
            z = run(q, K, V, mask, scoring)
            for g, Kg, Vg in parts:
                g.after(q[:, g.q_index], Kg, Vg, None, None, scale, start, n)
            return z
        if hooked:
            raise UserError(f"layer {layer}'s KV heads hold different tokens ({self.describe(layer)}), so no single "
                            "attention pattern exists to hand to hook_attn_scores / hook_pattern; read patterns "
                            "without this cache, or with a policy that holds every token")
        z = torch.empty_like(q)
        for g in groups:
            qg = q[:, g.q_index]
            K, V, S = g.update(k, v, start, valid)
            ok = None
            if S is None:
                m = mask
            else:
                ok = g.visible(S, start, n, window, own_window)
                m = AttentionMask(n_q=n, n_k=K.shape[2], explicit=g.per_query_head(ok))
            z[:, g.q_index] = run(qg, K, V, m, _of_heads(scoring, g.q_index))
            g.after(qg, K, V, S, ok, scale, start, n)
        return z

    def absorb(self, full: KVCache, model) -> None:
        """Take a prefill held by a full cache (`full`, made with capture_queries=True when any head
        reads the queries: `Policy.reads_queries`) and keep, head by head, what this
        cache's own prefill would have kept: one full prefill then serves every policy whose prefill
        is the full model's (`Policy.shares_prefill`); the prompt's last logits are the same for all."""
        if self.length:
            raise BadValue("absorb() fills an empty cache; this one already holds tokens (cache.reset() empties it)")
        if type(full) is not KVCache or full.length == 0:
            raise BadValue("absorb() takes a plain KVCache holding a prefill (model.new_kv_cache(...) without a policy)")
        n = full.length
        ours, theirs = self.shape, tuple(full.keys.shape)
        if full.batch_size != self.batch_size or n > self.max_len or (theirs[0], theirs[2], theirs[4]) != (
                ours[0], ours[2], ours[4]):
            raise BadValue(f"absorb(): the prefill cache (batch {full.batch_size}, {n} tokens) does not fit this one "
                           f"(batch {self.batch_size}, {self.max_len} tokens, the same model)")
        differ = sorted({p.name for row in self.policies for p in row if not p.shares_prefill})
        if differ:
            raise BadValue(f"absorb(): the prefill of {', '.join(differ)} is not the full model's (it attends through "
                           "its window or reads its own codes): run its own, model(prompt, kv_cache=cache)")
        readers = sorted({p.name for row in self.policies for p in row if p.reads_queries})
        if readers and full.queries is None:
            raise BadValue(f"absorb(): {', '.join(readers)} choose tokens by the prompt's attention; make the prefill "
                           "cache with model.new_kv_cache(..., capture_queries=True)")
        valid = full.valid()
        for layer, groups in enumerate(self.groups):
            scoring = model.blocks[layer].attn.scoring
            k, v = full.k(layer), full.v(layer)
            q = full.q(layer) if full.queries is not None else None
            if self.queries is not None and q is not None:
                self.queries[layer, :, :, :n] = q
            for g in groups:
                K, V, S = g.update(k, v, 0, valid)
                ok = None
                if S is not None:  # the prompt's rows made as they are read, never [n, n] at once
                    def ok(a, b, g=g, S=S, window=scoring.window, own=model.cfg.window(layer)):
                        return g.visible(S, a, b - a, window, own, own_at=S.shape[-1] - n + a)
                g.after(None if q is None else q[:, g.q_index], K, V, S, ok, scoring.scale, 0, n)
        self.key_valid[:, :n] = valid
        self.tokens[:, :n] = full.tokens[:, :n]
        self.n_seen.copy_(full.n_seen)
        self.length = n

    # ---- reading back -------------------------------------------------------------------------
    def _gather(self, layer: int, fn) -> Tensor:
        parts = [(g, fn(g)) for g in self.groups[layer]]
        if len(parts) == 1 and parts[0][0].all_heads:
            return parts[0][1]
        first = parts[0][1]
        out = first.new_zeros(first.shape[0], self.shape[2], *first.shape[2:])
        for g, x in parts:
            out[:, g.index] = x
        return out

    def k(self, layer: int) -> Tensor:
        return self._gather(layer, lambda g: g.read(0, self.length))

    def v(self, layer: int) -> Tensor:
        return self._gather(layer, lambda g: g.read(1, self.length))

    def held_mask(self, layer: int) -> Tensor:
        """bool [batch, kv_heads, length]: True where that KV head holds that cache slot."""
        return self._gather(layer, lambda g: g.held(self.length))

    @property
    def held_nbytes(self) -> int:
        """Bytes held now (module docstring): every layer, keys and values, codes, scales, slots, scores."""
        return sum(g.nbytes(self.length) for row in self.groups for g in row)

    @property
    def allocated_nbytes(self) -> int:
        """Bytes the storage occupies (dense and KIVI storage is preallocated for `max_len`)."""
        return sum(g.allocated_nbytes() for row in self.groups for g in row)

    def describe(self, layer: int | None = None) -> str:
        rows = self.policies if layer is None else [self.policies[layer]]
        names = sorted({p.name for row in rows for p in row})
        return "/".join(names)

    def __repr__(self) -> str:
        return (f"PolicyKVCache(layers={self.shape[0]}, batch={self.batch_size}, kv_heads={self.shape[2]}, "
                f"d_head={self.shape[4]}, length={self.length}/{self.max_len}, policies {self.describe()}, "
                f"{self.held_nbytes / 2**20:.2f} MiB held)")

    def reset(self) -> None:
        super().reset()
        self._allocate(self.shape, self.dtype, self.device)


__all__ = ["PolicyKVCache", "theory_bytes_per_token"]
