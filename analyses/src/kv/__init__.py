"""The KV-cache studies, one room: what precision costs (`precision`, its study `precision_study`), what per-head
policies cost (`policies`), head roles that choose them (`roles`, `roles_study`, DuoAttention's `gates`), and the
retrieval prompts they are measured on (`tasks`)."""

from .precision import *  # noqa: F401,F403 - `interp.analyses.kv` was precision's module: its names stay here
