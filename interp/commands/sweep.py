"""`interp sweep RUN [RUN ...] --out DIR`: analyses over every checkpoint of training runs, resumably."""

from __future__ import annotations

from pathlib import Path

from .choices import ANALYSES, DATA_KINDS, DATA_N_SEQS, DATA_SEED, DATA_SEQ_LEN, EXECUTOR_KINDS, ROPE_SCALING_HELP
from .choices import DEFAULT_ANALYSES as SWEEP_DEFAULT
from .checks import add_offload_option, placement_of

HELP = "run head analyses over every checkpoint of training runs (resumable; local processes or Ray)"
EPILOG = """examples:
  interp sweep attn-only-2l --out out/attn-only-2l
  interp sweep runs/my-run runs/pythia-70m-revisions --analyses induction,sinks --out out/cmp
  interp sweep attn-only-2l --out out/x --executor local --workers 2
  interp sweep attn-only-2l --out out/x --executor ray                      # starts a local Ray cluster
  interp sweep runs/big --out out/big --executor ray --ray-address auto     # joins `ray start --head`
  interp sweep attn-only-2l --out out/x --data repeated_random --seq-len 128 --n-seqs 32
  interp sweep EleutherAI/pythia-70m --revisions step0:143000:13000 --data repeated_random --out out/pythia

A RUN is a zoo name, a run folder (run.json or checkpoint sub-folders, ours or Hugging Face, e.g.
step1000/ step2000/ ...), or one checkpoint folder. Rerunning with the same --out resumes: finished
(checkpoint, analysis) pairs are kept, the rest (and earlier errors) are run. Results:
DIR/results.parquet and .csv (run, checkpoint, step, analysis, layer, head, metric, value),
DIR/settings.json, DIR/errors.json, DIR/report.html and DIR/report.md. A --seq-len left out is 256,
or the shortest trained context of the models when that is shorter (said in one line); one asked
for past a model's context needs --extrapolate. Ablation, pruning and
importance (a forward pass per head, or more) run on the last checkpoint of each run unless
--expensive-on all. Exit status: 0; 1 when a checkpoint or an analysis failed (listed in the
summary and errors.json, skipped, retried by the next run; NaN or inf in an analysis's numbers is
such a failure, never a result); 2 for bad arguments, settings that differ from those already in
DIR, or a DIR that cannot be used: a file, a folder you cannot write to, a non-empty folder interp
did not create, or one another sweep is writing to. interp lists what it writes in
DIR/.interp-manifest.json and never writes over or (with --force) removes anything else.
"""


def add_sweep_options(p, default_analyses=None) -> None:
    """Options shared by `interp sweep` and `interp analyze` (names from `choices`: no torch import)."""
    DEFAULT_ANALYSES = default_analyses or SWEEP_DEFAULT
    p.add_argument("--out", required=True,
                   help="output folder (created; an existing sweep folder is resumed; a non-empty folder interp did "
                        "not create is refused)")
    p.add_argument("--analyses", default=",".join(DEFAULT_ANALYSES),
                   help=f"comma-separated, from: {', '.join(ANALYSES)} (default: {','.join(DEFAULT_ANALYSES)})")
    p.set_defaults(default_analyses=",".join(DEFAULT_ANALYSES))  # told apart from an explicit --analyses
    p.add_argument("--expensive-on", choices=("last", "all"), default="last",
                   help="run ablation, pruning and importance on the last checkpoint of each run only (default), "
                        "or on all")
    data = p.add_argument_group("data (identical for every checkpoint)")
    data.add_argument("--data", choices=DATA_KINDS, default="auto",
                      help="auto: held-out zoo corpus windows for byte-level zoo models, real text (--text-file, default "
                           "the Python Language Reference) for models with a real tokenizer, else repeated random tokens")
    data.add_argument("--data-file", default=None, help="token ids (.pt or .npy) for --data file")
    data.add_argument("--text-file", default=None,
                      help="a UTF-8 text file for --data text (default text: the Python Language Reference, "
                           "pydoc_data.topics, which ships with Python)")
    data.add_argument("--n-seqs", type=int, default=None, help=f"sequences (default {DATA_N_SEQS})")
    data.add_argument("--seq-len", type=int, default=None,
                      help=f"tokens per sequence (default {DATA_SEQ_LEN}, or the shortest context of the models when "
                           "shorter)")
    data.add_argument("--seed", type=int, default=DATA_SEED, help=f"data seed (default {DATA_SEED})")
    data.add_argument("--extrapolate", action="store_true",
                      help="allow --seq-len past the model's trained context (n_ctx); the report marks those numbers "
                           "as extrapolated")
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:1 ... (default: cuda when available)")

    add_offload_option(p)
    p.add_argument("--rope-scaling", default=None, metavar="TYPE:FACTOR", help=ROPE_SCALING_HELP)
    p.add_argument("--force", action="store_true",
                   help="discard the results interp wrote in --out (e.g. computed with other settings); files interp "
                        "did not write are never touched")
    p.add_argument("--no-report", action="store_true", help="skip writing report.html / report.md")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def add_arguments(p) -> None:
    p.add_argument("runs", nargs="+", metavar="RUN",
                   help="zoo name, run folder, checkpoint folder, .gguf file, real-model name, or Hugging Face repo id")
    p.add_argument("--revisions", default=None,
                   help="with one Hugging Face repo id: the revisions to sweep, e.g. step1000,step2000, a range "
                        "step0:143000:1000 (stop inclusive), or @file with one per line")
    add_sweep_options(p)
    ex = p.add_argument_group("execution")
    ex.add_argument("--executor", choices=EXECUTOR_KINDS, default="local",
                    help="local: this machine (default); ray: a Ray cluster, one task per checkpoint")
    ex.add_argument("--workers", type=int, default=None,
                    help="local: worker processes (default 1 = in this process); ray: CPUs of the local cluster "
                         "started when no --ray-address is given (default: all cores)")
    ex.add_argument("--ray-address", default=None, help="'auto' or host:port of a running Ray cluster")


