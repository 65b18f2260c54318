"""`interp sinks MODEL --out DIR`: where the attention sinks are, the massive activations, and which component
makes the first token a sink, by interventions (`interp.analyses.sink_origins.study.SinksStudy`)."""

from __future__ import annotations

from . import checks

# interp.analyses.sink_origins.interventions.INTERVENTIONS and MLP_LAYERS, here so that --help does not import torch
INTERVENTIONS = ("massive_dims", "massive_held", "query_bias", "early_mlp", "key_direction")
MLP_LAYERS = (0, 1, 2)
LEVEL_SITES = 6  # interp.analyses.sink_origins.levels.MAX_SITES
SEQ_LEN, N_SEQS = 256, 4

HELP = "attention sinks: where they sit, the massive activations, and which component makes them (interventions)"
EPILOG = f"""examples:
  interp sinks smollm2-135m --out out/s-sinks
  interp sinks gemma3-270m --out out/g-sinks --n-seqs 2
  interp sinks smollm2-135m --interventions massive_dims,key_direction --out out/s-sinks-2
  interp sinks smollm2-135m --mlp-layers 0,1,2,3 --seq-len 512 --out out/s-sinks-512
  interp sinks MODEL --offload disk --out out/big-sinks       # a model past memory, layer by layer
  interp sinks sinks-softmax-4l --over-checkpoints --out out/sink-onset   # when sinks form, over a run

Per head: the attention on the first token, on the first delimiter (the first newline, period, comma, ...
token) and on the largest other key (Gu et al.'s alpha, from the streaming statistics and each row's
log-sum-exp: no n x n pattern), which of them is the head's sink, and for gpt-oss the learned sink
logit's exact share. Per layer: the residual stream's largest activations (Sun et al. 2024's massive
activations: dimension, token, magnitude, ratio to the median |activation|). Then each intervention
({', '.join(INTERVENTIONS)}; default: every one the model has), each reporting the sink mass per layer
and the loss beside the unmodified model's: massive_dims zeroes the first token's massive dimensions
where each appears (massive_held: and after every later layer); query_bias removes the query bias
(refused for a model without one); early_mlp mean-ablates each MLP of --mlp-layers at the first
position; key_direction projects the first token's mean key direction out of its key. Sink levels:
every position some head of some layer puts >= --epsilon of its attention on (averaged over the
queries 4+ tokens past it), grouped by the token it holds, with the layer it forms at, its mass by
layer, and, for the --levels strongest, the attention layer or MLP before that layer whose output,
zeroed at those positions, removes it. Writes heads, massive, interventions, sink_levels,
sink_level_ablations (.parquet and .csv), intervention_layers.parquet, sink_level_layers.parquet,
settings.json and a report.
"""


def add_arguments(p) -> None:
    p.add_argument("model", help="a checkpoint folder, .gguf file, real-model name, zoo name or run folder")
    g = p.add_argument_group("the study")
    g.add_argument("--interventions", default=None,
                   help=f"comma-separated, of {', '.join(INTERVENTIONS)} (default: every one the model has)")
    g.add_argument("--mlp-layers", default=None,
                   help=f"the early MLPs early_mlp ablates, one at a time (default {','.join(map(str, MLP_LAYERS))})")
    g.add_argument("--epsilon", type=float, default=0.3,
                   help="a head is a sink head when its sink mass exceeds this share, in [0, 1] (default 0.3, "
                        "Gu et al.)")
    g.add_argument("--top-k", type=int, default=None, help="massive-activation rows per layer (default 4)")
    g.add_argument("--levels", type=int, default=None,
                   help=f"sink levels: trace what makes the N strongest sink sites, one forward per attention layer "
                        f"and MLP before each one's level (default {LEVEL_SITES}; 0: the sites and masses only)")
    g.add_argument("--over-checkpoints", action="store_true",
                   help="MODEL is a training run (a zoo name or run folder): at every checkpoint, the share of sink "
                        "heads, the largest residual activation over its layer's median and the induction score on "
                        "same text (the zoo's held-out text for a byte-level zoo run, else the Language Reference; "
                        "--text-file, --data-file, --seq-len and --n-seqs as for one model), and the step each first "
                        "crosses its threshold: onset.*, onset_steps.* and a report in --out, like every study "
                        "(analyses/src/sink_origins/onset_study.py)")
    checks.add_text_options(p, SEQ_LEN, "the text every pass reads")
    p.add_argument("--n-seqs", type=int, default=N_SEQS, help=f"sequences of the text (default {N_SEQS})")
    checks.add_output_options(p)


