"""Exact single-head ablation sweeps, fast: resume from the cached residual stream, batch the heads.

Ablating head h of layer L replaces its output z[..., h, :] (`blocks.L.attn.hook_z`) by
    zero      0
    mean      the head's mean z over every real position of the dataset ("mean ablation")
    resample  z of the same position in another sequence of the batch (a seeded derangement of the
              batch; "resample ablation", as in causal scrubbing, Chan et al. 2022)
and measures the mean next-token cross-entropy (or any metric of the logits) against the clean run.

Speed: blocks below L see nothing of an ablation at L, so one clean forward caches every layer's
`hook_resid_pre`, `hook_attn_out` and `hook_z` (which also give the ablation values). Layer L's
ablations then resume from the cache with the batch replicated once per head: copy i gets the cached
attention output plus head i's exact change of output, (z_new - z)_i @ W_O[i] (so layer L's attention
is not even recomputed), runs the rest of block L and then blocks L+1.. (`start_at_layer`). That is
1 + n_layers forwards of decreasing depth instead of n_layers * n_heads full ones
(`python -m interp.benchmarks.ablation_loop`).

Sandwich norms (Gemma 2 / 3): there `hook_attn_out` is ln1_post's output, and a norm is not linear,
so a head's change cannot be added after it. The attention layer's own output (sum over heads of
z W_O, plus b_O: what ln1_post normalises) is recomputed from the cached z instead, the head's change
added to it, and the rest of the block (`after_attention`) applies ln1_post to the sum.
"""

from __future__ import annotations

from typing import Callable, Literal

import pandas as pd
import torch
from torch import Tensor

from interp.models.base import lm_loss
from interp.models.readouts.weights import stored

from ._common import HeadList, progress, resolve_heads, token_input, valid_mask

Method = Literal["mean", "zero", "resample"]
METHODS = ("mean", "zero", "resample")
MetricFn = Callable[[Tensor, Tensor], Tensor]  # (logits [batch, pos, vocab], tokens [batch, pos]) -> scalar


def derangement(n: int, seed: int) -> Tensor:
    """A seeded permutation of range(n) with no fixed point (every sequence gets another's activations)."""
    if n < 2:
        raise ValueError("resample ablation takes activations from another sequence: give a batch of >= 2 sequences")
    g = torch.Generator().manual_seed(seed)
    while True:
        perm = torch.randperm(n, generator=g)
        if not bool((perm == torch.arange(n)).any()):
            return perm


def values_from_z(zs: list[Tensor], method: Method, *, valid: Tensor | None = None, seed: int = 0) -> dict[int, Tensor]:
    """Replacement z per layer from the clean z of every layer ([batch, pos, head, d_head] each):
    [1, 1, head, d_head] for zero / mean, [batch, pos, head, d_head] for resample."""
    if method not in METHODS:
        raise ValueError(f"ablation method must be one of {METHODS}, got {method!r}")
    if method == "zero":
        return {l: torch.zeros_like(z[:1, :1]) for l, z in enumerate(zs)}
    if method == "resample":
        perm = derangement(zs[0].shape[0], seed).to(zs[0].device)
        return {l: z[perm.to(z.device)] for l, z in enumerate(zs)}  # each layer's on its device (a device_map)
    w = (torch.ones(zs[0].shape[:2], device=zs[0].device) if valid is None else valid.float())[..., None, None]
    return {l: (z * w.to(z.device)).sum((0, 1), keepdim=True) / w.to(z.device).sum((0, 1), keepdim=True)
            for l, z in enumerate(zs)}


@torch.no_grad()
def ablation_values(model, tokens: Tensor, method: Method, *, valid: Tensor | None = None, seed: int = 0,
                    attention_mask: Tensor | None = None) -> dict[int, Tensor]:
    """What replaces each head's z, per layer, from one clean forward (see `values_from_z`)."""
    if method not in METHODS:
        raise ValueError(f"ablation method must be one of {METHODS}, got {method!r}")
    if method == "zero":  # nothing to measure: zeros of z's shape per head and dtype (no forward)
        cfg = model.cfg
        z = torch.zeros(1, 1, cfg.n_heads, cfg.d_head, dtype=model.dtype, device=model.device)
        return {l: z.clone() for l in range(cfg.n_layers)}
    names = [f"blocks.{l}.attn.hook_z" for l in range(model.cfg.n_layers)]
    _, cache = model.run_with_cache(tokens, names_filter=names, attention_mask=attention_mask,
                                    stop_at_layer=model.cfg.n_layers)
    return values_from_z([cache[n] for n in names], method, valid=valid, seed=seed)


def _replace_heads(values: Tensor, heads: list[int]):
    """Hook on hook_z: the listed heads get `values` (broadcast over batch and positions)."""

    def hook(z: Tensor, hook) -> Tensor:
        z = z.clone()
        z[:, :, heads] = values[:, :, heads].to(z.device, z.dtype)  # z's layer's device (a device_map)
        return z

    return hook


