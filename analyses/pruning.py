"""Pruning curves: the loss (and any metric) as heads are removed cumulatively.

Michel, Levy & Neubig (2019), Sec. 4.2 / Fig. 3: prune the least important heads a step at a time
(a share `step` of all heads), recomputing the importance of the remaining heads on the pruned model
after every step, and record the metric after each. Orders:

    importance  Michel et al.'s I_h (per-layer L2-normalised gate gradients; `analyses.importance`),
                lowest first, recomputed every step.
    reverse     the same importance, highest first (the control: the curve should rise fastest).
    ablation    the exact loss change of removing each remaining head from the current pruned model
                (`analyses.ablation`), least harmful first, recomputed every step. Costlier, exact.
    random      a seeded random order (the baseline).

A pruned head's output z is replaced by zero (Michel's head mask) or by its mean (`method`), the mean
being that of the unpruned model.

As Michel et al. did it (`pruning_study`): importance is scored on one split of the text and the
curve measured on a held-out split (`eval_tokens`), importance order against reverse-importance
order and random orders over several seeds; the headline is the largest fraction of heads that can
be pruned with the held-out loss within +5% of the unpruned model's.
"""

from __future__ import annotations

from typing import Callable, Literal

import pandas as pd
import torch
from torch import Tensor

from ._common import progress, token_batch, token_input, valid_mask
from .ablation import AblationRunner, ablation_values
from .importance import gated_gradients, michel_importance

Order = Literal["importance", "reverse", "random", "ablation"]
ORDERS = ("importance", "reverse", "random", "ablation")


