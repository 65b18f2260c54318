"""When attention sinks form (issue 58, part 3): the sinks study's numbers at every checkpoint of a training run.

    from interp.analyses.sink_origins.onset import sink_onset, onset_steps
    frame = sink_onset("models/src/zoo/rope-sinks-4l")     # one row per checkpoint
    onset_steps(frame)                                   # the step each series first crosses its threshold

Per checkpoint, on held-out windows of the zoo's text (`<bos>` + a held-out stdlib file's bytes; the shipped
`evaldata.heldout_docs()`), one `measure.sink_pass`:

* `sink_share`: the share of heads whose first-token sink mass alpha_0 exceeds `epsilon` (0.3, Gu et al. 2024);
  `sink_mass_max` / `sink_mass_mean` over heads; `learned_share`: the mean learned sink share (gpt-oss style
  models only);
* `massive_ratio`: the largest |residual activation| over every layer (resid_post), as a ratio to that layer's
  median |activation| (Sun et al. 2024 call an activation massive at >= 1000 x the median and > 100);
  `massive_value`: that activation's magnitude;
* `induction`: the best induction score (`analyses.heads.induction_scores`, Olsson et al. 2022) over heads
  outside layer 0; `loss`: the mean loss on the windows.

`onset_steps` reads a series' onset: the first step at which it reaches its threshold (`ONSET_THRESHOLDS`).
"""

from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np
import pandas as pd
import torch
from interp.analyses.evaldata import heldout_docs
from interp.analyses.heads import induction_scores
from .measure import delimiter_ids, sink_pass, token_kinds

EPSILON = 0.3  # a sink head: first-token sink mass above this (Gu et al. 2024)
# The threshold each series' onset is read at: the first sink head (a head's first-token mass reaches epsilon);
# a quarter of the heads are sink heads; the largest activation is 100 x its layer's median (a tenth of Sun et
# al.'s 1000: our small models stay far below theirs); an induction head attends 0.3 to the induction token.
ONSET_THRESHOLDS: dict[str, float] = {"sink_mass_max": EPSILON, "sink_share": 0.25, "massive_ratio": 100.0,
                                      "induction": 0.3}


def onset_step(steps: Sequence[int], values: Sequence[float], threshold: float) -> int | None:
    """The first step whose value reaches `threshold` (>=), or None when none does. NaNs never cross."""
    if len(steps) != len(values):
        raise ValueError(f"steps ({len(steps)}) and values ({len(values)}) differ in length")
    order = np.argsort(np.asarray(steps), kind="stable")
    for i in order:
        v = values[i]
        if v is not None and not np.isnan(v) and v >= threshold:
            return int(steps[i])
    return None


def onset_steps(frame: pd.DataFrame, thresholds: Mapping[str, float] | None = None) -> pd.DataFrame:
    """One row per series of `frame` (a `sink_onset` frame): its threshold and onset step (None: never)."""
    thresholds = dict(ONSET_THRESHOLDS if thresholds is None else thresholds)
    missing = [k for k in thresholds if k not in frame.columns]
    if missing:
        raise ValueError(f"the frame has no column {missing}; it has {list(frame.columns)}")
    rows = [dict(series=k, threshold=t, onset_step=onset_step(frame["step"].tolist(), frame[k].tolist(), t))
            for k, t in thresholds.items()]
    frame = pd.DataFrame(rows)
    frame["onset_step"] = frame["onset_step"].astype("Int64")  # <NA>: never
    return frame


def heldout_windows(n_ctx: int, n: int, seed: int = 1) -> torch.Tensor:
    """`n` windows `<bos>` + a held-out stdlib file's bytes (the zoo's held-out text, shipped), long [n, n_ctx]."""
    from interp.models.zoo.training import eval_windows

    return eval_windows(heldout_docs(), n_ctx, n, seed=seed)


