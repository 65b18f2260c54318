"""Analyses, one room per study: atlas/ (every head's scores over a run's checkpoints: the sweep, its
analyses, the report), circuits/, extrapolation/ (scores by length, past the trained context), kv/ (the
cache head by head). Here, what the rooms share: the Study shape (study.py), the output folder and its
tables (store.py), the data (data.py), documents and plots, and the analyzers: head detection,
induction, attention sinks, ablation, importance, pruning, composition.

Each analyzer takes a model and data and returns a tidy `pandas.DataFrame` (one row per layer/head/metric,
plus the settings that produced it); `plot_head_scores`, `plot_curve` and `plot_composition` draw
them. Published definitions are cited in each module's docstring.

This face is thin: its names are imported on first use (PEP 562), so `import interp.analyses.circuits.choices`
(what the CLI's `--help` reads) loads no analyzer, torch or pandas.
"""

from __future__ import annotations

from ._faces import lazy_face

_LAZY = {  # name -> the module that defines it (relative to this package, or absolute)
    "ablate_heads": ".ablation",
    "ablation_values": ".ablation",
    "composition_matrix": ".composition",
    "composition_scores": ".composition",
    "detect_head": ".detect",
    "detect_head_frame": ".detect",
    "detection_pattern": ".detect",
    "detect_heads": ".heads",
    "icl_score": ".heads",
    "induction_scores": ".heads",
    "repeated_random_tokens": ".heads",
    "attribution_correlation": ".importance",
    "head_importance": ".importance",
    "how_far": "interp.analyses.extrapolation.lengths",
    "length_scores": "interp.analyses.extrapolation.lengths",
    "role_changes": "interp.analyses.extrapolation.lengths",
    "scores_by_length": "interp.analyses.extrapolation.lengths",
    "plot_composition": ".plots",
    "plot_curve": ".plots",
    "plot_head_scores": ".plots",
    "pruning_curve": ".pruning",
    "attention_sinks": ".sinks",
    "sink_rate": ".sinks",
    "sliding_window": ".streaming",
    "window_eval": ".streaming",
    "attention_logsumexp": "interp.models.readouts.head_statistics",
    "attention_rows": "interp.models.readouts.head_statistics",
    "attention_weights_at": "interp.models.readouts.head_statistics",
    "for_each_layer_qk": "interp.models.readouts.head_statistics",
    "kv_cache_attention_stats": "interp.models.readouts.head_statistics",
    "model_attention_stats": "interp.models.readouts.head_statistics",
    "stats_frame": "interp.models.readouts.head_statistics",
}

__all__ = sorted(_LAZY)


__getattr__, __dir__ = lazy_face(__name__, _LAZY)
