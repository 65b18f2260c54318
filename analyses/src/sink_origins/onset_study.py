"""`interp sinks RUN --over-checkpoints`: when the sinks form, as a study of its own (`OnsetStudy`).

Every checkpoint of a training run, on the same tokens, gives `onset.checkpoint_row`'s numbers (the sink-head share,
the largest head sink mass, the largest residual activation over its layer's median, the best induction score, the
loss); `onset.onset_steps` reads the step at which each first crosses its threshold. The run's last checkpoint is
the model the command loads (with the command's --device, --offload and --rope-scaling); every other checkpoint is
loaded the same way in turn. A checkpoint that cannot be loaded is skipped and named (table `skipped`, the
report), as a sweep skips one; the study fails only when fewer than two are left.

It writes through the one output folder (`study.run`): claimed in the manifest, under the lock, atomically, never
through a link, and never into a folder holding someone else's files or another study's results.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import pandas as pd

from interp.errors import UserError
from interp.models.formats.checkpoint import load_checkpoint  # below interp.loading
from interp.models.zoo.run_types import Checkpoint

from .._common import progress
from ..document import Section, png
from ..study import Measured, Study, StudySettings, Table
from .onset import EPSILON, ONSET_THRESHOLDS, checkpoint_row, onset_steps, plot_onset
from .study import check_sink_settings

ROW_COLUMNS = ("run", "checkpoint", "step", "sink_share", "sink_mass_max", "sink_mass_mean", "massive_ratio",
               "massive_value", "induction", "loss")


@dataclass(frozen=True, kw_only=True, eq=False)
class OnsetSettings(StudySettings):
    """run: the run's name; checkpoints: its checkpoints in step order (the last is the model `run` is given);
    epsilon: a sink head's threshold (Gu et al.), in [0, 1]."""

    run: str = ""
    checkpoints: tuple[Checkpoint, ...] = ()
    epsilon: float = EPSILON


@dataclass(frozen=True, kw_only=True, eq=False)
class OnsetMeasured(Measured):
    """Beside the tables: the figure's data is the onset table itself; nothing else."""


class OnsetStudy(Study):
    """`interp sinks RUN --over-checkpoints`: see the module docstring."""

    name = "sink-onset"
    title = "When the attention sinks form"
    tables = (Table("onset", ROW_COLUMNS, csv=True), Table("onset_steps", ("series", "threshold", "onset_step"), csv=True),
              Table("skipped", ("checkpoint", "step", "reason"), optional=True, csv=True))
    one_device = "loads every checkpoint of the run in turn"

    def check(self, cfg, s: OnsetSettings):
        stepped = [c for c in s.checkpoints if c.step is not None]
        if len(stepped) < 2:
            raise ValueError(f"{s.run} has {len(stepped)} checkpoint(s) that name their step: --over-checkpoints reads "
                             "a training run (a zoo name or a run folder of step_XXXXX checkpoints)")
        data, note = check_sink_settings(cfg, s)
        s = dataclasses.replace(s, data=data, checkpoints=tuple(sorted(stepped, key=lambda c: c.step)))
        return s, [note] if note else []

    def measure(self, model, s: OnsetSettings, stage):
        tokens = s.data.tokens(model)  # the run's tokenizer (its last checkpoint's), or refused in one line
        rope = model.cfg.rope_scaling if model.runtime.rope_chosen else None
        last = s.checkpoints[-1]
        placed = dataclasses.replace(s.placement, device=model.device)  # every checkpoint where the last one runs
        rows, skipped = [], []

        def every_checkpoint():
            for c in progress(s.checkpoints, desc="checkpoints", enabled=s.progress):
                try:
                    m = model if c is last else load_checkpoint(c.path, rope_scaling=rope, placement=placed)
                except UserError as e:  # a damaged or NaN checkpoint: skipped and named, as a sweep does
                    skipped.append(dict(checkpoint=c.name, step=c.step, reason=str(e)))
                    continue
                m.eval()
                rows.append(dict(run=s.run, checkpoint=c.name, step=c.step, **checkpoint_row(m, tokens, s.epsilon)))

        stage("every checkpoint: sinks, massive activations, induction, loss", every_checkpoint)
        if len(rows) < 2:
            raise UserError(f"only {len(rows)} of {s.run}'s {len(s.checkpoints)} checkpoints could be read ("
                            + "; ".join(f"{k['checkpoint']}: {k['reason']}" for k in skipped[:2])
                            + "): an onset needs at least two")
        frame = pd.DataFrame(rows)
        tables = {"onset": frame, "onset_steps": onset_steps(frame)}
        if skipped:
            tables["skipped"] = pd.DataFrame(skipped)
        return OnsetMeasured(tables=tables)

    def record(self, s: OnsetSettings, m: OnsetMeasured) -> dict:
        steps = m["onset_steps"]
        return {"run": s.run, "epsilon": s.epsilon, "n_sequences": s.data.rows, "seq_len": s.data.length,
                "checkpoints": [c.name for c in s.checkpoints],
                "skipped": [] if m.get("skipped") is None else m["skipped"]["checkpoint"].tolist(),
                "thresholds": dict(ONSET_THRESHOLDS),
                "onset_step": {r.series: None if pd.isna(r.onset_step) else int(r.onset_step)
                               for r in steps.itertuples()}}

    def sections(self, s: OnsetSettings, m: OnsetMeasured, record) -> list[Section]:
        frame, steps = m["onset"], m["onset_steps"]
        said = [f"{r.series} reaches {r.threshold:g} at step {int(r.onset_step)}" if not pd.isna(r.onset_step)
                else f"{r.series} never reaches {r.threshold:g}" for r in steps.itertuples()]
        out = Section("summary", "Summary").add(
            f"{s.run}: {len(frame)} checkpoints (steps {int(frame['step'].min())}-{int(frame['step'].max())}), each on "
            f"the same {record['n_sequences']} sequence(s) of {record['seq_len']} tokens. A sink head puts more than "
            f"{s.epsilon:g} of its attention on the first token (Gu et al. 2024).",
            "; ".join(said) + ".", steps, png(plot_onset(frame), "onset", "by step; dashed: each series' threshold"))
        skipped = m.get("skipped")
        if skipped is not None:
            out.add(f"{len(skipped)} checkpoint(s) could not be read and are left out:", skipped)
        return [out, Section("checkpoints", "Every checkpoint").add(frame.round(5))]

    def files(self) -> str:
        return "report.md, onset.*, onset_steps.*, and skipped.* if a checkpoint could not be read"


__all__ = ["OnsetSettings", "OnsetStudy"]
