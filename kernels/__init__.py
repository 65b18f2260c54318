
from .stats import AttentionStats, attention_stats, resolve_backend
