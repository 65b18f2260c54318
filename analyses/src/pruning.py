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
from .ablation import AblationRunner, _replace_heads, ablation_values
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
    shared: "Shared | None" = None,
) -> pd.DataFrame:
    """Loss (and `metric_fn(logits, tokens)`) as heads are pruned cumulatively.

    step: a share of all heads pruned per step (0 < step < 1), or a number of heads (int >= 1).
    max_fraction: stop once this share of the heads is pruned (default: all of them).
    eval_tokens: held-out data the loss is measured on (default: `tokens`, which orders the heads).
    shared: what several curves on the same data share (`Shared`: the ablation values, the unpruned
    evaluation, the importance of a pruned set already scored); `pruning_study` passes one to all its curves.

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
    held_out = tokens if eval_tokens is None else token_batch(model, eval_tokens)
    eval_mask = attention_mask if eval_tokens is None else None
    if shared is None:
        shared = Shared(model, tokens, held_out, method, attention_mask=attention_mask, eval_mask=eval_mask,
                        metric_fn=metric_fn)
    all_heads = [(l, h) for l in range(cfg.n_layers) for h in range(cfg.n_heads)]
    if order == "random":
        g = torch.Generator().manual_seed(seed)
        shuffled = [all_heads[i] for i in torch.randperm(total, generator=g).tolist()]

    pruned: list[tuple[int, int]] = []
    state = None  # the last evaluation of this curve: the next one resumes from it
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
                scores = shared.scores(order, valid, pruned, remaining)
                chosen = sorted(remaining, key=lambda hd: scores[hd], reverse=order == "reverse")[:k]
            pruned = pruned + chosen
        else:
            chosen = []
        loss, metric, state = shared.evaluate(pruned, state)
        row = dict(step=i, n_pruned=len(pruned), fraction_pruned=len(pruned) / total, loss=loss)
        if metric_fn is not None:
            row[getattr(metric_fn, "__name__", "metric")] = metric
        rows.append(dict(row, pruned=",".join(f"L{l}H{h}" for l, h in chosen), order=order, method=method, seed=seed))
    return pd.DataFrame(rows)


class Shared:
    """What the pruning curves of one model on one fit / held-out split share, computed once, each number
    the one a curve computing it alone gets (tests/analyses/test_pruning_equal.py checks the curves against a plain
    recomputation):

    * the ablation values (zero: no forward at all; mean: one forward on the fit data);
    * the held-out evaluation of the unpruned model (step 0 of every curve);
    * the importance of a pruned set already scored (importance and reverse orders both start from none);
    * each evaluation resumes from the last one of its curve: a pruned set grows by the step's heads, and
      blocks below the lowest layer of those heads see nothing new, so the residual stream cached there
      (`hook_resid_pre` of every layer) is where the forward starts (`start_at_layer`). A wrapped model
      (transformers runs it) cannot start mid-model: there every evaluation is a whole forward."""

    def __init__(self, model, tokens: Tensor, held_out: Tensor, method: str = "zero", *,
                 attention_mask: Tensor | None = None, eval_mask: Tensor | None = None,
                 metric_fn: Callable[[Tensor, Tensor], Tensor] | None = None, resume: bool = True) -> None:
        self.model, self.tokens, self.held_out = model, tokens, held_out
        self.attention_mask, self.eval_mask, self.metric_fn = attention_mask, eval_mask, metric_fn
        self.values = ablation_values(model, tokens, method, valid=valid_mask(tokens, attention_mask),
                                      attention_mask=attention_mask)
        self.resumes = resume and getattr(model, "native", True)
        self._unpruned = None
        self._importance: dict = {}

    def scores(self, order: str, valid: Tensor, pruned: list, remaining: list) -> dict:
        """{head: score} for the remaining heads on the current pruned model; lowest is pruned first."""
        model = self.model
        if order in ("importance", "reverse"):
            key = frozenset(pruned)
            if key not in self._importance:
                grad_xi, _, _ = gated_gradients(model, self.tokens, valid=valid, attention_mask=self.attention_mask,
                                                pruned=pruned, values=self.values)
                self._importance = {key: michel_importance(grad_xi, normalize=True)}  # only the latest is asked again
            imp = self._importance[key]
            return {(l, h): float(imp[l, h]) for l, h in remaining}
        runner = AblationRunner(model, self.tokens, self.values, base=pruned, attention_mask=self.attention_mask)
        return runner.sweep(remaining, show_progress=False)

    @torch.no_grad()
    def evaluate(self, pruned: list, state=None) -> tuple[float, float | None, tuple]:
        """(held-out loss, metric or None, state) with the `pruned` heads' z replaced; `state` is the
        previous evaluation's of the same curve (its pruned heads a subset of these), to resume from."""
        if not pruned and self._unpruned is not None:
            return self._unpruned
        model, n_layers = self.model, self.model.cfg.n_layers
        start = 0
        if state is not None and self.resumes:
            before, resid, loss, metric = state
            new = set(pruned) - before
            if not new:
                return loss, metric, state
            start = min(l for l, _ in new)
        by_layer: dict[int, list[int]] = {}
        for l, h in pruned:
            if l >= start:
                by_layer.setdefault(l, []).append(h)
        kept: dict[int, Tensor] = {}

        def keep(x: Tensor, hook) -> None:
            kept[int(hook.name.split(".")[1])] = x

        hooks = [(f"blocks.{l}.attn.hook_z", _replace_heads(self.values[l], heads)) for l, heads in by_layer.items()]
        if self.resumes:
            hooks += [(f"blocks.{l}.hook_resid_pre", keep) for l in range(start, n_layers)]
        kind = "loss" if self.metric_fn is None else "both"  # the loss alone never holds the [batch, pos, vocab] logits
        with model.hooks(hooks):
            if start == 0:
                out = model(self.held_out, kind, attention_mask=self.eval_mask)
            else:
                out = model(resid[start], kind, start_at_layer=start, tokens=self.held_out, attention_mask=self.eval_mask)
        loss, metric = (out, None) if self.metric_fn is None else (out[1], self.metric_fn(out[0], self.held_out))
        loss, metric = float(loss), None if metric is None else float(metric)
        resid_all = [resid[l] for l in range(start)] + [kept[l] for l in range(start, n_layers)] if self.resumes else None
        result = (loss, metric, (frozenset(pruned), resid_all, loss, metric))
        if not pruned:
            self._unpruned = result
        return result


