
from .stats import AttentionStats, Scoring, attention_stats, resolve_backend
