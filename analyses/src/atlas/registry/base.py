"""What an analysis declares, once: `Analysis(name, run, metrics, section, ...)`.

`run` is the adapter a sweep calls per checkpoint: it takes a `Context` (one loaded checkpoint, the
sweep's tokens, a memo shared by the adapters of that checkpoint) and returns long rows `layer,
head, metric, value` (layer/head <NA> for per-model metrics); the sweep adds run/checkpoint/step.
`metrics` name what it returns, with their shape (per head, layer or model) and how the report
uses them (a heatmap at the last checkpoint, a curve across checkpoints, a headline fact).
`section` is its report section: an id, a title and `render(view) -> blocks` drawing its own plot.
The report iterates the registry; it knows nothing about any one analysis.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Callable, Literal, Mapping, Sequence

import pandas as pd
import torch
from torch import Tensor

from ...document import png
from ...store import NonFiniteResult, nonfinite_rows


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

    def pieces(self, max_len: int, max_seqs: int | None = None) -> Tensor:
        """The sweep's sequences cut into pieces of at most `max_len` tokens (the first `max_seqs`
        pieces), for an analysis that runs at its own length (`Analysis.max_len`). A sequence that
        starts with the model's BOS gives each piece that BOS followed by the next max_len - 1 tokens."""
        tokens = self.tokens
        if tokens.shape[1] <= max_len:
            return tokens[:max_seqs]
        bos = getattr(getattr(self.model, "tokenizer", None), "bos_token_id", None)
        has_bos = bos is not None and bool((tokens[:, 0] == bos).all())
        body = tokens[:, 1:] if has_bos else tokens
        width = max_len - has_bos
        n = body.shape[1] // width
        out = body[:, : n * width].reshape(-1, width)[:max_seqs]
        if has_bos:
            out = torch.cat([torch.full((len(out), 1), bos, dtype=out.dtype, device=out.device), out], 1)
        return out


@dataclass(frozen=True)
class Metric:
    name: str
    per: Literal["head", "layer", "model"]
    source: str  # how it is computed, for the docs and the report
    label: str = ""  # a figure's panel title; defaults to the name
    heatmap: bool = False  # a layer x head panel of the report's "head scores" figure
    curve: bool = False  # followed across checkpoints (best head) in the report's curves
    headline: bool = False  # its best head is named in the summary


@dataclass
class RunView:
    """What a report section sees: the results of one run and the sweep's settings."""

    run: str
    table: pd.DataFrame  # every row of the run
    last: pd.DataFrame  # rows of the last checkpoint that has each metric
    settings: dict
    prefix: str  # "run: " when a report has several runs, else ""
    slug: str  # file-name-safe run name, for figure names
    where: str  # "step N" or "the last checkpoint"
    log_steps: bool = False  # training-step axes on a symmetric-log scale (default linear)
    extras: dict = field(default_factory=dict)  # {analysis: its `extra` payload at the run's last checkpoint}

    def params(self, analysis: str) -> dict:
        return self.settings.get("params", {}).get(analysis, {})

    def figure(self, fig, name: str, caption: str = ""):
        return png(fig, f"{self.slug}_{name}.png", caption)


@dataclass(frozen=True)
class Output:
    """What an analysis returns when it has more than rows: `extra`, JSON kept beside its rows in the
    part file (the viewer's token sample and patterns), handed back to its report section as
    `RunView.extras[name]`. An analysis with rows only returns the DataFrame itself."""

    rows: pd.DataFrame
    extra: dict | None = None


def as_output(result: "pd.DataFrame | Output") -> Output:
    return result if isinstance(result, Output) else Output(result)


@dataclass(frozen=True)
class ReportSection:
    id: str  # the HTML anchor
    title: str
    render: Callable[[RunView], list]  # paragraphs (str), tables (DataFrame), images; None entries dropped


