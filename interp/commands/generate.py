"""`interp generate MODEL PROMPT`: continue a prompt, on any device, and say how fast: a native model through
interp's KV cache (under a cache policy if asked), a wrapped one through transformers' own generate (with
interp's attention; a cache policy is refused in one line)."""

from __future__ import annotations

HELP = "continue a prompt (greedy or sampled) through the KV cache, optionally under a cache policy; tokens/s"
EPILOG = """examples:
  interp generate smollm2-135m "The capital of France is"
  interp generate smollm2-135m "def fib(n):" --max-new-tokens 64 --device cuda
  interp generate gemma3-270m "Once upon a time" --sample --temperature 0.8 --top-p 0.95 --seed 1
  interp generate smollm2-135m "A long story: ..." --kv-policy "streaming(4,128)"
"""


def add_arguments(p) -> None:
    p.add_argument("model", help="a zoo or real-model name, a .gguf file, a checkpoint folder or a Hub repo id")
    p.add_argument("prompt", help="the text to continue (BOS is added as the model's tokenizer does)")
    p.add_argument("--max-new-tokens", type=int, default=40, help="tokens to generate at most (default 40)")
    p.add_argument("--sample", action="store_true", help="sample (default: greedy)")
    p.add_argument("--temperature", type=float, default=1.0, help="with --sample (default 1.0)")
    p.add_argument("--top-k", type=int, default=None, help="with --sample: keep the k most likely tokens")
    p.add_argument("--top-p", type=float, default=None, help="with --sample: nucleus mass in (0, 1]")
    p.add_argument("--seed", type=int, default=0, help="with --sample: the sampling seed (default 0)")
    p.add_argument("--kv-policy", default=None,
                   help="decode through a per-head cache policy (interp's own models; a wrapped one refuses it): "
                        "full, kivi4, int8, streaming(4,128), h2o(256), ...")
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:1, mps ... (default: cuda when available)")
    from .checks import add_offload_option

    add_offload_option(p)


def run(args) -> int:
    import time

    import torch

    import interp
    from interp.models import Sampling
    from interp.errors import BadValue, check_int, check_real
    from interp.models.kv.policies import parse_policy

    # Every setting checked before the model loads: one line each.
    check_int("max_new_tokens", args.max_new_tokens, minimum=1)
    check_int("seed", args.seed, minimum=0)
    check_real("temperature", args.temperature, minimum=0.0, strict=True)
    if args.top_k is not None:
        check_int("top_k", args.top_k, minimum=1)
    if args.top_p is not None and not 0.0 < check_real("top_p", args.top_p) <= 1.0:
        raise BadValue(f"top_p must be in (0, 1], got {args.top_p}")
    if not args.prompt:
        raise BadValue("the prompt is empty: give some text to continue")
    if args.kv_policy is not None:
        try:
            parse_policy(args.kv_policy)
        except ValueError as e:
            raise BadValue(str(e)) from None
    from interp.loading import resolve
    from interp.models.device_map import DeviceMapRefused, is_split, resolve_device_map
    from interp.models.formats.checkpoint import read_config
    from .checks import device_map_of, load_device

    device_map = device_map_of(args)
    if device_map is not None:
        target = resolve(args.model)
        device_map_of(args, path=target)  # wrapped: refused
        if is_split(resolve_device_map(device_map, read_config(target), device=args.device)):
            raise DeviceMapRefused("--device-map over several devices: generation reads interp's KV cache, which holds "
                                   "every layer's keys on one device; generate on one device (--device)")
    device = load_device(args, device_map)
    model = interp.load(args.model, device=device, offload=args.offload, device_map=device_map)
    device = model.device
    if model.tokenizer is None:
        raise BadValue(f"{args.model} has no tokenizer, so it cannot read a text prompt")
    tokens = model.to_tokens(args.prompt)
    if tokens.shape[1] + args.max_new_tokens > model.cfg.n_ctx:
        raise BadValue(f"the prompt ({tokens.shape[1]} tokens) plus {args.max_new_tokens} new tokens is longer than "
                       f"this model's context (n_ctx={model.cfg.n_ctx}): use --max-new-tokens "
                       f"{max(1, model.cfg.n_ctx - tokens.shape[1])} or a shorter prompt")
    sampling = Sampling(do_sample=args.sample, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                        seed=args.seed if args.sample else None)
    start = time.perf_counter()
    with torch.no_grad():  # a wrapped model: transformers' own generate through interp's attention
        out = model.generate(tokens, args.max_new_tokens, sampling, policy=args.kv_policy)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - start
    new = out[0, tokens.shape[1]:]
    print(args.prompt + model.to_string(new))
    print(f"\n[{len(new)} new tokens in {seconds:.2f} s ({len(new) / seconds:.1f} tokens/s, prefill included) on "
          f"{device}; {'sampled' if args.sample else 'greedy'}"
          + (f", KV policy {args.kv_policy}" if args.kv_policy else "") + "]")
    return 0
