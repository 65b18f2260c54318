"""The analyses a sweep or `interp analyze` can run: one file per analysis, one `register` call each.

An entry declares its adapter (checkpoint -> long rows), its metrics and their shape, its
parameters (recorded in settings.json, so a sweep folder says how its numbers were made), whether
it is expensive (a forward pass per head or more: the last checkpoint of each run unless the sweep
says `expensive_on="all"`), and its report section with its plot. To add an analysis, add a file
here and import it below; the report and the CLI pick it up. An analysis returns its rows (a
DataFrame), or `Output(rows, extra)` when it keeps JSON beside them (the viewer); its sections are
its own (`section`, and `across` for figures over training), as are its headline facts. The metric table:
`python -c "from interp.analyses.atlas.registry import metric_table; print(metric_table())"`.
"""

from __future__ import annotations

from .base import (
    ANALYSES,
    Analysis,
    Context,
    Metric,
    Output,
    ReportSection,
    RunView,
    as_output,
    concat,
    metrics,
    per_head,
    per_model,
    register,
    resolve_analyses,
    rows,
)

# registration order is the report's section order
from . import detection, induction, sinks, viewer, streaming, composition, ablation, pruning, importance, loss, retrieval  # noqa: E402,F401  isort: skip
from .pruning import parse_pruning_metric, pruning_metric  # noqa: E402


def metric_table() -> str:
    """Every declared metric: analysis, metric, per, source (Markdown)."""
    lines = ["| analysis | metric | per | source |", "|---|---|---|---|"]
    lines += [f"| {a.name} | {m.name} | {m.per} | {m.source} |" for a in ANALYSES.values() for m in a.metrics]
    return "\n".join(lines)


__all__ = ["ANALYSES", "Analysis", "Context", "Metric", "Output", "ReportSection", "RunView", "as_output", "concat",
           "metric_table",
           "metrics", "parse_pruning_metric", "per_head", "per_model", "pruning_metric", "register",
           "resolve_analyses", "rows"]
