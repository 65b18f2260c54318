"""`interp lengths MODEL --lengths 1024,4096,8192 --out DIR`: every head's scores at each context length
(`interp.analyses.extrapolation.lengths.LengthStudy`)."""

from __future__ import annotations

from . import checks
from .choices import DATA_SEED

HELP = "head scores by context length: sinks, previous-token, induction, attention distance at each length"
EPILOG = """examples:
  interp lengths smollm2-135m --lengths 1024,2048,4096,8192 --out out/s-lengths
  interp lengths gemma3-270m --lengths 1024,4096,8192,16384,32768 --out out/g-lengths
  interp lengths rope-gqa-4l --lengths 64,128,320 --extrapolate --out out/past   # past n_ctx: marked extrapolated

Scores every head (sink, previous-token, duplicate-token, induction, attention distance and its
quantiles, entropy) on the first L tokens of the same text at each length, with the streaming
statistics kernel (no n x n pattern at any length): DIR/lengths.parquet and .csv (length, layer,
head, metric, value, extrapolated), settings.json and a report naming the heads whose role changes
most, and how far each kind of layer looks. A length past the model's trained context needs
--extrapolate; one the memory cannot hold is refused with the longest that fits, before loading.
"""


def add_arguments(p) -> None:

    p.add_argument("model", help="a checkpoint folder (ours or Hugging Face), .gguf file, real-model name, zoo name or "
                                 "run folder (its last checkpoint)")
    g = p.add_argument_group("the study")
    g.add_argument("--lengths", required=True, help="comma-separated context lengths, e.g. 1024,4096,8192")
    g.add_argument("--extrapolate", action="store_true",
                   help="allow lengths past the model's trained context (n_ctx); marked extrapolated")
    d = checks.add_text_data_options(p, "data (the same text at every length)", "sequences (default 1)")
    d.add_argument("--seed", type=int, default=DATA_SEED, help=f"which windows of the text (default {DATA_SEED})")
    checks.add_output_options(p)


def run(args) -> int:
    from interp.analyses.extrapolation.lengths import LengthSettings, LengthStudy  # start-up time: torch
    from interp.analyses.study import StudyData
    from interp.analyses.data import DataSpec
    from interp.errors import as_user_errors
    from interp.models.runs.names import resolve_run

    with as_user_errors(ValueError, FileNotFoundError, ImportError):
        lengths = tuple(checks.numbers(args.lengths, int, "--lengths"))
        run_ = resolve_run(args.model, last_only=True)
    path = run_.checkpoints[-1].path
    args.model = run_.name  # the report's name: the run's, not its last checkpoint's folder

    def settings():
        kind = checks.data_kind(args, path)  # checked by LengthStudy.check
        spec = DataSpec(kind=kind, n_seqs=args.n_seqs, seq_len=max(max(lengths), 4), seed=args.seed,
                        path=str(args.text_file) if args.text_file else None)
        return LengthSettings(**checks.common(args), data=StudyData.of(spec), lengths=lengths,
                              extrapolate=args.extrapolate)

    return checks.run_command(LengthStudy(), args, settings, path=path)
