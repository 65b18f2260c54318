"""`interp analyze MODEL --out DIR`: every analysis of one model, and its report (a sweep of one checkpoint)."""

from __future__ import annotations

HELP = "the head atlas of one model: head scores, sinks, StreamingLLM, composition, pruning, and its report"
EPILOG = """examples:
  interp analyze smollm2-135m --out out/smollm2        # real text: the Python Language Reference
  interp analyze smollm2-135m --out out/s --text-file my.txt
  interp analyze attn-only-2l --out out/one
  interp analyze path/to/checkpoint --out out/ckpt --analyses induction,sinks,ablation
  interp analyze path/to/hf-checkpoint --out out/hf --data repeated_random --seq-len 128
  interp analyze gemma3-270m --out out/g32k --seq-len 32768 --n-seqs 1 --analyses previous_token,induction,sinks
  interp analyze smollm2-135m --out out/by-length --lengths 1024,2048,4096,8192     # scores by context length

Same options, outputs and resumption as `interp sweep` (a sweep of a single checkpoint); MODEL is a
real-model name, a .gguf file, a Hugging Face repo id or checkpoint folder, or a zoo name or run
folder (its last checkpoint). Add ablation,importance to --analyses for exact per-head ablation (a
forward per head: minutes on a 270-head model).

Long context: every head score streams (no n x n pattern at any length), sliding-window layers run
in bands, and a length is checked before loading: past the model's trained context only with
--extrapolate, and one the memory cannot hold is refused with the longest that fits. With
--lengths, the command scores every head at each length instead (sink, previous-token,
duplicate-token, induction, attention distance and its quantiles, entropy) on the first L tokens of
the same text: DIR/lengths.parquet and .csv (length, layer, head, metric, value, extrapolated),
settings.json and a report naming the heads whose role changes most, and how far each kind of
layer looks.
"""


def add_arguments(p) -> None:
    from .sweep import add_sweep_options

    p.add_argument("model", help="a checkpoint folder (ours or Hugging Face), or a zoo name or run folder (its last checkpoint)")
    from .choices import ATLAS_ANALYSES

    add_sweep_options(p, ATLAS_ANALYSES)
    p.add_argument("--lengths", default=None,
                   help="comma-separated context lengths, e.g. 1024,4096,8192: score every head at each length (the "
                        "scores-by-length study) instead of the atlas")


def run(args) -> int:
    if args.lengths:
        return run_lengths(args)
    from .sweep import run_sweep

    return run_sweep(args, [args.model], last_only=True)


def run_lengths(args) -> int:
    """interp analyze MODEL --lengths ...: everything checked (lengths, context, memory, the output
    folder, the data) before the model loads."""
    import time

    from interp.models.errors import as_user_errors

    with as_user_errors(ValueError, FileNotFoundError, ImportError):
        from interp.analyses.lengths import check_lengths, run_length_study
        from interp.analyses.store import OutputFolder
        from interp.analyses.sweep_data import DataSpec, build_tokens, check_data, data_source, resolve_kind
        from interp.models.device import resolve_device
        from interp.models.formats.checkpoint import read_config
        from interp.models.memory import check_fits
        from interp.models.runs.names import resolve_run
        from .kv import _numbers

        from .choices import ATLAS_ANALYSES

        if args.seq_len is not None:
            raise ValueError("--lengths sets the lengths (the longest is the sequences' length): drop --seq-len")
        if args.analyses != ",".join(ATLAS_ANALYSES):
            raise ValueError("--lengths runs the scores-by-length study (sinks, previous-token, duplicate-token, "
                             "induction, distance, entropy at each length), not the atlas's analyses: drop --analyses")
        if args.data_file:
            raise ValueError("--lengths reads text (--text-file, default the Python Language Reference) or the zoo "
                             "corpus, not --data-file")
        lengths = _numbers(args.lengths, int, "--lengths")
        device = resolve_device(args.device)
        run = resolve_run(args.model, last_only=True)
        path = run.checkpoints[-1].path
        cfg = read_config(str(path))
        lengths = check_lengths(lengths, cfg.n_ctx, extrapolate=args.extrapolate)
        n_seqs = 1 if args.n_seqs is None else args.n_seqs
        check_fits(cfg, n_seqs, lengths[-1], device, what="--lengths")
        kind = args.data
        if kind == "auto":
            kind = "text" if args.text_file else resolve_kind("auto", [path])
        if kind not in ("text", "corpus"):
            raise ValueError(f"--lengths needs text or the zoo corpus (scores on the same text at every length); "
                             f"--data {kind} is not that")
        spec = DataSpec(kind=kind, n_seqs=n_seqs, seq_len=lengths[-1], seed=args.seed,
                        path=str(args.text_file) if args.text_file else None)
        check_data(spec)
        OutputFolder(args.out).check()

    from interp.models.formats import checkpoint

    start = time.perf_counter()
    model = checkpoint.load_checkpoint(path, device=str(device))
    with as_user_errors(ValueError):
        tokens = build_tokens(spec, model).to(model.device)
        report = run_length_study(model, args.out, tokens, lengths, name=run.name, data_description=spec.describe(),
                                  data_source=data_source(spec), progress_bar=False if args.no_progress else None,
                                  extrapolate=args.extrapolate)
    print(f"done in {time.perf_counter() - start:.0f} s; report: {report} (and report.md, lengths.parquet, lengths.csv)")
    return 0
