"""`interp sinks MODEL --out DIR`: where the attention sinks are, the massive activations, and which component
makes the first token a sink, by interventions (`interp.analyses.sink_origins.study.SinksStudy`)."""

from __future__ import annotations

from . import checks

# interp.analyses.sink_origins.interventions.INTERVENTIONS and MLP_LAYERS, here so that --help does not import torch
INTERVENTIONS = ("massive_dims", "massive_held", "query_bias", "early_mlp", "key_direction")
MLP_LAYERS = (0, 1, 2)
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
position; key_direction projects the first token's mean key direction out of its key. Writes heads,
massive, interventions (.parquet and .csv), intervention_layers.parquet, settings.json and a report.
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
    g.add_argument("--top-k", type=int, default=4, help="massive-activation rows per layer (default 4)")
    g.add_argument("--over-checkpoints", action="store_true",
                   help="MODEL is a training run (a zoo name or run folder): at every checkpoint, the share of sink "
                        "heads, the largest residual activation over its layer's median and the induction score on "
                        "the zoo's held-out text, and the step each first crosses its threshold (onset.csv, "
                        "onset_steps.csv, onset.png; analyses/src/sink_origins/onset.py); --n-seqs windows of the "
                        "model's context")
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
                             mlp_layers=layers, epsilon=args.epsilon, top_k=args.top_k)

    return checks.run_command(SinksStudy(), args, settings, path=path)


def _over_checkpoints(args) -> int:
    """`--over-checkpoints`: `sink_onset` over the run's checkpoints, its onset steps and figure, into --out."""
    from pathlib import Path

    from interp.errors import as_user_errors

    with as_user_errors(ValueError, FileNotFoundError):
        if not 0 <= args.epsilon <= 1:
            raise ValueError(f"--epsilon must be in [0, 1], got {args.epsilon}")
        if args.n_seqs < 1:
            raise ValueError(f"--n-seqs must be at least 1, got {args.n_seqs}")
        out = Path(args.out)
        if out.exists() and not out.is_dir():
            raise ValueError(f"--out {out} is a file, not a folder")
        from interp.analyses.sink_origins.onset import onset_steps, plot_onset, sink_onset
        from interp.models.runs.discover import discover

        discover(args.model)  # an unknown run in one line, before any model is loaded
    frame = sink_onset(args.model, n_seqs=args.n_seqs, epsilon=args.epsilon, progress=not args.no_progress)
    onsets = onset_steps(frame)
    out.mkdir(parents=True, exist_ok=True)
    frame.to_csv(out / "onset.csv", index=False)
    onsets.to_csv(out / "onset_steps.csv", index=False)
    plot_onset(frame).savefig(out / "onset.png", dpi=120)
    print(onsets.to_string(index=False))
    print(f"wrote {out / 'onset.csv'}, {out / 'onset_steps.csv'}, {out / 'onset.png'}")
    return 0
