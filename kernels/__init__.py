
from .stats import AttentionStats, attention_stats
