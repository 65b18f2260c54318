"""Analyses, one room per study: atlas/ (every head's scores over a run's checkpoints: the sweep, its
analyses, the report), circuits/, extrapolation/ (scores by length, past the trained context), kv/ (the
cache head by head). Here, what the rooms share: the Study shape (study.py), the output folder and its
tables (store.py), the data (data.py), documents and plots, and the analyzers: head detection,
induction, attention sinks, ablation, importance, pruning, composition.

Each analyzer takes a model and data and returns a tidy `pandas.DataFrame` (one row per layer/head/metric,
plus the settings that produced it); `plot_head_scores`, `plot_curve` and `plot_composition` draw
them. Published definitions are cited in each module's docstring.
"""

from .ablation import ablate_heads, ablation_values
from .composition import composition_matrix, composition_scores
from .detect import detect_head, detect_head_frame, detection_pattern
from .heads import detect_heads, icl_score, induction_scores, repeated_random_tokens
from .importance import attribution_correlation, head_importance
from interp.analyses.extrapolation.lengths import how_far, length_scores, role_changes, scores_by_length
from .plots import plot_composition, plot_curve, plot_head_scores
from .pruning import pruning_curve
from .sinks import attention_sinks, sink_rate
from .streaming import sliding_window, window_eval
from interp.models.readouts.head_statistics import (
    attention_logsumexp,
    attention_weights_at,
    for_each_layer_qk,
    kv_cache_attention_stats,
    model_attention_stats,
    stats_frame,
)

__all__ = [
    "ablate_heads",
    "ablation_values",
    "attention_logsumexp",
    "attention_sinks",
    "attention_weights_at",
    "attribution_correlation",
    "composition_matrix",
    "composition_scores",
    "detect_head",
    "detect_head_frame",
    "detect_heads",
    "detection_pattern",
    "for_each_layer_qk",
    "head_importance",
    "how_far",
    "icl_score",
    "induction_scores",
    "kv_cache_attention_stats",
    "length_scores",
    "model_attention_stats",
    "plot_composition",
    "plot_curve",
    "plot_head_scores",
    "pruning_curve",
    "repeated_random_tokens",
    "role_changes",
    "scores_by_length",
    "sink_rate",
    "sliding_window",
    "stats_frame",
    "window_eval",
]
