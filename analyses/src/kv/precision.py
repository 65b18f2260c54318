"""What a quantized KV cache does to a model, head by head, and where a memory budget should go.

* `precision_table`: per precision, the perplexity of a forward through a cache of that precision
  (`model.new_kv_cache(precision=...)`), the bytes per token the cache holds (codes and scales, all
  layers) and the loss change from fp32.
* `head_table`: per precision, layer and query head, KL(p_full || p_quant) of each query's attention
  row (nats, mean over queries) and the relative change of the head's output z, ||z_q - z|| / ||z||.
  Both are local: the queries, keys and values of the full-precision forward, with this layer's K and
  V quantized and dequantized, so a head's number is what its own cache does to it. z is the head's
  hook_z: times the output gate where the model gates it (`attn_output_gate`); a learned sink logit
  (gpt-oss) takes its share of each row (the KL is over the keys and the sink).
* `kv_sensitivity`: three rankings of the KV heads for int4 (higher = keep in full precision):
  `loss` (the measured loss increase with that KV head alone in int4; one forward per KV head from
  the residual stream cached at its layer, the layer's KV heads batched), `kl` (the mean int4 KL of
  the query heads sharing it) and `gradient` (first order: |sum over positions of dL/dK * (K_q - K)
  + dL/dV * (V_q - V)| from one backward pass).
* `mixed_precision`: keep the top k KV heads of a ranking in fp32, the rest int4; against k random
  heads (several seeds) and the uniform precisions.
"""

from __future__ import annotations

import math
from typing import Sequence

import pandas as pd
import torch
from torch import Tensor

from interp.kernels.attention import with_sink_column
from interp.kernels.kv_quant import check_precision, fake_quantize
from interp.models import lm_loss
from interp.models.readouts.head_statistics import for_each_layer_qk

from .._common import frozen_params, progress, token_batch

def _k_hook(model) -> str:
    return "hook_rot_k" if model.rotary is not None else "hook_k"


@torch.no_grad()
def cache_loss(model, tokens: Tensor, precision, default: str = "fp32") -> tuple[float, float]:
    """(mean next-token loss, stored bytes per token) of a prefill through a cache of `precision`."""
    cache = model.new_kv_cache(tokens.shape[0], tokens.shape[1], precision=precision, default=default)
    loss = float(lm_loss(model(tokens, kv_cache=cache), tokens))
    return loss, cache.bytes_per_token()


def precision_table(model, tokens, precisions: Sequence[str] = ("fp32", "int8", "fp8", "int4"),
                    progress_bar: bool | None = None) -> pd.DataFrame:
    """One row per precision: precision, perplexity, loss, loss_diff (vs fp32), bytes_per_token."""
    tokens = token_batch(model, tokens)
    rows = []
    for p in progress(list(precisions), desc="KV precisions", enabled=progress_bar):
        loss, nbytes = cache_loss(model, tokens, check_precision(p))
        rows.append(dict(precision=p, perplexity=math.exp(loss), loss=loss, bytes_per_token=nbytes))
    frame = pd.DataFrame(rows)
    base = cache_loss(model, tokens, "fp32")[0] if "fp32" not in set(frame["precision"]) else \
        float(frame.loc[frame["precision"] == "fp32", "loss"].iloc[0])
    frame["loss_diff"] = frame["loss"] - base
    return frame


