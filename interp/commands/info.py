"""`interp info MODEL`: the config, parameter count, KV-cache and FLOP figures of a model, and whether
interp runs it natively or wrapped; `interp info --architectures`: which causal LMs run, and how."""

from __future__ import annotations
from .checks import add_offload_option, placement_of

HELP = "show a model's config, how interp runs it, parameter count, KV-cache bytes and FLOPs per token"
EPILOG = """examples:
  interp info path/to/checkpoint
  interp info path/to/checkpoint --context 2048
  interp info --architectures          # which causal LMs interp runs: native, wrapped or refused
"""


def add_arguments(p) -> None:
    p.add_argument("model", nargs="?", default=None,
                   help="a checkpoint directory (ours or Hugging Face), a .gguf file, a zoo or real-model name")
    p.add_argument("--context", type=int, default=None,
                   help="context length for the FLOP figures (default: the model's own n_ctx)")

    add_offload_option(p)
    p.add_argument("--architectures", action="store_true",
                   help="list the causal LMs interp runs (native, wrapped through transformers, or refused), "
                        "and count every causal LM of the installed transformers")


def run(args) -> int:
    from interp.errors import UserError, check_int

    if args.architectures:
        from interp.models.wrapped import architecture_table, every_causal_lm

        print(architecture_table(), flush=True)
        try:
            counts = every_causal_lm()
        except ImportError:
            print("transformers is not installed: only the native families run (pip install 'interp[hf]' to wrap "
                  "the rest)")
            return 0
        import transformers

        n = {k: len(v) for k, v in counts.items()}
        print(f"\nEvery causal LM of transformers {transformers.__version__}: {sum(n.values())} model types; "
              f"{n['native']} native, {n['wrapped']} wrapped (each built on the meta device from its default config "
              f"and checked), {n['refused']} refused, {n['unchecked']} unchecked (default config does not build here).")
        print(f"  refused: {', '.join(counts['refused'])}")
        return 0
    if args.model is None:
        raise UserError("interp info needs a MODEL (a checkpoint folder, .gguf file, zoo or real-model name), or "
                        "--architectures")
    import interp  # start-up time: --help and argument errors never import torch

    if args.context is not None:
        check_int("context", args.context, minimum=1)  # before the model is loaded

    model = interp.load(args.model, **placement_of(args).keywords())
    cfg = model.cfg
    print(model)
    if model.offload is not None:
        print(f"offloaded              {model.offload.describe()}")
    if getattr(model, "device_map", None) is not None:
        from interp.models.placement.device_map import describe

        print(f"device map             {describe(model.device_map)}")
    if getattr(model, "native", True):
        print(f"runs                   natively: interp's own transformer ({cfg.model_type})")
    else:
        from interp.models.wrapped import native_families

        print(f"runs                   wrapped: transformers' {type(model.hf).__name__} runs it, through interp's "
              f"attention function (model_type {cfg.model_type!r} has no native family; native: "
              f"{', '.join(native_families())})")
    if getattr(model, "native", True):
        print(f"parameters             {cfg.n_params():,}")
    else:
        print(f"parameters             {sum(p.numel() for p in model.hf.parameters()):,}")
    print(f"KV cache per token     {cfg.kv_cache_bytes_per_token(model.dtype.itemsize):,} bytes ({model.dtype})")
    context = args.context or cfg.n_ctx
    flops = cfg.flops_per_token(context)
    print(f"FLOPs per token @ {context:<6} " + ", ".join(f"{k} {v / 1e6:,.2f}M" for k, v in flops.items()))
    for k, v in cfg.to_dict().items():
        print(f"  {k:20s} {v}")
    return 0