def run(args) -> int:
    if args.over_checkpoints:
        return _over_checkpoints(args)
    from interp.analyses.sink_origins.study import SinksSettings, SinksStudy  # start-up time: torch
    from interp.errors import as_user_errors
    from interp.models.runs.names import resolve_run

    with as_user_errors(ValueError, FileNotFoundError, ImportError):
        names = None if args.interventions is None else checks.names(args.interventions)
        layers = None if args.mlp_layers is None else tuple(checks.numbers(args.mlp_layers, int, "--mlp-layers"))
        run_ = resolve_run(args.model, last_only=True)
    path = run_.checkpoints[-1].path
    args.model = run_.name

    def settings():
        return SinksSettings(**checks.common(args), data=checks.text_data(args, SEQ_LEN), interventions=names,
                             mlp_layers=layers, epsilon=args.epsilon, top_k=4 if args.top_k is None else args.top_k,
                             levels=LEVEL_SITES if args.levels is None else args.levels)

    return checks.run_command(SinksStudy(), args, settings, path=path)


def _over_checkpoints(args) -> int:
    """`--over-checkpoints`: the onset study (`interp.analyses.sink_origins.onset_study.OnsetStudy`) over the run's
    checkpoints, through the one output folder like every study. Every option is honoured or refused in one line."""
    from interp.analyses.sink_origins.onset_study import OnsetSettings, OnsetStudy  # start-up time: torch
    from interp.errors import as_user_errors
    from interp.models.runs.names import resolve_run

    with as_user_errors(ValueError, FileNotFoundError, ImportError):
        unused = [flag for flag, value in (("--interventions", args.interventions), ("--mlp-layers", args.mlp_layers),
                                           ("--top-k", args.top_k), ("--levels", args.levels))
                  if value is not None]
        if unused:
            raise ValueError(f"{', '.join(unused)} belong to the interventions of one model, which --over-checkpoints "
                             "does not run: leave them out (the onset reads the sink-head share, the largest "
                             "activation, induction and loss at every checkpoint)")
        run_ = resolve_run(args.model)
        stepped = sorted((c for c in run_.checkpoints if c.step is not None), key=lambda c: c.step)
        if len(stepped) < 2:
            raise ValueError(f"{args.model} has {len(stepped)} checkpoint(s) that name their step: --over-checkpoints "
                             "reads a training run (a zoo name or a run folder of step_XXXXX checkpoints)")
        path = stepped[-1].path
        args.model = run_.name

    def settings():
        return OnsetSettings(**checks.common(args), data=_onset_data(args, path), run=run_.name,
                             checkpoints=tuple(stepped), epsilon=args.epsilon)

    return checks.run_command(OnsetStudy(), args, settings, path=path)


def _onset_data(args, path: str):
    """The tokens every checkpoint reads: --data-file's ids, --text-file's text, or by default the zoo's held-out
    text for a run with the zoo's byte tokenizer (windows of its context, seed 1: the numbers docs/atlas.md gives)
    and the Language Reference for any other tokenizer; a model without one is refused on text, as `interp sinks`
    refuses it."""
    from interp.analyses.data import DataSpec, resolve_kind
    from interp.analyses.study import StudyData

    if args.data_file or args.text_file:
        return checks.text_data(args, SEQ_LEN, rows=args.n_seqs)
    kind = "corpus" if resolve_kind("auto", [path]) == "corpus" else "text"
    spec = DataSpec(kind=kind, n_seqs=args.n_seqs, seq_len=SEQ_LEN if args.seq_len is None else args.seq_len, seed=1)
    return StudyData.of(spec, default_length=args.seq_len is None)
