"""`interp info MODEL`: the config, parameter count, KV-cache and FLOP figures of a model."""

from __future__ import annotations

HELP = "show a model's config, parameter count, KV-cache bytes per token and FLOPs per token"
EPILOG = """examples:
  interp info path/to/checkpoint
  interp info path/to/checkpoint --context 2048
"""


def add_arguments(p) -> None:
    p.add_argument("model", help="a checkpoint directory (ours or Hugging Face), a .gguf file, a zoo or real-model name")
    p.add_argument("--context", type=int, default=None,
                   help="context length for the FLOP figures (default: the model's own n_ctx)")


def run(args) -> int:
    import interp
    from interp.models.errors import check_int

    if args.context is not None:
        check_int("context", args.context, minimum=1)  # before the model is loaded
    model = interp.load(args.model)
    cfg = model.cfg
    print(model)
    print(f"parameters             {cfg.n_params():,}")
    print(f"KV cache per token     {cfg.kv_cache_bytes_per_token(model.dtype.itemsize):,} bytes ({model.dtype})")
    context = args.context or cfg.n_ctx
    flops = cfg.flops_per_token(context)
    print(f"FLOPs per token @ {context:<6} " + ", ".join(f"{k} {v / 1e6:,.2f}M" for k, v in flops.items()))
    for k, v in cfg.to_dict().items():
        print(f"  {k:20s} {v}")
    return 0
