"""Sink-free twins (issue 58, part 4): the zoo's softmax / learned-sink / gated-attention twins side by side.

    from interp.analyses.sink_origins.twins import twin_table
    table = twin_table(["sinks-softmax-4l", "sinks-learned-4l", "sinks-gated-4l"])

The twins (`interp.models.zoo.recipes.SINK_TWINS`) share recipe, data order, seed and every shared step-0 weight;
they differ only in attention: (a) softmax; (b) a learned sink logit per head in each softmax denominator
(gpt-oss style, `learned_sinks`); (c) a sigmoid gate on each head's output before W_O (gated attention,
Qiu et al. 2025, `attn_output_gate`); attn-only-2l also has (d) a softmax twin with no norm before attention
(`pre_norms=False`, the final norm kept: `attn-only-2l-no-prenorm`). Per twin (its last checkpoint), on held-out windows of the zoo's text:

* `sink_mass_max` / `sink_mass_mean` / `sink_share`: the first token's sink mass alpha_0 per head (max, mean,
  share of heads above epsilon = 0.3); `learned_share`: the learned sink's mean share of each row (twin b);
* `massive_ratio`: the largest |residual activation| over the layers, over its layer's median; `loss`;
* StreamingLLM (Xiao et al. 2023; `interp.models.kv.policies.Streaming`) at each window W with S = 4 sink
  tokens and S = 0 (`stream_loss_w{W}_s{S}`), and the full cache (`stream_loss_full`): the mean loss on the
  positions fed after a `prefix` prefill (`analyses.kv.policies.policy_perplexity`'s protocol), every window
  inside the trained context so positions are never new. `sink_gain_w{W}`: loss with S = 0 minus with S = 4
  (what the four kept sink tokens are worth).
"""

from __future__ import annotations

import math
from typing import Sequence

import pandas as pd
import torch

from .onset import EPSILON, checkpoint_row, heldout_windows
from interp.analyses.kv.policies import policy_perplexity, policy_runs

WINDOWS = (16, 32)
SINKS = (4, 0)


def streaming_losses(model, tokens: torch.Tensor, windows: Sequence[int] = WINDOWS, sinks: Sequence[int] = SINKS,
                     prefix: int = 16, chunk: int = 16) -> dict[str, float]:
    """{"stream_loss_full", "stream_loss_w{W}_s{S}"}: the mean loss (nats) over `tokens` [batch, pos], one
    sequence at a time, of the full cache and of StreamingLLM with S sinks and a window of W."""

    names = ["full"] + [f"streaming({s},{w})" for w in windows for s in sinks]
    runs = policy_runs(",".join(names))
    logs = {r.label: [] for r in runs}
    for row in tokens:
        got = policy_perplexity(model, row[None], runs, prefix=prefix, chunk=chunk, progress_bar=False)
        for label, (ppl, _) in got.items():
            logs[label].append(math.log(ppl))
    out = {"stream_loss_full": sum(logs[runs[0].label]) / len(tokens)}
    for r, name in zip(runs[1:], names[1:]):
        s, w = name[len("streaming("):-1].split(",")
        out[f"stream_loss_w{w}_s{s}"] = sum(logs[r.label]) / len(tokens)
    return out


def twin_row(model, tokens: torch.Tensor, stream_tokens: torch.Tensor, windows: Sequence[int] = WINDOWS,
             epsilon: float = EPSILON) -> dict:
    """One twin's numbers (module docstring) on `tokens` (sinks, massive, loss) and `stream_tokens` (streaming)."""
    row = checkpoint_row(model, tokens, epsilon)
    row.update(streaming_losses(model, stream_tokens, windows))
    for w in windows:
        row[f"sink_gain_w{w}"] = row[f"stream_loss_w{w}_s0"] - row[f"stream_loss_w{w}_s4"]
    return row


def twin_table(runs: Sequence[str], *, n_seqs: int = 8, n_stream: int = 8, windows: Sequence[int] = WINDOWS,
               step: int | None = None) -> pd.DataFrame:
    """One row per twin (a zoo name or run folder each): its last checkpoint (or the one at `step`), `twin_row`."""
    from interp.models.formats.checkpoint import load_checkpoint as load  # below interp.loading
    from interp.models.runs.discover import discover

    if not runs:
        raise ValueError("no twin runs given")
    found = [discover(r) for r in runs]  # every name checked before any model is loaded
    rows = []
    for spec, run in zip(runs, found):
        ckpts = [c for c in run.checkpoints if step is None or c.step == step]
        if not ckpts:
            raise ValueError(f"{spec}: no checkpoint at step {step}; it has {[c.step for c in run.checkpoints]}")
        c = ckpts[-1]
        model = load(c.path, dtype=torch.float32).eval()
        n = model.cfg.n_ctx
        if max(windows) + 4 >= n - 16:
            raise ValueError(f"windows {list(windows)} leave no evicted context within the {n}-token context")
        tokens = heldout_windows(n, n_seqs)
        stream = heldout_windows(n, n_stream, seed=2)
        attention = ("learned sink" if model.cfg.learned_sinks else
                     "gated" if getattr(model.cfg, "attn_output_gate", False) else
                     "softmax, no pre-norm" if not model.cfg.pre_norms else "softmax")
        rows.append(dict(run=run.name, attention=attention, step=c.step, **twin_row(model, tokens, stream, windows)))
    return pd.DataFrame(rows)


__all__ = ["SINKS", "WINDOWS", "streaming_losses", "twin_row", "twin_table"]