@dataclass(frozen=True)
class Analysis:
    name: str
    run: Callable[[Context], "pd.DataFrame | Output"]
    description: str
    params: Mapping = field(default_factory=lambda: MappingProxyType({}))
    expensive: bool = False  # a forward pass per head or more: by default on the last checkpoint only
    # Runs on pieces of at most this many tokens of the sweep's sequences (`Context.pieces`): an analysis
    # whose forwards are too many for long sequences. The sweep says so, in one line, when the data is longer.
    max_len: int | None = None
    # Needs interp's own implementation of the model (its weights, its KV cache), not only its hooks: a
    # wrapped model (`interp.models.wrapped`) skips it, and the sweep says so in one line.
    native_only: bool = False
    # Needs a backward pass (gradients through the model): refused on an offloaded model
    # (`interp.models.placement.offload`), whose layers are not all in memory for autograd to keep.
    gradients: bool = False
    # Reads interp's KV cache (decoding, a cache's windows): refused on a model split over several devices
    # (`interp.models.placement.device_map`), whose cache would have to live on one device.
    kv_cache: bool = False
    metrics: tuple[Metric, ...] = ()
    section: ReportSection | None = None  # its own section of the report
    # Sections only a sweep over several checkpoints has (figures across training), placed after the
    # report's head-score heatmaps; and facts for the summary's headline sentence (plain text; the
    # report escapes nothing in them, so they name no run).
    across: tuple[ReportSection, ...] = ()
    headline: Callable[[RunView], list[str]] | None = None


ANALYSES: dict[str, Analysis] = {}


def register(analysis: Analysis) -> Analysis:
    """Add an analysis; registration order is the order of the report's sections."""
    ANALYSES[analysis.name] = analysis
    return analysis


def metrics(where: Callable[[Metric], bool] = lambda m: True, analyses: Sequence[str] | None = None) -> list[Metric]:
    """Declared metrics (of the named analyses, in registry order) that satisfy `where`."""
    names = list(ANALYSES) if analyses is None else [a for a in ANALYSES if a in analyses]
    seen, out = set(), []
    for name in names:
        for m in ANALYSES[name].metrics:
            if where(m) and m.name not in seen:
                seen.add(m.name)
                out.append(m)
    return out


def resolve_analyses(names: Sequence[str]) -> tuple[str, ...]:
    """Check analysis names against the registry (clear error listing the known ones)."""
    unknown = [n for n in names if n not in ANALYSES]
    if unknown:
        raise ValueError(f"unknown analyses {unknown}; choose from {sorted(ANALYSES)}")
    if not names:
        raise ValueError(f"no analyses chosen; choose from {sorted(ANALYSES)}")
    return tuple(names)


# ---- long rows ---------------------------------------------------------------------------------
def rows(layer, head, metric, value) -> pd.DataFrame:
    """Long rows; scalars broadcast, None layer/head mean a per-model metric."""
    frame = pd.DataFrame({"layer": layer, "head": head, "metric": metric, "value": value},
                         index=None if isinstance(value, (list, tuple, pd.Series)) else [0])
    return frame.astype({"layer": "Int64", "head": "Int64", "metric": "string", "value": "float64"})


def per_head(frame: pd.DataFrame, column: str, metric: str) -> pd.DataFrame:
    """Rows for the per-head `column` of an analyzer frame [layer, head, ..., column]."""
    return rows(frame["layer"].tolist(), frame["head"].tolist(), metric, frame[column].astype(float).tolist())


def require_finite(frame: pd.DataFrame, column: str, metric: str, use: str) -> pd.DataFrame:
    """`frame` ([layer, head, ..., column]) when every `column` value is finite; else `NonFiniteResult`
    naming the heads. For numbers an analysis ranks or draws without returning them as rows (rows are
    checked by the sweep): a NaN sorts last, so a ranking would quietly pick the others."""
    bad = nonfinite_rows(frame.assign(metric=metric, value=frame[column]))
    if bad:
        raise NonFiniteResult(f"{metric} holds {len(bad)} non-finite value(s) ({', '.join(bad[:8])}), so {use} "
                              "would be meaningless: check the checkpoint's weights for NaN/inf")
    return frame


def model_rows(table: pd.DataFrame, metric: str) -> pd.DataFrame:
    """The rows of a per-model `metric` in a results table, in step order."""
    return table[(table["metric"] == metric) & table["layer"].isna()].sort_values("step")


def per_model(metric: str, value: float) -> pd.DataFrame:
    return rows(None, None, metric, float(value))


def concat(*frames: pd.DataFrame) -> pd.DataFrame:
    return pd.concat(frames, ignore_index=True)


def head_rows(last: pd.DataFrame, prefix: str) -> pd.DataFrame:
    """Per-head rows of `last` whose metric starts with `prefix`."""
    return last[last["metric"].str.startswith(prefix) & last["layer"].notna()]
