"""Analysis names a sweep accepts, each mapped to an adapter that returns tidy long rows.

An adapter takes a `Context` (one loaded checkpoint, the sweep's tokens, a memo shared by the
adapters of that checkpoint) and returns a DataFrame with columns `layer, head, metric, value`
(layer/head missing, i.e. <NA>, for per-model metrics). The sweep adds run/checkpoint/step/analysis.

Adapters call the analyzers of `interp.analyses` with the parameters listed in `params` (recorded
in settings.json, so a sweep folder says how its numbers were made). Metric names:

  analysis         metric                       per      source
  previous_token   previous_token               head     detect_heads (TransformerLens detect_head), sweep data
  duplicate_token  duplicate_token              head     likewise
  induction        induction                    head     likewise
                   induction_score              head     induction_scores: Olsson et al., repeated random tokens
                   prefix_matching_score        head     likewise
                   repeated_loss_first_copy     model    loss on the first copy of those tokens
                   repeated_loss_repeats        model    loss on the repeats
                   icl_score                    model    icl_score: loss at a late token minus an early one
                   icl_loss_early, icl_loss_late  model
  sinks            sink_alpha                   head     attention_sinks: mean attention to token 0 (Gu et al.)
                   sink_value_norm_ratio        head     ||v_0|| over the mean ||v_j|| of the other keys
                   sink_rate                    layer    share of the layer's heads with alpha_0 > epsilon
                   sink_rate                    model    the same over all heads
  ablation         delta_loss/<method>          head     ablate_heads: loss increase, method mean/zero/resample
                   clean_loss                   model
  importance       importance                   head     head_importance: Michel et al. (normalised per layer)
                   attribution, exact_delta     head     attribution-patching estimate, exact mean ablation
                   attribution_pearson, attribution_spearman  model
  pruning          pruning_loss/<order>@<frac>  model    pruning_curve: loss with that fraction of heads pruned
  loss             loss                         model    mean next-token cross-entropy on the sweep data

`expensive` analyses (a forward pass per head or more) run on the last checkpoint of each run
unless the sweep says `expensive_on="all"`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Callable, Mapping, Sequence

import pandas as pd
import torch
from torch import Tensor

from .ablation import ablate_heads
from .heads import detect_heads, icl_score, induction_scores
from .importance import head_importance
from .pruning import pruning_curve
from .sinks import attention_sinks, sink_rate

@dataclass
class Context:
    """One loaded checkpoint and the sweep's data; `once` shares work between adapters of it."""

    model: object
    tokens: Tensor
    data: object  # the sweep's DataSpec
    checkpoint: object = None  # the `runs.Checkpoint` being analysed
    memo: dict = field(default_factory=dict)

    def once(self, key: str, compute: Callable[[], object]):
        if key not in self.memo:
            self.memo[key] = compute()
        return self.memo[key]


@dataclass(frozen=True)
class Analysis:
    name: str
    run: Callable[[Context], pd.DataFrame]
    description: str
    params: Mapping = field(default_factory=lambda: MappingProxyType({}))
    expensive: bool = False


def rows(layer, head, metric, value) -> pd.DataFrame:
    """Long rows; scalars broadcast, None layer/head mean a per-model metric."""
    frame = pd.DataFrame({"layer": layer, "head": head, "metric": metric, "value": value},
                         index=None if isinstance(value, (list, tuple, pd.Series)) else [0])
    return frame.astype({"layer": "Int64", "head": "Int64", "metric": "string", "value": "float64"})


def per_head(frame: pd.DataFrame, column: str, metric: str) -> pd.DataFrame:
    """Rows for the per-head `column` of an analyzer frame [layer, head, ..., column]."""
    return rows(frame["layer"].tolist(), frame["head"].tolist(), metric, frame[column].astype(float).tolist())


def per_model(metric: str, value: float) -> pd.DataFrame:
    return rows(None, None, metric, float(value))


