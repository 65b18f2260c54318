"""`interp demo`: a one-minute tour on a small random model (no downloads)."""

from __future__ import annotations

HELP = "a short offline demo: fused vs instrumented attention, a cached pattern, KV-cache generation"
EPILOG = """examples:
  interp demo
  interp demo --seq 256
"""


def add_arguments(p) -> None:
    p.add_argument("--seq", type=int, default=128, help="sequence length (default 128)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:1, mps ... (default: cuda when available)")


def run(args) -> int:
    import time

    import torch

    import interp  # start-up time: --help and argument errors never import torch
    from interp.models.placement.device import resolve_device

    device = resolve_device(args.device)  # one line naming the devices there are, before any work
    cfg = interp.ModelConfig(
        n_layers=4, d_model=128, n_heads=8, n_kv_heads=2, d_head=16, d_mlp=384, d_vocab=512, n_ctx=1024,
        act_fn="silu", gated_mlp=True, normalization="rmsnorm", positional="rotary",
        qkv_bias=False, attn_out_bias=False, mlp_bias=False,
    )
    model = interp.HookedTransformer(cfg, seed=args.seed).eval().to(device)
    print(model)
    g = torch.Generator().manual_seed(args.seed)
    half = torch.randint(0, cfg.d_vocab, (1, args.seq // 2), generator=g)
    tokens = torch.cat([half, half], dim=1).to(device)
    with torch.no_grad():
        t0 = time.perf_counter()
        fused = model(tokens)
        _sync(device)
        t1 = time.perf_counter()
        with model.attention("instrumented"):
            instrumented = model(tokens)
        _sync(device)
        t2 = time.perf_counter()
        _, cache = model.run_with_cache(tokens, names_filter=lambda n: n.endswith("hook_pattern"))
    print(f"fused forward {1e3 * (t1 - t0):.1f} ms, instrumented {1e3 * (t2 - t1):.1f} ms, "
          f"max |difference| {float((fused - instrumented).abs().max()):.2e}")
    pattern = cache["pattern", 0]
    print(f"cached {len(cache)} patterns, layer 0 shape {tuple(pattern.shape)}, rows sum to 1: "
          f"{bool(torch.allclose(pattern.sum(-1), torch.ones(())))}")
    out, kv = model.generate(tokens[:, :16], max_new_tokens=16, stop_at_eos=False, return_kv_cache=True)
    print(f"generated {out.shape[1] - 16} tokens through {kv}")
    return 0


def _sync(device) -> None:
    """Wait for the device's queued work, so the times printed are the work's (CUDA runs asynchronously)."""
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)
