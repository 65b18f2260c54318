"""Runs and checkpoints, one room: their types (`run_types`), a run folder's checkpoints (`discover`), and what a
name names (`names`: a path, the zoo, a real-model short name, a Hub repo id and revisions)."""

from .discover import *  # noqa: F401,F403 - `interp.models.runs` was discover's module: its names stay here
from .discover import __all__  # noqa: F401