def concat(*frames: pd.DataFrame) -> pd.DataFrame:
    return pd.concat(frames, ignore_index=True)


# ---- adapters ----------------------------------------------------------------------------------
_DETECT_KINDS = ("previous_token", "duplicate_token", "induction")


def _detect(kind: str) -> Callable[[Context], pd.DataFrame]:
    """One kind of `detect_heads`; the three kinds share one streaming pass per checkpoint."""

    def run(ctx: Context) -> pd.DataFrame:
        frame = ctx.once("detect_heads", lambda: detect_heads(ctx.model, ctx.tokens, kinds=_DETECT_KINDS,
                                                               method="streaming"))
        return per_head(frame[frame["kind"] == kind], "score", kind)

    return run


_INDUCTION = MappingProxyType(dict(method="streaming", seq_len=50, n_repeats=2, batch_size=10, seed=0,
                                   prepend_bos=True, icl_early=50, icl_late=500))


def _induction(ctx: Context) -> pd.DataFrame:
    p = _INDUCTION
    detect = _detect("induction")(ctx)
    # a model whose context is shorter than BOS + n_repeats * seq_len gets the longest half that fits
    seq_len = min(p["seq_len"], (ctx.model.cfg.n_ctx - int(p["prepend_bos"])) // p["n_repeats"])
    olsson = induction_scores(ctx.model, seq_len=seq_len, n_repeats=p["n_repeats"], batch_size=p["batch_size"],
                              seed=p["seed"], prepend_bos=p["prepend_bos"])
    early = min(p["icl_early"], ctx.tokens.shape[1] // 4)  # short sequences: an early token still early
    icl = icl_score(ctx.model, ctx.tokens, early=early, late=p["icl_late"]).iloc[0]
    return concat(
        detect,
        per_head(olsson[olsson["kind"] == "induction"], "score", "induction_score"),
        per_head(olsson[olsson["kind"] == "prefix_matching"], "score", "prefix_matching_score"),
        per_model("repeated_loss_first_copy", olsson.attrs["loss_first_copy"]),
        per_model("repeated_loss_repeats", olsson.attrs["loss_repeats"]),
        per_model("icl_score", icl["icl_score"]),
        per_model("icl_loss_early", icl["loss_early"]),
        per_model("icl_loss_late", icl["loss_late"]),
    )


_SINKS = MappingProxyType(dict(n_sink=1, epsilon=0.3))


def _sinks(ctx: Context) -> pd.DataFrame:
    frame = attention_sinks(ctx.model, ctx.tokens, n_sink=_SINKS["n_sink"], epsilon=_SINKS["epsilon"])
    first = frame[frame["key"] == 0]
    rates = sink_rate(frame)
    rates = rates[rates["key"] == 0]
    per_layer = rates[rates["layer"] != "all"]
    overall = float(rates.loc[rates["layer"] == "all", "sink_rate"].iloc[0])
    return concat(
        per_head(first, "alpha", "sink_alpha"),
        per_head(first, "value_norm_ratio", "sink_value_norm_ratio"),
        rows([int(l) for l in per_layer["layer"]], None, "sink_rate", per_layer["sink_rate"].astype(float).tolist()),
        per_model("sink_rate", overall),
    )


_ABLATION = MappingProxyType(dict(methods=("mean", "zero", "resample"), seed=0))


def _ablation(ctx: Context) -> pd.DataFrame:
    frames = [ablate_heads(ctx.model, ctx.tokens, method=m, seed=_ABLATION["seed"], progress=False)
              for m in _ABLATION["methods"]]
    return concat(*(per_head(f, "delta", f"delta_loss/{m}") for m, f in zip(_ABLATION["methods"], frames)),
                  per_model("clean_loss", frames[0]["clean_loss"].iloc[0]))


_IMPORTANCE = MappingProxyType(dict(method="mean", normalize=True, seed=0))


def _importance(ctx: Context) -> pd.DataFrame:
    p = _IMPORTANCE
    frame = head_importance(ctx.model, ctx.tokens, normalize=p["normalize"], method=p["method"], seed=p["seed"],
                            compare_exact=True, progress=False)
    return concat(
        per_head(frame, "importance", "importance"),
        per_head(frame, "attribution", "attribution"),
        per_head(frame, "ablation_delta", "exact_delta"),
        per_model("attribution_pearson", frame.attrs["pearson"]),
        per_model("attribution_spearman", frame.attrs["spearman"]),
    )


_PRUNING = MappingProxyType(dict(orders=("importance", "random"), step=0.1, method="zero", seed=0))


def pruning_metric(order: str, fraction: float) -> str:
    """The metric name of one point of a pruning curve; `parse_pruning_metric` inverts it."""
    return f"pruning_loss/{order}@{fraction:.4f}"


def parse_pruning_metric(metric: str) -> tuple[str, float] | None:
    if not metric.startswith("pruning_loss/"):
        return None
    order, fraction = metric[len("pruning_loss/"):].rsplit("@", 1)
    return order, float(fraction)


def _pruning(ctx: Context) -> pd.DataFrame:
    p = _PRUNING
    frames = [pruning_curve(ctx.model, ctx.tokens, order=o, step=p["step"], method=p["method"], seed=p["seed"],
                            progress_bar=False) for o in p["orders"]]
    return concat(*(per_model(pruning_metric(o, float(r.fraction_pruned)), float(r.loss))
                    for o, f in zip(p["orders"], frames) for r in f.itertuples()))


# ---- built-in: needs nothing but the model ------------------------------------------------------
def _loss(ctx: Context) -> pd.DataFrame:
    with torch.no_grad():
        losses = [float(ctx.model(batch, return_type="loss")) for batch in ctx.tokens.split(8)]
    sizes = [len(b) for b in ctx.tokens.split(8)]
    return per_model("loss", sum(l * n for l, n in zip(losses, sizes)) / sum(sizes))


ANALYSES: dict[str, Analysis] = {}


def register(analysis: Analysis) -> Analysis:
    ANALYSES[analysis.name] = analysis
    return analysis


for _kind in _DETECT_KINDS[:2]:
    register(Analysis(_kind, _detect(_kind), f"{_kind.replace('_', '-')} head scores (TransformerLens detect_head, "
                      "streaming) on the sweep data", MappingProxyType(dict(method="streaming"))))
register(Analysis("induction", _induction, "induction head scores (detect_head on the sweep data; Olsson et al. on "
                  "repeated random tokens) and the in-context-learning score", _INDUCTION))
register(Analysis("sinks", _sinks, "attention sinks (Gu et al. 2024): attention to the first token per head, "
                  "Sink rate per layer", _SINKS))
register(Analysis("ablation", _ablation, "loss increase when each head alone is ablated (exact; mean, zero and "
                  "resample ablation of the head's output z)", _ABLATION, expensive=True))
register(Analysis("importance", _importance, "Michel et al. head importance and the attribution-patching estimate of "
                  "mean ablation, with its correlation to the exact ablation", _IMPORTANCE, expensive=True))
register(Analysis("pruning", _pruning, "loss as heads are pruned cumulatively (Michel et al.), importance order vs "
                  "a random order", _PRUNING, expensive=True))
register(Analysis("loss", _loss, "mean next-token cross-entropy on the sweep data"))


def resolve_analyses(names: Sequence[str]) -> tuple[str, ...]:
    """Check analysis names against the registry (clear error listing the known ones)."""
    unknown = [n for n in names if n not in ANALYSES]
    if unknown:
        raise ValueError(f"unknown analyses {unknown}; choose from {sorted(ANALYSES)}")
    if not names:
        raise ValueError(f"no analyses chosen; choose from {sorted(ANALYSES)}")
    return tuple(names)
