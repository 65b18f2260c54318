"""`interp generate MODEL PROMPT`: continue a prompt, on any device, and say how fast: a native model through
interp's KV cache (under a cache policy if asked), a wrapped one through transformers' own generate (with
interp's attention; a cache policy is refused in one line)."""

from __future__ import annotations
from .checks import add_offload_option, placement_of

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
    p.add_argument("--temperature", type=float, default=None, help="with --sample (default 1.0)")
    p.add_argument("--top-k", type=int, default=None, help="with --sample: keep the k most likely tokens")
    p.add_argument("--top-p", type=float, default=None, help="with --sample: nucleus mass in (0, 1]")
    p.add_argument("--seed", type=int, default=None, help="with --sample: the sampling seed (default 0)")
    p.add_argument("--kv-policy", default=None,
                   help="decode through a per-head cache policy (interp's own models; a wrapped one refuses it): "
                        "full, kivi4, int8, streaming(4,128), h2o(256), ...")
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:1, mps ... (default: cuda when available)")

    add_offload_option(p)


def run(args) -> int:
    import time

    import torch

    import interp  # start-up time: --help and argument errors never import torch
    from interp.models import Sampling
    from interp.errors import BadValue, check_int, check_real
    from interp.models.kv.policies import parse_policy

    # Every setting checked before the model loads: one line each.
    check_int("max_new_tokens", args.max_new_tokens, minimum=1)
    if args.seed is not None:
        check_int("seed", args.seed, minimum=0)
    if args.temperature is not None:
        check_real("temperature", args.temperature, minimum=0.0, strict=True)
    if args.top_k is not None:
        check_int("top_k", args.top_k, minimum=1)
    if args.top_p is not None and not 0.0 < check_real("top_p", args.top_p) <= 1.0:
        raise BadValue(f"top_p must be in (0, 1], got {args.top_p}")
    unused = [flag for flag, value in (("--temperature", args.temperature), ("--top-k", args.top_k),
                                       ("--top-p", args.top_p), ("--seed", args.seed)) if value is not None]
    if unused and not args.sample:  # greedy decoding reads none of them: refused, not dropped
        raise BadValue(f"{' and '.join(unused)} {'applies' if len(unused) == 1 else 'apply'} to sampling, and "
                       "decoding is greedy without --sample: add --sample")
    if not args.prompt:
        raise BadValue("the prompt is empty: give some text to continue")
    if args.kv_policy is not None:
        try:
            parse_policy(args.kv_policy)
        except ValueError as e:
            raise BadValue(str(e)) from None
    from interp.loading import resolve  # start-up time: --help and argument errors never import torch
    from interp.models.formats.checkpoint import check_placement, read_config

    placement = placement_of(args)
    if placement.device_map is not None:
        target = resolve(args.model)
        cfg = read_config(target)
        check_placement(target, placement, cfg=cfg)  # wrapped: refused
        placement.refuse_split(cfg, "generation reads interp's KV cache, which holds every layer's keys on one device")
    model = interp.load(args.model, **placement.resolved().keywords())
    device = model.device
    if model.tokenizer is None:
        raise BadValue(f"{args.model} has no tokenizer, so it cannot read a text prompt")
    tokens, shown = _prompt_tokens(model, args.prompt, args.max_new_tokens)
    sampling = Sampling(do_sample=args.sample, temperature=1.0 if args.temperature is None else args.temperature,
                        top_k=args.top_k, top_p=args.top_p,
                        seed=(args.seed or 0) if args.sample else None)
    start = time.perf_counter()
    with torch.no_grad():  # a wrapped model: transformers' own generate through interp's attention
        out = model.generate(tokens, args.max_new_tokens, sampling, policy=args.kv_policy)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - start
    new = out[0, tokens.shape[1]:]
    print(shown + model.to_string(new))
    print(f"\n[{len(new)} new tokens in {seconds:.2f} s ({len(new) / seconds:.1f} tokens/s, prefill included) on "
          f"{device}; {'sampled' if args.sample else 'greedy'}"
          + (f", KV policy {args.kv_policy}" if args.kv_policy else "") + "]")
    return 0


def _prompt_tokens(model, prompt: str, max_new_tokens: int):
    """(token ids [1, pos], the prompt's text as the model reads it) for a prompt and the new tokens, within the
    model's context. A prompt that fits is never cut: when the new tokens do not fit after it, refused, naming a
    --max-new-tokens that fits. A prompt that alone fills the context is cut to its first tokens, leaving room
    for the new ones, and said in one note line (as `to_tokens` cuts a text to n_ctx; before, unsaid)."""
    from interp.errors import BadValue

    n_ctx = model.cfg.n_ctx
    tokens = model.to_tokens(prompt, truncate=False)
    length = tokens.shape[1]
    if length + max_new_tokens <= n_ctx:
        return tokens, prompt
    if length < n_ctx:
        raise BadValue(f"the prompt ({length} tokens) plus {max_new_tokens} new tokens is longer than this model's "
                       f"context (n_ctx={n_ctx}): use --max-new-tokens {n_ctx - length} or fewer, or a shorter prompt")
    if max_new_tokens >= n_ctx:
        raise BadValue(f"the prompt ({length} tokens) is longer than this model's context (n_ctx={n_ctx}), and "
                       f"--max-new-tokens {max_new_tokens} leaves no room for any of it: use --max-new-tokens "
                       f"{n_ctx - 1} or fewer (the prompt is then cut to fit)")
    keep = n_ctx - max_new_tokens
    bos = length - model.to_tokens(prompt, prepend_bos=False, truncate=False).shape[1]  # 1 when BOS was prepended
    print(f"note: the prompt is {length} tokens, more than this model's context (n_ctx={n_ctx}) holds: cut to its "
          f"first {keep} tokens, leaving room for --max-new-tokens {max_new_tokens}")
    tokens = tokens[:, :keep]
    return tokens, model.to_string(tokens[0, min(bos, keep):])