def attention_output(attn, z: Tensor) -> Tensor:
    """What the attention layer returns for `z` [batch, pos, head, d_head]: the sum over heads of
    z W_O, plus b_O, computed as `Attention.forward` computes it (the input of `ln1_post` in a block
    with sandwich norms, `hook_attn_out` in one without)."""
    b, p = z.shape[:2]
    flat = z.reshape(b, p, -1)
    b_O = stored(attn, "b_O")
    if b_O is None:
        return torch.matmul(flat, attn.W_O_flat)
    return torch.addmm(b_O, flat.reshape(b * p, -1), attn.W_O_flat).view(b, p, -1)


class AblationRunner:
    """One clean forward (with the `base` heads ablated everywhere, e.g. already pruned ones) that
    caches every layer's resid_pre, attention output and z; then any single-head ablations.

    Ablating head h at layer L changes that layer's attention output by exactly
    (z_new - z)[..., h, :] @ W_O[h], and nothing below L. So a batch of ablations at L is: the cached
    attention output plus one such delta per copy, the rest of block L
    (`TransformerBlock.after_attention`), then blocks L+1.. from there; layer L's attention is never
    recomputed. The attention output is the attention layer's own (before ln1_post): `hook_attn_out`
    without sandwich norms, recomputed from the cached z (`attention_output`) with them, since
    `hook_attn_out` is then after ln1_post, which is not linear. The metric is computed one copy at a
    time. Shared by `ablate_heads` and the pruning curves.

    values: replacement z per layer; None computes them (`method`, `seed`) from this clean run, which
    needs an empty `base`."""

    def __init__(self, model, tokens: Tensor, values: dict[int, Tensor] | None = None, *, method: Method = "mean",
                 seed: int = 0, base: HeadList = (), attention_mask: Tensor | None = None,
                 metric: str | MetricFn = "loss") -> None:
        if isinstance(metric, str) and metric != "loss":
            raise ValueError(f"metric must be 'loss' or a function (logits, tokens) -> scalar, got {metric!r}")
        if values is None and base:
            raise ValueError("give the ablation values explicitly when some heads are already ablated (base)")
        if values is None and method not in METHODS:
            raise ValueError(f"ablation method must be one of {METHODS}, got {method!r}")
        self.model, self.tokens, self.metric = model, tokens, metric
        self.attention_mask = attention_mask
        self.valid = valid_mask(tokens, attention_mask)
        self.base: dict[int, list[int]] = {}
        for l, h in base:
            self.base.setdefault(l, []).append(h)
        self.values = values if values is not None else {}
        n_layers = model.cfg.n_layers
        store: dict[str, Tensor] = {}

        def keep(x, hook):
            store[hook.name] = x.detach()

        # A wrapped model (transformers runs it) cannot resume mid-model: each ablation is one whole forward
        # with hook_z replaced (`_run_whole`), the same numbers at the cost of the layers below.
        self.whole = not getattr(model, "native", True)
        # With sandwich norms hook_attn_out is after ln1_post: the attention output is recomputed from z
        # (`attention_output`, in `run`) instead of cached.
        names = ("hook_resid_pre", "attn.hook_z") + (() if model.cfg.sandwich_norms else ("hook_attn_out",))
        if self.whole:
            names = ("attn.hook_z",)
        # base replacements first, so the cached z / attn_out already include them
        hooks = self._base_hooks(0) + [(f"blocks.{l}.{n}", keep) for l in range(n_layers) for n in names]
        with torch.no_grad():
            if self.whole:
                self.clean = self._metric_of(model.run_with_hooks(tokens, fwd_hooks=hooks, attention_mask=attention_mask))
                self.resid, self.attn_out = None, None
                self.z = [store[f"blocks.{l}.attn.hook_z"] for l in range(n_layers)]
            else:
                resid = model.run_with_hooks(tokens, fwd_hooks=hooks, attention_mask=attention_mask,
                                             stop_at_layer=n_layers)
                self.clean = self._metric(resid)
                self.resid, self.z, *attn_out = ([store[f"blocks.{l}.{n}"] for l in range(n_layers)] for n in names)
                self.attn_out: list[Tensor] | None = attn_out[0] if attn_out else None
        if values is None:
            self.values = values_from_z(self.z, method, valid=self.valid, seed=seed)

    def _base_hooks(self, after_layer: int) -> list:
        return [(f"blocks.{l}.attn.hook_z", _replace_heads(self.values[l], heads))
                for l, heads in self.base.items() if l >= after_layer]

    def _metric(self, final_resid: Tensor) -> float:
        """Metric of one copy ([batch, pos, d_model] before the final norm) through the model's own head."""
        n_layers = self.model.cfg.n_layers
        if self.metric == "loss":
            return float(self.model(final_resid, "loss", start_at_layer=n_layers, tokens=self.tokens,
                                    attention_mask=self.attention_mask))
        logits = self.model(final_resid, "logits", start_at_layer=n_layers, attention_mask=self.attention_mask)
        return float(self.metric(logits, self.tokens))

    def _metric_of(self, logits: Tensor) -> float:
        """The metric of a whole forward's logits (a wrapped model's)."""
        if self.metric == "loss":
            return float(lm_loss(logits, self.tokens, None if self.attention_mask is None else self.valid))
        return float(self.metric(logits, self.tokens))

    def _run_whole(self, layer: int, heads_of_copy: list[list[int]]) -> list[float]:
        out = []
        for heads in heads_of_copy:
            hooks = self._base_hooks(0) + [(f"blocks.{layer}.attn.hook_z", _replace_heads(self.values[layer], heads))]
            out.append(self._metric_of(self.model.run_with_hooks(self.tokens, fwd_hooks=hooks,
                                                                 attention_mask=self.attention_mask)))
        return out

    @torch.no_grad()
    def run(self, layer: int, heads_of_copy: list[list[int]]) -> list[float]:
        """Metric with, in copy i, the heads heads_of_copy[i] of `layer` ablated (on top of the base set)."""
        if self.whole:
            return self._run_whole(layer, heads_of_copy)
        model, b, c = self.model, self.tokens.shape[0], len(heads_of_copy)
        with model.holding(layer):  # an offloaded model's block: its W_O and the rest of the block are read here
            return self._resume(layer, heads_of_copy, b, c)

    def _resume(self, layer: int, heads_of_copy: list[list[int]], b: int, c: int) -> list[float]:
        model = self.model
        attn = model.blocks[layer].attn
        W_O = attn.W_O  # [head, d_head, d_model]
        z = self.z[layer]
        new = self.values[layer].to(z.device, z.dtype)
        # the attention layer's output of the clean (base-ablated) run, before any post-attention norm
        clean_out = attention_output(attn, z) if self.attn_out is None else self.attn_out[layer]
        attn_out = []
        for heads in heads_of_copy:
            change = torch.einsum("bphd,hdm->bpm", (new[:, :, heads] - z[:, :, heads]).expand(b, z.shape[1], -1, -1), W_O[heads])
            attn_out.append(clean_out + change)
        mask = None if self.attention_mask is None else self.attention_mask.repeat(c, 1)
        with model.hooks(self._base_hooks(layer + 1)):
            x = model.blocks[layer].after_attention(self.resid[layer].repeat(c, 1, 1), torch.cat(attn_out))
            x = model(x, start_at_layer=layer + 1, stop_at_layer=model.cfg.n_layers, attention_mask=mask)
            return [self._metric(part) for part in x.split(b)]

    def sweep(self, heads: HeadList, heads_per_batch: int | None = None, show_progress: bool | None = None) -> dict:
        """{(layer, head): metric} with each head ablated alone (on top of the base set)."""
        by_layer: dict[int, list[int]] = {}
        for l, h in heads:
            by_layer.setdefault(l, []).append(h)
        size = heads_per_batch or self.model.cfg.n_heads
        jobs = [(l, hs[i : i + size]) for l, hs in sorted(by_layer.items()) for i in range(0, len(hs), size)]
        out = {}
        for l, chunk in progress(jobs, total=len(jobs), desc="ablating heads", enabled=show_progress):
            for h, value in zip(chunk, self.run(l, [[h] for h in chunk])):
                out[(l, h)] = value
        return out


