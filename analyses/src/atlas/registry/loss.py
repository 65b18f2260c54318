"""loss: mean next-token cross-entropy on the sweep data (needs nothing but the model)."""

from __future__ import annotations

import pandas as pd
import torch

from .base import Analysis, Context, Metric, per_model, register


def run(ctx: Context) -> pd.DataFrame:
    with torch.no_grad():
        losses = [float(ctx.model(batch, return_type="loss")) for batch in ctx.tokens.split(8)]
    sizes = [len(b) for b in ctx.tokens.split(8)]
    return per_model("loss", sum(l * n for l, n in zip(losses, sizes)) / sum(sizes))


register(Analysis("loss", run, "mean next-token cross-entropy on the sweep data",
                  metrics=(Metric("loss", "model", "mean next-token cross-entropy on the sweep data"),)))