@torch.no_grad()
def head_table(model, tokens, precisions: Sequence[str] = ("int8", "fp8", "int4"), *, chunk: int = 256) -> pd.DataFrame:
    """One row per (precision, layer, query head): kl, z_rel_change (module docstring)."""
    tokens = token_batch(model, tokens)
    cfg = model.cfg
    group = cfg.n_heads // cfg.kv_heads
    rows = []
    gates: dict[int, Tensor] = {}  # gated attention (`attn_output_gate`): z = gate * (pattern @ v), per layer

    def keep_gate(layer: int):
        def hook(g: Tensor, hook) -> None:
            gates[layer] = g.transpose(1, 2).float().to(model.device)  # [batch, head, pos, d_head], as q, k, v
        return hook

    def fn(layer, q, k, v):
        attn = model.blocks[layer].attn
        scale, gate, sinks = attn.scale, gates.pop(layer, None), attn.sinks
        b, h, n, _ = q.shape
        kf, vf = k.float().repeat_interleave(group, 1), v.float().repeat_interleave(group, 1)
        quant = {p: (fake_quantize(k, p).float().repeat_interleave(group, 1),
                     fake_quantize(v, p).float().repeat_interleave(group, 1)) for p in precisions}
        kl = {p: torch.zeros(h) for p in precisions}
        dz = {p: torch.zeros(h) for p in precisions}
        zz = torch.zeros(h)
        for s in range(0, n, chunk):
            qs = q[:, :, s : s + chunk].float()
            rows_n = qs.shape[2]
            mask = torch.arange(n, device=q.device)[None, :] > torch.arange(s, s + rows_n, device=q.device)[:, None]
            g = 1.0 if gate is None else gate[:, :, s : s + rows_n]
            logp, mask_s = _log_pattern(qs, kf, scale, mask, sinks)
            p_full = logp.exp()
            z = p_full[..., :n] @ vf * g
            zz += z.pow(2).sum((0, 2, 3)).cpu()
            for p, (kq, vq) in quant.items():
                logq = _log_pattern(qs, kq, scale, mask, sinks)[0]
                terms = torch.where(mask_s, 0.0, p_full * (logp - logq))
                kl[p] += terms.sum(-1).sum((0, 2)).cpu()
                dz[p] += (logq[..., :n].exp() @ vq * g - z).pow(2).sum((0, 2, 3)).cpu()
        for p in precisions:
            for head in range(h):
                rows.append(dict(precision=p, layer=layer, head=head, kv_head=head // group,
                                 kl=float(kl[p][head]) / (b * n), z_rel_change=math.sqrt(float(dz[p][head] / zz[head]))))

    gate_hooks = [(f"blocks.{l}.attn.hook_attn_gate", keep_gate(l)) for l in range(cfg.n_layers)
                  if hasattr(model.blocks[l].attn, "hook_attn_gate")]
    with model.hooks(fwd_hooks=gate_hooks):  # the gate comes before hook_attn_out, where fn is called
        for_each_layer_qk(model, tokens, fn)
    return pd.DataFrame(rows)


def _log_pattern(q: Tensor, k: Tensor, scale: float, mask: Tensor, sinks: Tensor | None) -> tuple[Tensor, Tensor]:
    """(log attention [batch, head, rows, keys (+ 1)], its hidden mask): causal (`mask` True: hidden), with the
    layer's learned sink logits (gpt-oss, [head]) as a last column in each softmax where it has them."""
    logits = (q @ k.transpose(-1, -2) * scale).masked_fill(mask, float("-inf"))
    if sinks is None:
        return logits.log_softmax(-1), mask
    return with_sink_column(logits, sinks).log_softmax(-1), torch.cat([mask, mask.new_zeros(mask.shape[0], 1)], -1)


def _kv_heads(model) -> list[tuple[int, int]]:
    return [(l, g) for l in range(model.cfg.n_layers) for g in range(model.cfg.kv_heads)]


@torch.no_grad()
def loss_sensitivity(model, tokens: Tensor, precision: str = "int4", progress_bar: bool | None = None) -> dict:
    """{(layer, kv_head): loss increase with that KV head alone in `precision`}: per layer, one batched
    forward from the cached residual stream, batch row i quantizing KV head i."""
    cfg = model.cfg
    names = [f"blocks.{l}.hook_resid_pre" for l in range(cfg.n_layers)]
    clean_logits, cache = model.run_with_cache(tokens, names_filter=lambda n: n in names)
    clean = float(lm_loss(clean_logits, tokens))
    b = tokens.shape[0]
    out = {}
    for layer in progress(range(cfg.n_layers), desc="KV heads: loss", enabled=progress_bar):
        kv = cfg.kv_heads
        resid = cache[names[layer]].repeat(kv, 1, 1)  # row block i quantizes KV head i

        def quant(x: Tensor, hook) -> Tensor:  # x [kv * b, pos, kv_heads, d_head]
            x = x.clone()
            for g in range(kv):
                x[g * b : (g + 1) * b, :, g] = fake_quantize(x[g * b : (g + 1) * b, :, g], precision)
            return x

        hooks = [(f"blocks.{layer}.attn.{_k_hook(model)}", quant), (f"blocks.{layer}.attn.hook_v", quant)]
        logits = model.run_with_hooks(resid, start_at_layer=layer, fwd_hooks=hooks, tokens=tokens.repeat(kv, 1))
        for g in range(kv):
            out[(layer, g)] = float(lm_loss(logits[g * b : (g + 1) * b], tokens)) - clean
    return out


