"""`interp extrapolate MODEL --out DIR`: a rotary model read past its trained context, as loaded and with RoPE
scalings; the heads that break, and a repair of those heads alone; an ALiBi model as loaded
(`interp.analyses.extrapolation.study`)."""

from __future__ import annotations

from . import checks
from .choices import EXTRAPOLATE_DEPTHS, EXTRAPOLATE_FACTOR, EXTRAPOLATE_REPAIR_FRACTION, EXTRAPOLATE_SCALINGS

HELP = "reading past the trained context: perplexity, passkey and every head at 1x-2x n_ctx per RoPE scaling"
EPILOG = """examples:
  interp extrapolate smollm2-135m --out out/s-extrapolate                 # 8,192, 12,288, 16,384 tokens
  interp extrapolate rope-gqa-4l --out out/past --depths 0.5               # the zoo's rotary model: 256-512 tokens
  interp extrapolate smollm2-135m --scalings none,yarn,yarn:4 --lengths 8192,32768 --out DIR
  interp extrapolate gemma3-270m --lengths 16384,32768,49152 --scalings none,yarn --out out/g-extrapolate
  interp extrapolate smollm2-135m --depths none --out out/s-heads   # no passkey: perplexity and the heads alone
  interp extrapolate alibi-gqa-4l --lengths 256,512,768,1024 --n-seqs 16 --out out/alibi   # ALiBi: as loaded
  interp extrapolate rope-gqa-4l --lengths 256,512,768,1024 --factor 4 --n-seqs 16 --out out/rope   # its twin

Per scaling ("none": the model as loaded; a bare type takes --factor; TYPE:FACTOR[:ORIGINAL_LEN] as
--rope-scaling spells it), one pass over the evaluation text (the Python Language Reference as interp
ships it; the zoo's held-out Python sources for its byte-level models) at the longest length gives
perplexity by position and every head's scores at every length (entropy, sink, distance and its
quantiles, previous-token, induction; the streaming statistics kernel, no n x n pattern); then
passkey prompts at every length and depth. Each head's share of q.k energy on
the rotary pairs that never complete a period within n_ctx is set against how much it changes past
n_ctx (Spearman over heads), and the heads that break most (at most --repair-fraction of them) get the
--repair scaling on their KV heads only, or LogN temperature, compared with the scaling on every head.
Writes perplexity, passkey, heads (.parquet and .csv), autopsy.parquet, settings.json and a report.
A model with ALiBi (or no) positions is read as loaded only (the zoo's alibi-gqa-4l beside its RoPE twin
rope-gqa-4l is the controlled case); learned or sinusoidal positions end at n_ctx and are refused. Lengths
past what memory holds are refused before loading.
"""


def add_arguments(p) -> None:
    p.add_argument("model", help="a model with rotary or ALiBi positions: real-model name, .gguf file, checkpoint "
                                 "folder, zoo name or run folder")
    g = p.add_argument_group("the study")
    g.add_argument("--lengths", default=None,
                   help="comma-separated lengths in tokens, one within n_ctx and one past it (default n_ctx, 1.5 n_ctx, "
                        "2 n_ctx)")
    g.add_argument("--scalings", default=None,
                   help=f"comma-separated: none (as loaded), linear, ntk, yarn, dynamic, llama3, or TYPE:FACTOR"
                        f"[:ORIGINAL_LEN] (default {','.join(EXTRAPOLATE_SCALINGS)} on RoPE; none on ALiBi)")
    g.add_argument("--factor", type=float, default=EXTRAPOLATE_FACTOR,
                   help=f"the factor of a bare scaling type (default {EXTRAPOLATE_FACTOR:g})")
    g.add_argument("--repair", default="auto",
                   help="the scaling put on the breaking heads' KV heads, one of --scalings (default yarn on RoPE, "
                        "none on ALiBi; off: no repair, and no LogN temperature either)")
    g.add_argument("--repair-fraction", type=float, default=EXTRAPOLATE_REPAIR_FRACTION,
                   help=f"the most heads a repair changes, a fraction of all (default and most "
                        f"{EXTRAPOLATE_REPAIR_FRACTION:g})")
    g.add_argument("--buckets", type=int, default=8, help="position buckets of the perplexity (default 8)")
    q = p.add_argument_group("passkey prompts")
    q.add_argument("--depths", default=",".join(f"{d:g}" for d in EXTRAPOLATE_DEPTHS),
                   help=f"needle depths in [0, 1], or none: no passkey (default "
                        f"{','.join(f'{d:g}' for d in EXTRAPOLATE_DEPTHS)})")
    q.add_argument("--prompts", type=int, default=1, help="prompts per (length, depth) (default 1)")
    q.add_argument("--seed", type=int, default=0, help="seed of the pass keys (default 0)")
    q.add_argument("--new-tokens", type=int, default=8, help="greedy tokens decoded per answer (default 8)")
    checks.add_text_data_options(p, "data (the text at the longest length)", "sequences of the text (default 1)")
    checks.add_output_options(p)


def run(args) -> int:
    from interp.analyses.extrapolation.study import ExtrapolateSettings, ExtrapolateStudy  # start-up time: torch
    from interp.analyses.study import StudyData
    from interp.analyses.data import DataSpec
    from interp.errors import as_user_errors
    from interp.models.runs.names import resolve_run

    with as_user_errors(ValueError, FileNotFoundError, ImportError):
        if args.rope_scaling is not None:
            raise ValueError("interp extrapolate compares RoPE scalings itself: list them in --scalings (none is the "
                             "model as loaded) and leave --rope-scaling out")
        lengths = None if args.lengths is None else tuple(checks.numbers(args.lengths, int, "--lengths"))
        scalings = None if args.scalings is None else checks.names(args.scalings)
        depths = () if args.depths.strip() == "none" else tuple(checks.numbers(args.depths, float, "--depths"))
        run_ = resolve_run(args.model, last_only=True)
    path = run_.checkpoints[-1].path
    args.model = run_.name  # the report's name: the run's, not its last checkpoint's folder

    def settings():
        from interp.models.formats.checkpoint import is_wrapped

        if is_wrapped(str(path)):  # per-head RoPE is interp's own transformer's
            raise ValueError(f"interp extrapolate rescales RoPE head by head, which only interp's own transformer does, "
                             f"and {args.model} is a model that transformers runs (wrapped)")
        kind = checks.data_kind(args, str(path))
        spec = DataSpec(kind="text" if kind == "repeated_random" else kind, n_seqs=args.n_seqs,
                        seq_len=max(4, max(lengths or (4,))), path=args.text_file)
        return ExtrapolateSettings(**checks.common(args), data=StudyData.of(spec), lengths=lengths, scalings=scalings,
                                   factor=args.factor, depths=depths, prompts=args.prompts, seed=args.seed,
                                   max_new_tokens=args.new_tokens, buckets=args.buckets,
                                   repair_scaling=None if args.repair in ("off", "none") else args.repair,
                                   repair_fraction=args.repair_fraction)

    return checks.run_command(ExtrapolateStudy(), args, settings, path=path)