def pruning_study(
    model, tokens, *, split: float = 0.5, seeds=(0, 1, 2), step: float | int = 0.1, max_fraction: float = 0.5,
    method: Literal["zero", "mean"] = "zero", tolerance: float = 0.05, progress_bar: bool | None = None,
    reuse: bool = True,
) -> pd.DataFrame:
    """Michel et al.'s pruning experiment: heads ordered on the first `split` of the sequences, the
    loss measured on the rest, for the importance order, the reverse order and a random order per
    seed. Returns the curves (order, seed, step, fraction_pruned, loss, pruned, ...) with
    `.attrs["prunable"]` = {order: the largest fraction whose held-out loss stays within
    (1 + tolerance) x the unpruned loss} (random: the mean over seeds) and `.attrs["clean_loss"]`.
    reuse=False: every curve computes alone and every evaluation is a whole forward (the plain
    algorithm, the same numbers; `interp bench --sections atlas` times both)."""
    tokens = token_batch(model, tokens)
    n_fit = int(round(split * len(tokens)))
    if not 1 <= n_fit < len(tokens):
        raise ValueError(f"split={split} of {len(tokens)} sequences leaves no sequences on one side; "
                         "use at least 2 sequences (--n-seqs) and 0 < split < 1")
    fit, held_out = tokens[:n_fit], tokens[n_fit:]
    runs = [("importance", 0), ("reverse", 0)] + [("random", s) for s in seeds]
    shared = Shared(model, fit, held_out, method)
    frames = [pruning_curve(model, fit, order=o, step=step, method=method, seed=s, max_fraction=max_fraction,
                            eval_tokens=held_out, progress_bar=progress_bar,
                            shared=shared if reuse else Shared(model, fit, held_out, method, resume=False))
              for o, s in runs]
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