def settings_from_args(args):
    """The sweep's settings from the command line, checked (by `SweepSettings`, data included) before
    any name is resolved or model loaded."""
    from interp.analyses.atlas.registry import resolve_analyses  # CLI start-up time: interp.analyses imports torch
    from interp.analyses.atlas.sweep import SweepSettings  # CLI start-up time
    from interp.analyses.data import DataSpec  # CLI start-up time

    if args.data_file and args.text_file:
        raise ValueError("give --data-file (token ids) or --text-file (text), not both")
    given = args.data_file or args.text_file
    path = str(Path(given).resolve()) if given else None
    kind = args.data
    if kind == "auto" and path:
        kind = "file" if args.data_file else "text"
    n_seqs = DATA_N_SEQS if args.n_seqs is None else args.n_seqs
    seq_len = DATA_SEQ_LEN if args.seq_len is None else args.seq_len
    data = DataSpec(kind=kind, n_seqs=n_seqs, seq_len=seq_len, seed=args.seed, path=path)
    analyses = resolve_analyses(tuple(a.strip() for a in args.analyses.split(",") if a.strip()))
    placement = placement_of(args)  # refused before any analysis is left out for it
    if args.offload is not None and args.analyses == args.default_analyses:  # the defaults: what runs offloaded
        from interp.analyses.atlas.registry import ANALYSES

        dropped = [a for a in analyses if ANALYSES[a].gradients]
        analyses = tuple(a for a in analyses if a not in dropped)
        if dropped:
            print(f"--offload {args.offload}: leaving out {', '.join(dropped)} (gradients through the model; run them "
                  "without --offload)")
    if args.device_map is not None and args.analyses == args.default_analyses:  # the defaults: what runs split
        from interp.analyses.atlas.registry import ANALYSES

        dropped = [a for a in analyses if ANALYSES[a].kv_cache]
        if dropped and placement.may_split():
            analyses = tuple(a for a in analyses if a not in dropped)
            print(f"--device-map {args.device_map}: leaving out {', '.join(dropped)} (interp's KV cache, which holds "
                  "every layer on one device; run them on one device)")
    return SweepSettings(analyses=analyses, data=data, expensive_on=args.expensive_on, device=args.device,
                         offload=args.offload, device_map=args.device_map, extrapolate=args.extrapolate,
                         rope_scaling=args.rope_scaling)


def fit_default_length(settings, runs):
    """The default --seq-len, fitted to the shortest trained context of `runs` (their last checkpoints' configs,
    read without weights), said in one line; a length that was asked for is checked by the sweep instead."""
    import dataclasses

    from interp.analyses.study import fit_note  # CLI start-up time
    from interp.models.formats.checkpoint import read_config  # CLI start-up time

    if settings.data.kind == "file":
        return settings
    contexts = []
    for run in runs:
        try:
            contexts.append(read_config(str(run.checkpoints[-1].path)).n_ctx)
        except Exception:  # noqa: BLE001 - an unreadable config is the sweep's to report, per checkpoint
            continue
    if not contexts or min(contexts) >= settings.data.seq_len:
        return settings
    print(fit_note("--seq-len", settings.data.seq_len, min(contexts), min(contexts)))
    return dataclasses.replace(settings, data=dataclasses.replace(settings.data, seq_len=min(contexts)))


def run_sweep(args, runs, executor=None, last_only: bool = False) -> int:
    from interp.analyses.atlas.sweep import SettingsMismatch, sweep  # CLI start-up time: interp.analyses imports torch
    from interp.errors import as_user_errors  # CLI start-up time: interp.models imports torch
    from interp.models.runs.names import resolve_run  # CLI start-up time

    with as_user_errors(SettingsMismatch, ValueError, FileNotFoundError, ImportError):  # printed by interp.cli
        settings = settings_from_args(args)
        revisions = getattr(args, "revisions", None)  # with --revisions every RUN is a Hub repo id
        runs = [resolve_run(r, revisions=revisions, last_only=last_only) for r in runs]
        if args.seq_len is None:
            settings = fit_default_length(settings, runs)
        result = sweep(runs, args.out, settings, executor, force=args.force, last_only=last_only,
                       progress=not args.no_progress, report=not args.no_report)
    return 1 if result.errors else 0


def run(args) -> int:
    from interp.analyses.atlas.executors import ExecutorSettings  # CLI start-up time: interp.analyses imports torch
    from interp.errors import as_user_errors  # CLI start-up time: interp.models imports torch

    with as_user_errors(ValueError):
        executor = ExecutorSettings(kind=args.executor, workers=args.workers, ray_address=args.ray_address)
    return run_sweep(args, args.runs, executor)