def pruning_curve(
    model,
    tokens,
    order: Order = "importance",
    step: float | int = 0.1,
    metric_fn: Callable[[Tensor, Tensor], Tensor] | None = None,
    *,
    method: Literal["zero", "mean"] = "zero",
    attention_mask: Tensor | None = None,
    seed: int = 0,
    max_fraction: float = 1.0,
    progress_bar: bool | None = None,
    eval_tokens=None,
) -> pd.DataFrame:
    """Loss (and `metric_fn(logits, tokens)`) as heads are pruned cumulatively.

    step: a share of all heads pruned per step (0 < step < 1), or a number of heads (int >= 1).
    max_fraction: stop once this share of the heads is pruned (default: all of them).
    eval_tokens: held-out data the loss is measured on (default: `tokens`, which orders the heads).

    Returns one row per step, the first being the unpruned model (its loss is the clean loss):
    step, n_pruned, fraction_pruned, loss, [metric], pruned (heads removed at that step, "L{l}H{h}"),
    order, method, seed."""
    if order not in ORDERS:
        raise ValueError(f"order must be one of {ORDERS}, got {order!r}")
    if method not in ("zero", "mean"):
        raise ValueError(f"pruning replaces heads by 'zero' (Michel et al.) or their 'mean', got {method!r}")
    tokens, attention_mask = token_input(model, tokens, attention_mask)
    valid = valid_mask(tokens, attention_mask)
    cfg = model.cfg
    total = cfg.n_layers * cfg.n_heads
    if not step > 0:
        raise ValueError(f"step must be > 0 (a share of the heads, or a count), got {step}")
    per_step = int(step) if step >= 1 else max(1, round(step * total))
    values = ablation_values(model, tokens, method, valid=valid, attention_mask=attention_mask)
    held_out = tokens if eval_tokens is None else token_batch(model, eval_tokens)
    eval_mask = attention_mask if eval_tokens is None else None
    all_heads = [(l, h) for l in range(cfg.n_layers) for h in range(cfg.n_heads)]
    if order == "random":
        g = torch.Generator().manual_seed(seed)
        shuffled = [all_heads[i] for i in torch.randperm(total, generator=g).tolist()]

    pruned: list[tuple[int, int]] = []
    rows = []
    limit = int(round(max_fraction * total))
    n_steps = -(-limit // per_step)
    for i in progress(range(n_steps + 1), total=n_steps + 1, desc=f"pruning ({order})", enabled=progress_bar):
        if i > 0:
            remaining = [hd for hd in all_heads if hd not in pruned]
            k = min(per_step, limit - len(pruned))
            if order == "random":
                chosen = [hd for hd in shuffled if hd not in pruned][:k]
            else:
                scores = _scores(order, model, tokens, valid, attention_mask, pruned, remaining, values)
                chosen = sorted(remaining, key=lambda hd: scores[hd], reverse=order == "reverse")[:k]
            pruned = pruned + chosen
        else:
            chosen = []
        loss, metric = _evaluate(model, held_out, values, pruned, eval_mask, metric_fn)
        row = dict(step=i, n_pruned=len(pruned), fraction_pruned=len(pruned) / total, loss=loss)
        if metric_fn is not None:
            row[getattr(metric_fn, "__name__", "metric")] = metric
        rows.append(dict(row, pruned=",".join(f"L{l}H{h}" for l, h in chosen), order=order, method=method, seed=seed))
    return pd.DataFrame(rows)


def _scores(order, model, tokens, valid, attention_mask, pruned, remaining, values) -> dict:
    """{head: score} for the remaining heads on the current pruned model; lowest is pruned first."""
    if order in ("importance", "reverse"):
        grad_xi, _, _ = gated_gradients(model, tokens, valid=valid, attention_mask=attention_mask,
                                        pruned=pruned, values=values)
        imp = michel_importance(grad_xi, normalize=True)
        return {(l, h): float(imp[l, h]) for l, h in remaining}
    runner = AblationRunner(model, tokens, values, base=pruned, attention_mask=attention_mask)
    return runner.sweep(remaining, show_progress=False)


@torch.no_grad()
def _evaluate(model, tokens, values, pruned, attention_mask, metric_fn) -> tuple[float, float | None]:
    by_layer: dict[int, list[int]] = {}
    for l, h in pruned:
        by_layer.setdefault(l, []).append(h)

    def replace(z: Tensor, hook) -> Tensor:
        heads = by_layer[int(hook.name.split(".")[1])]
        z = z.clone()
        z[:, :, heads] = values[int(hook.name.split(".")[1])][:, :, heads].to(z.dtype)
        return z

    hooks = [(f"blocks.{l}.attn.hook_z", replace) for l in by_layer]
    if metric_fn is None:  # the loss alone never holds the whole [batch, pos, vocab] logits
        return float(model.run_with_hooks(tokens, fwd_hooks=hooks, return_type="loss", attention_mask=attention_mask)), None
    logits, loss = model.run_with_hooks(tokens, fwd_hooks=hooks, return_type="both", attention_mask=attention_mask)
    return float(loss), float(metric_fn(logits, tokens))


def pruning_study(
    model, tokens, *, split: float = 0.5, seeds=(0, 1, 2), step: float | int = 0.1, max_fraction: float = 0.5,
    method: Literal["zero", "mean"] = "zero", tolerance: float = 0.05, progress_bar: bool | None = None,
) -> pd.DataFrame:
    """Michel et al.'s pruning experiment: heads ordered on the first `split` of the sequences, the
    loss measured on the rest, for the importance order, the reverse order and a random order per
    seed. Returns the curves (order, seed, step, fraction_pruned, loss, pruned, ...) with
    `.attrs["prunable"]` = {order: the largest fraction whose held-out loss stays within
    (1 + tolerance) x the unpruned loss} (random: the mean over seeds) and `.attrs["clean_loss"]`."""
    tokens = token_batch(model, tokens)
    n_fit = int(round(split * len(tokens)))
    if not 1 <= n_fit < len(tokens):
        raise ValueError(f"split={split} of {len(tokens)} sequences leaves no sequences on one side; "
                         "use at least 2 sequences (--n-seqs) and 0 < split < 1")
    fit, held_out = tokens[:n_fit], tokens[n_fit:]
    runs = [("importance", 0), ("reverse", 0)] + [("random", s) for s in seeds]
    frames = [pruning_curve(model, fit, order=o, step=step, method=method, seed=s, max_fraction=max_fraction,
                            eval_tokens=held_out, progress_bar=progress_bar) for o, s in runs]
    curves = pd.concat(frames, ignore_index=True)
    clean = float(curves.loc[curves["n_pruned"] == 0, "loss"].iloc[0])
    curves.attrs["clean_loss"] = clean
    curves.attrs["tolerance"] = tolerance
    curves.attrs["prunable"] = prunable_fractions(curves, clean, tolerance)
    return curves


def prunable_fractions(curves: pd.DataFrame, clean: float, tolerance: float = 0.05) -> dict:
    """{order: the largest pruned fraction before the loss first exceeds clean x (1 + tolerance)}
    (random: averaged over its seeds)."""
    out = {}
    for order, by_order in curves.groupby("order"):
        per_seed = []
        for _, c in by_order.groupby("seed"):
            c = c.sort_values("fraction_pruned")
            over = c["loss"].to_numpy() > clean * (1 + tolerance)
            per_seed.append(float(c["fraction_pruned"].to_numpy()[over.argmax() - 1] if over.any()
                                  else c["fraction_pruned"].max()))
        out[order] = sum(per_seed) / len(per_seed)
    return out