def ablate_heads(
    model,
    tokens,
    method: Method = "mean",
    metric: str | MetricFn = "loss",
    *,
    heads=None,
    attention_mask: Tensor | None = None,
    seed: int = 0,
    heads_per_batch: int | None = None,
    progress: bool | None = None,
) -> pd.DataFrame:
    """The effect of ablating each head alone, exactly.

    tokens [batch, pos]; heads: None (all), [(layer, head), ...] or {layer: [heads]}.
    method: "mean" (mean z over the dataset's real positions), "zero", "resample" (seeded).
    metric: "loss" (mean next-token cross-entropy over real token pairs) or fn(logits, tokens) -> scalar.
    heads_per_batch: ablations per forward (default n_heads: one forward per layer; lower it to save
    memory: the batch is replicated that many times). progress: tqdm bar (None: on a terminal).

    Returns layer, head, method, clean_loss, loss, delta (= loss - clean_loss), seed, n_sequences;
    for a custom metric the columns are clean_metric, metric_value and metric (its name)."""
    tokens, attention_mask = token_input(model, tokens, attention_mask)
    pairs = resolve_heads(model.cfg.n_layers, model.cfg.n_heads, heads)
    runner = AblationRunner(model, tokens, method=method, seed=seed, attention_mask=attention_mask, metric=metric)
    results = runner.sweep(pairs, heads_per_batch, progress)
    if metric == "loss":
        clean_col, value_col, extra = "clean_loss", "loss", {}
    else:
        clean_col, value_col, extra = "clean_metric", "metric_value", {"metric": getattr(metric, "__name__", "metric")}
    rows = [
        {"layer": l, "head": h, "method": method, clean_col: runner.clean, value_col: v, "delta": v - runner.clean,
         **extra, "seed": seed, "n_sequences": tokens.shape[0]}
        for (l, h), v in sorted(results.items())
    ]
    return pd.DataFrame(rows)
