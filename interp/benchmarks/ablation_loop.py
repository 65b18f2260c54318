"""Benchmark: the exact head-ablation sweep (`ablate_heads`) against the obvious loop.

The loop runs one full forward per head with a hook on `blocks.L.attn.hook_z` that replaces that
head's z. `ablate_heads` runs one clean forward caching the residual stream, then one forward per
layer that starts at that layer, with the batch replicated once per head. Both use the same
ablation values, so their numbers must agree (the table reports the largest difference).

    python -m interp.benchmarks.ablation_loop                      # 4 layers x 8 heads
    python -m interp.benchmarks.ablation_loop --layers 6 --batch 4 --method zero --repeats 5
"""

from __future__ import annotations

import time

import torch

from interp.models import HookedTransformer, ModelConfig

from interp.analyses.ablation import ablate_heads, ablation_values
from . import entry


@torch.no_grad()
def naive_sweep(model, tokens, method: str = "mean", seed: int = 0) -> dict:
    """{(layer, head): loss} with one full forward per head (the reference loop)."""
    values = ablation_values(model, tokens, method, seed=seed)
    out = {}
    for l in range(model.cfg.n_layers):
        for h in range(model.cfg.n_heads):
            def hook(z, hook, h=h, v=values[l]):
                z = z.clone()
                z[:, :, h] = v[:, :, h]
                return z

            out[(l, h)] = float(model.run_with_hooks(tokens, fwd_hooks=[(f"blocks.{l}.attn.hook_z", hook)], return_type="loss"))
    return out


def _timed(fn) -> tuple[float, float, object]:
    """(wall seconds, process CPU seconds, result). CPU time is the fairer number on a shared machine."""
    wall, cpu = time.perf_counter(), time.process_time()
    result = fn()
    return time.perf_counter() - wall, time.process_time() - cpu, result


def flop_ratio(cfg: ModelConfig, seq_len: int) -> float:
    """Forward FLOPs of the loop over those of the sweep (`ModelConfig.flops_per_token` accounting):
    loop = heads x full forward; sweep = 1 clean forward + per layer L and head: block L's MLP,
    blocks L+1.., and the unembedding (layer L's attention is reused)."""
    f = cfg.flops_per_token(seq_len)
    attn, mlp, unembed = f["attention"] / cfg.n_layers, f["mlp"] / cfg.n_layers, f["unembed"]
    full = f["total"]
    sweep = full + cfg.n_heads * sum(mlp + (cfg.n_layers - 1 - l) * (attn + mlp) + unembed for l in range(cfg.n_layers))
    return cfg.n_layers * cfg.n_heads * full / sweep


def main(argv=None) -> dict:
    parser = entry.parser("ablation_loop", __doc__)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--d-vocab", type=int, default=2048)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--method", choices=("mean", "zero", "resample"), default="mean")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs of each; the best is reported")
    args = parser.parse_args(argv)
    entry.apply_threads(args.threads)

    cfg = ModelConfig(n_layers=args.layers, d_model=args.d_model, n_heads=args.heads, d_vocab=args.d_vocab,
                      n_ctx=args.seq_len, d_mlp=4 * args.d_model)
    model = HookedTransformer(cfg, seed=0).eval()
    tokens = torch.randint(0, args.d_vocab, (args.batch, args.seq_len), generator=torch.Generator().manual_seed(0))

    naive_sweep(model, tokens[:2, :16], args.method)  # warm-up (allocator, kernels)
    ablate_heads(model, tokens[:2, :16], args.method, progress=False)
    runs = {"loop": [], "sweep": []}
    for _ in range(args.repeats):  # interleaved, so that load from other processes hits both alike
        runs["loop"].append(_timed(lambda: naive_sweep(model, tokens, args.method)))
        runs["sweep"].append(_timed(lambda: ablate_heads(model, tokens, args.method, progress=False)))
    ref, df = runs["loop"][-1][2], runs["sweep"][-1][2]
    fast = {(int(r.layer), int(r.head)): float(r.loss) for r in df.itertuples()}
    diff = max(abs(fast[k] - ref[k]) for k in ref)
    wall = {k: min(r[0] for r in v) for k, v in runs.items()}
    cpu = {k: min(r[1] for r in v) for k, v in runs.items()}
    n_heads = cfg.n_layers * cfg.n_heads

    print(f"model: {cfg.n_layers} layers x {cfg.n_heads} heads, d_model={cfg.d_model}, d_mlp={cfg.d_mlp}, "
          f"vocab={cfg.d_vocab}; data: {args.batch} x {args.seq_len} tokens; {args.method} ablation of {n_heads} "
          f"heads; torch threads={torch.get_num_threads()}; best of {args.repeats}")
    print(f"{'method':<32}{'forwards':>9}{'wall (s)':>10}{'cpu (s)':>10}{'wall x':>8}{'cpu x':>8}")
    print(f"{'loop: full forward per head':<32}{n_heads:>9}{wall['loop']:>10.3f}{cpu['loop']:>10.3f}{1:>8.2f}{1:>8.2f}")
    print(f"{'ablate_heads: resume + batch':<32}{1 + cfg.n_layers:>9}{wall['sweep']:>10.3f}{cpu['sweep']:>10.3f}"
          f"{wall['loop'] / wall['sweep']:>8.2f}{cpu['loop'] / cpu['sweep']:>8.2f}")
    print(f"FLOP ratio loop / sweep = {flop_ratio(cfg, args.seq_len):.2f} (the compute-bound ceiling);  "
          f"max |loss difference| = {diff:.2e}")
    return dict(wall=wall, cpu=cpu, speedup_wall=wall["loop"] / wall["sweep"], speedup_cpu=cpu["loop"] / cpu["sweep"],
                flop_ratio=flop_ratio(cfg, args.seq_len), max_diff=diff)


if __name__ == "__main__":
    main()