def gradient_sensitivity(model, tokens: Tensor, precision: str = "int4") -> dict:
    """{(layer, kv_head): |sum over positions and d_head of dL/dK (K_q - K) + dL/dV (V_q - V)|}, one backward."""
    cfg = model.cfg
    held: dict = {}

    def keep(x: Tensor, hook) -> Tensor:
        x.retain_grad()
        held[hook.name] = x
        return x

    def start_graph(x: Tensor, hook) -> Tensor:  # parameters are frozen: the graph starts at the embedding
        return x.detach().requires_grad_(True)

    kname = _k_hook(model)
    hooks = [("hook_embed", start_graph)] + [(f"blocks.{l}.attn.{n}", keep) for l in range(cfg.n_layers)
                                             for n in (kname, "hook_v")]
    with frozen_params(model), torch.enable_grad(), model.hooks(hooks):
        lm_loss(model(tokens), tokens).backward()
    out = {}
    for l in range(cfg.n_layers):
        total = 0.0
        for n in (kname, "hook_v"):
            x = held[f"blocks.{l}.attn.{n}"]
            err = fake_quantize(x.detach(), precision) - x.detach()
            total = total + (x.grad * err).sum((0, 1, 3))  # [kv_heads]
        for g in range(cfg.kv_heads):
            out[(l, g)] = abs(float(total[g]))
    return out


def kv_sensitivity(model, tokens, heads: pd.DataFrame | None = None, precision: str = "int4",
                   progress_bar: bool | None = None) -> pd.DataFrame:
    """One row per KV head: layer, kv_head, loss, kl, gradient (higher = more sensitive to `precision`)."""
    tokens = token_batch(model, tokens)
    heads = head_table(model, tokens, (precision,)) if heads is None else heads
    kl = heads[heads["precision"] == precision].groupby(["layer", "kv_head"])["kl"].mean()
    loss = loss_sensitivity(model, tokens, precision, progress_bar)
    grad = gradient_sensitivity(model, tokens, precision)
    return pd.DataFrame([dict(layer=l, kv_head=g, loss=loss[(l, g)], kl=float(kl[(l, g)]), gradient=grad[(l, g)])
                         for l, g in _kv_heads(model)])


def mixed_precision(model, tokens, sensitivity: pd.DataFrame, ks: Sequence[int], *, low: str = "int4",
                    high: str = "fp32", seeds: Sequence[int] = (0, 1, 2), uniform: Sequence[str] = ("fp32", "int8", "fp8", "int4"),
                    progress_bar: bool | None = None) -> pd.DataFrame:
    """Rows k, selection (loss/kl/gradient/random/uniform), seed, precision, perplexity, loss, bytes_per_token:
    the top k KV heads of each ranking (or k random ones) in `high`, the rest in `low`; and the uniform caches."""
    tokens = token_batch(model, tokens)
    heads = _kv_heads(model)
    plans: list[tuple[dict, dict]] = []
    for p in uniform:
        plans.append((dict(k=len(heads) if p == high else 0, selection="uniform", seed=-1, precision=p), {}))
    for k in ks:
        for sel in ("loss", "kl", "gradient"):
            top = sensitivity.sort_values(sel, ascending=False).head(k)
            plans.append((dict(k=k, selection=sel, seed=-1, precision=f"{high}+{low}"),
                          {(int(r.layer), int(r.kv_head)): high for r in top.itertuples()}))
        for seed in seeds:
            g = torch.Generator().manual_seed(seed)
            pick = [heads[i] for i in torch.randperm(len(heads), generator=g)[:k].tolist()]
            plans.append((dict(k=k, selection="random", seed=seed, precision=f"{high}+{low}"), {h: high for h in pick}))
    rows = []
    for meta, keep in progress(plans, desc="mixed precision", enabled=progress_bar):
        precision = meta["precision"] if meta["selection"] == "uniform" else keep
        loss, nbytes = cache_loss(model, tokens, precision, default=low if meta["selection"] != "uniform" else "fp32")
        rows.append(dict(meta, perplexity=math.exp(loss), loss=loss, bytes_per_token=nbytes))
    return pd.DataFrame(rows)


def recovered_gap(mixed: pd.DataFrame, k: int) -> dict:
    """{selection: share of the int4 -> fp32 loss gap recovered with k heads kept} (random: mean over seeds)."""
    uni = mixed[mixed["selection"] == "uniform"].set_index("precision")["loss"]
    lo, hi = float(uni.get("int4", math.nan)), float(uni.get("fp32", math.nan))
    at = mixed[(mixed["k"] == k) & (mixed["selection"] != "uniform")]
    return {sel: (lo - float(g["loss"].mean())) / (lo - hi) if lo != hi else math.nan
            for sel, g in at.groupby("selection")}