@torch.no_grad()
def checkpoint_row(model, tokens: torch.Tensor, epsilon: float = EPSILON, induction_len: int = 50) -> dict:
    """The onset numbers of one model on `tokens` [batch, pos] (see the module docstring)."""


    kinds, first_delim = token_kinds(tokens, delimiter_ids(model, tokens))
    res = sink_pass(model, tokens, kinds, first_delim, reference=True, top_k=1)
    first = res.heads["first"].float()  # [layer, head]
    ratios = [(r["ratio"], r["magnitude"]) for r in res.massive]
    ratio, value = max(ratios) if ratios else (float("nan"), float("nan"))
    ind = induction_scores(model, seq_len=induction_len, batch_size=8)
    ind = ind[(ind.kind == "induction") & ((ind.layer > 0) | (model.cfg.n_layers == 1))]
    row = dict(sink_share=float((first > epsilon).float().mean()), sink_mass_max=float(first.max()),
               sink_mass_mean=float(first.mean()), massive_ratio=float(ratio), massive_value=float(value),
               induction=float(ind.score.max()), loss=res.loss)
    if "learned" in res.heads:
        row["learned_share"] = float(res.heads["learned"].float().mean())
    return row


def sink_onset(run: str, *, steps: Sequence[int] | None = None, n_seqs: int = 8, seq_len: int | None = None,
               epsilon: float = EPSILON, progress: bool = False) -> pd.DataFrame:
    """The sinks, massive activations and induction at every checkpoint of `run` (a zoo name or run folder;
    `interp.models.runs.discover`), one row per checkpoint: run, checkpoint, step and `checkpoint_row`'s
    numbers. `steps`: only these steps; `n_seqs` windows of `seq_len` tokens (default the model's n_ctx)."""
    from interp.models.formats.checkpoint import load_checkpoint as load  # below interp.loading
    from interp.models.runs.discover import discover

    if not 0 <= epsilon <= 1:
        raise ValueError(f"epsilon must be in [0, 1], got {epsilon}")
    found = discover(run)
    ckpts = [c for c in found.checkpoints if steps is None or c.step in set(steps)]
    if not ckpts:
        raise ValueError(f"run {run!r} has no checkpoint at steps {list(steps or [])}; it has "
                         f"{[c.step for c in found.checkpoints]}")
    rows, tokens = [], None
    for c in ckpts:
        model = load(c.path, dtype=torch.float32)
        model.eval()
        if tokens is None:
            tokens = heldout_windows(seq_len or model.cfg.n_ctx, n_seqs)
        rows.append(dict(run=found.name, checkpoint=c.name, step=c.step, **checkpoint_row(model, tokens, epsilon)))
        if progress:
            print(f"{c.name}: " + ", ".join(f"{k} {v:.3g}" for k, v in rows[-1].items() if isinstance(v, float)))
    return pd.DataFrame(rows)


def plot_onset(frame: pd.DataFrame, thresholds: Mapping[str, float] | None = None, title: str = ""):
    """Step on x; the largest head sink mass, the sink-head share, the induction score (left axis, [0, 1]) and the
    massive ratio (right axis, log), each threshold dashed."""
    import matplotlib.pyplot as plt

    thresholds = dict(ONSET_THRESHOLDS if thresholds is None else thresholds)
    fig, ax = plt.subplots(figsize=(7, 4))
    x = frame["step"]
    for key, color in (("sink_mass_max", "C1"), ("sink_share", "C0"), ("induction", "C2")):
        ax.plot(x, frame[key], "o-", color=color, label=key)
        ax.axhline(thresholds[key], color=color, ls="--", lw=0.8)
    ax.set_xlabel("step")
    ax.set_ylabel("sink mass / share of heads / score")
    ax.set_ylim(0, 1)
    ax2 = ax.twinx()
    ax2.plot(x, frame["massive_ratio"], "s-", color="C3", label="massive ratio")
    ax2.axhline(thresholds["massive_ratio"], color="C3", ls="--", lw=0.8)
    ax2.set_yscale("log")
    ax2.set_ylabel("largest |activation| / median")
    lines = ax.get_lines()[::2] + ax2.get_lines()[:1]
    ax.legend(lines, [l.get_label() for l in lines], loc="upper left")
    ax.set_title(title or f"when sinks form: {frame['run'].iloc[0]}")
    fig.tight_layout()
    return fig


__all__ = ["EPSILON", "ONSET_THRESHOLDS", "checkpoint_row", "heldout_windows", "onset_step", "onset_steps",
           "plot_onset", "sink_onset"]
