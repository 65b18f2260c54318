"""`interp features MODEL --sae PATH --out DIR`: what an attention layer's heads move, read through a sparse
autoencoder on its output (`interp.analyses.features.study.FeaturesStudy`)."""

from __future__ import annotations

from . import checks
from .choices import DATA_SEED

# interp.analyses.features.study's defaults, here so that --help does not import torch
TOP_K, SHOWN, BATCH, SEQ_LEN, N_SEQS = 10, 16, 8, 128, 32

HELP = "what a head moves: an attention-output SAE's features split by head, their contexts and logit effects"
EPILOG = f"""examples:
  interp features attn-only-2l --sae path/to/sae --out out/features
  interp features gpt2 --sae path/to/blocks.5.attn.hook_z --n-seqs 256 --top-k 20 --out out/gpt2-l5
  interp features smollm2-135m --sae path/to/resid-sae --features 32 --out out/resid   # contexts and logits only

--sae is an SAE folder as SAELens saves it (cfg.json + sae_weights.safetensors; also Gemma Scope's params.npz and
EleutherAI sparsify's folders), its hook a layer's attention output blocks.L.attn.hook_z, read with the heads
flattened. One streamed pass over the text (the model fused up to that layer; the SAE's encode) gives each
feature's activity, its {TOP_K} (--top-k) max-activating contexts and each head's direct attribution to its
pre-activation, which splits exactly by head (Kissane et al. 2024); the decoder's norm on each head and each
feature's direct effect on the logits (through W_O and W_U) come from the weights. Writes features, decoder_norms,
attribution, head_features, contexts and logit_effects (.parquet, or .csv without pyarrow), settings.json and a
report with each head's top features and an offline view of the {SHOWN} (--features) features shown. An SAE on a
d_model-wide hook (hook_resid_pre / mid / post, hook_attn_out, hook_mlp_out) gets contexts and logit effects only;
a non-linear input normalisation on hook_z, a width that is not the model's, or a layer past it is refused in one
line before the model loads.
"""


def add_arguments(p) -> None:
    p.add_argument("model", help="a checkpoint folder, .gguf file, real-model name, zoo name or run folder (its last "
                                 "checkpoint)")
    g = p.add_argument_group("the study")
    g.add_argument("--sae", required=True, help="the SAE: a folder (cfg.json + sae_weights.safetensors) or file")
    g.add_argument("--top-k", type=int, default=TOP_K, help=f"max-activating contexts per feature (default {TOP_K})")
    g.add_argument("--features", type=int, default=SHOWN,
                   help=f"features the report shows: each head's top ones by attribution in turn (default {SHOWN})")
    g.add_argument("--batch-size", type=int, default=BATCH, help=f"sequences per forward (default {BATCH})")
    d = checks.add_text_data_options(p, "data (the text the features are read on)",
                                     f"sequences of the text (default {N_SEQS})")
    d.set_defaults(n_seqs=N_SEQS)
    d.add_argument("--seq-len", type=int, default=None,
                   help=f"tokens per sequence (default {SEQ_LEN}, or the model's context when shorter)")
    d.add_argument("--seed", type=int, default=DATA_SEED, help=f"which windows of the text (default {DATA_SEED})")
    checks.add_output_options(p)


def run(args) -> int:
    from interp.analyses.data import DataSpec  # start-up time: torch
    from interp.analyses.features.study import FeaturesSettings, FeaturesStudy
    from interp.analyses.study import StudyData
    from interp.errors import as_user_errors
    from interp.models.runs.names import resolve_run

    with as_user_errors(ValueError, FileNotFoundError, ImportError):
        run_ = resolve_run(args.model, last_only=True)
    path = run_.checkpoints[-1].path
    args.model = run_.name

    def settings():
        kind = checks.data_kind(args, path)
        spec = DataSpec(kind=kind, n_seqs=args.n_seqs, seq_len=SEQ_LEN if args.seq_len is None else args.seq_len,
                        seed=args.seed, path=str(args.text_file) if args.text_file else None)
        return FeaturesSettings(**checks.common(args), data=StudyData.of(spec, default_length=args.seq_len is None),
                                sae=args.sae, top_k=args.top_k, features=args.features, batch_size=args.batch_size)

    return checks.run_command(FeaturesStudy(), args, settings, path=path)
