"""Tiny training runs on disk for the sweep, report and Ray tests (random-init checkpoints, no downloads)."""

from __future__ import annotations

import dataclasses
from collections import Counter
from pathlib import Path

import interp
from interp.analyses.atlas import registry
from interp.analyses.atlas.sweep import SweepSettings
from interp.analyses.data import DataSpec

CFG = interp.ModelConfig(n_layers=2, d_model=24, n_heads=3, d_vocab=29, n_ctx=64, d_mlp=None)
STEPS = (0, 50, 200)  # written out of order below, so ordering by step is tested too
DATA = DataSpec(kind="repeated_random", n_seqs=4, seq_len=24, seed=3)
CHEAP = ("previous_token", "induction", "sinks", "loss", "ablation")


def make_run(root: Path, steps=STEPS, cfg=CFG, name: str = "run") -> Path:
    """A run folder of our checkpoints `step<N>/` (config.json, model.safetensors, meta.json)."""
    run = root / name
    for i, step in enumerate(sorted(steps, reverse=True)):
        model = interp.HookedTransformer(cfg, seed=100 + step)
        interp.save_model(model, run / f"step{step}", meta={"step": step, "tokens": step * 96, "loss": 3.0 - i / 10})
    return run


def settings(analyses=CHEAP, expensive_on="all", data=DATA) -> SweepSettings:
    return SweepSettings(analyses=tuple(analyses), data=data, expensive_on=expensive_on)


def count_calls(monkeypatch) -> Counter:
    """Wrap every registered analysis so calls are counted per (checkpoint path, analysis)."""
    calls: Counter = Counter()
    for name, analysis in list(registry.ANALYSES.items()):
        def counted(ctx, _run=analysis.run, _name=name):
            calls[(ctx.checkpoint.name, _name)] += 1
            return _run(ctx)

        monkeypatch.setitem(registry.ANALYSES, name, dataclasses.replace(analysis, run=counted))
    return calls

