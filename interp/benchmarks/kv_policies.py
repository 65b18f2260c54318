"""Per-head KV-cache policies on SmolLM2-135M: decoding speed with every head under one policy (full,
precisions, KIVI, StreamingLLM, H2O, SnapKV) beside the full fp32 cache, and the bytes each holds
against its theoretical figure, at 2,048 and 4,096 tokens of context, side by side in one run.

    python -m interp.benchmarks.kv_policies                 # 2,048 and 4,096 tokens, 16 decoded tokens
    interp bench --sections kv_policies

Decoding: the context is put in each cache once (untimed): one full prefill (with its queries) that
full, KIVI, H2O and SnapKV absorb (`PolicyKVCache.absorb`), and a prefill of their own for fp16 and
int8 (per-vector codes) and streaming (its window). Then 16 single-token steps are timed, every
policy and the plain `KVCache` interleaved in one round-robin (median of rounds). Each round starts
from the cache as it held the context: dense caches by resetting their length (their steps only
write past it), the others from a copy made before the timing (their held set changes every step).
A streaming head reads its sinks and window (260 keys) instead of the whole context, H2O and SnapKV
their budget; but on this CPU a decode step at 2k-4k tokens is dominated by the weight matmuls (MLP,
projections, unembedding: every parameter is read once per token), not by attention, so the ratio
to the full cache is modest. H2O also chooses what to keep after every step (it sums the attention
each key received, then a top-k and a gather per layer), which at 2k tokens costs about as much as
the shorter attention saves; streaming keeps its sinks and window by slicing, and SnapKV chooses
once, after the prompt, and then only appends. KIVI dequantizes its codes in torch at every step (no fused dequantizing attention kernel),
so it is slower than the fp32 cache here. Bytes: `cache.bytes_per_token()` with the context held
(codes, scales, residuals, kept keys and values, their slots and H2O's scores), against
`theory_bytes_per_token` from each policy's definition.
"""

from __future__ import annotations

import copy

import torch

from .entry import section_main
from .report import Options, Section, Table
from .timing import compare_times

POLICIES = ("full", "fp16", "int8", "kivi4", "kivi2", "streaming(4,256)", "h2o(260)", "snapkv(260)")
QUICK_POLICIES = ("full", "fp16", "int8", "kivi4", "kivi2", "streaming(4,28)", "h2o(32)", "snapkv(32)")
PLAIN = "KVCache (plain)"


def _model():
    import interp  # imported when the section runs: a section loads only what it measures
    from interp.loading import ModelNotFound  # imported when the section runs: a section loads only what it measures

    try:
        return "smollm2-135m", interp.load("smollm2-135m")
    except ModelNotFound:
        return "rope-gqa-4l", interp.load("rope-gqa-4l")


class PreparedCache:
    """A cache holding the context, and a fresh state of it for every timed call: dense caches are
    reset to the context (a step only writes past it), the others are copied ahead of the timing,
    one copy per call (`calls`: warm-up plus timed rounds at most)."""

    def __init__(self, cache, calls: int) -> None:
        from interp.models.kv.policy_cache import PolicyKVCache

        self.cache, self.length, self.n_seen = cache, cache.length, cache.n_seen.clone()
        self.resets = not isinstance(cache, PolicyKVCache) or all(p.layout == "dense" for row in cache.policies
                                                                  for p in row)
        self.copies = [] if self.resets else [copy.deepcopy(cache) for _ in range(calls)]

    def fresh(self):
        if self.resets:
            self.cache.length = self.length
            self.cache.n_seen.copy_(self.n_seen)
            return self.cache
        return self.copies.pop()


def rows(opts: Options, contexts, new: int, policies) -> tuple[str, dict[int, list[list]]]:
    """{context: [[policy, keys held per head, ms / token, vs full, measured B/token, theoretical B/token,
    measured / theoretical, rounds]]}, the plain KVCache's row first."""
    from interp.models.kv.policies import theory_bytes_per_token
    from interp.models.kv.policies import Dense, parse_policy

    name, model = _model()
    cfg = model.cfg
    dtype_bytes = torch.empty(0, dtype=model.dtype).element_size()
    calls = opts.warmup + opts.repeats
    out = {}
    for context in contexts:
        tokens = torch.randint(0, cfg.d_vocab, (1, context + new), generator=torch.Generator().manual_seed(0))
        prompt, steps = tokens[:, :context], tokens[:, context:]
        parsed = [parse_policy(p) for p in policies]
        prepared, held = {}, {}
        with torch.no_grad():
            queries = any(p.reads_queries for p in parsed)  # their choices read the prompt's queries
            full = model.new_kv_cache(1, context + new, capture_queries=queries)
            model(prompt, kv_cache=full)
            for p in parsed:
                cache = model.new_kv_cache(1, context + new, policy=p)
                if p.shares_prefill:
                    cache.absorb(full, model)
                else:
                    model(prompt, kv_cache=cache)
                held[p.name] = float(cache.held_mask(0).sum(-1).float().mean())
                prepared[p.name] = PreparedCache(cache, calls)
        full.queries = None  # absorbed: from here on the prefill cache is the plain fp32 KVCache
        prepared[PLAIN], held[PLAIN] = PreparedCache(full, calls), float(context)

        def decode(key):
            def run():
                cache = prepared[key].fresh()
                with torch.no_grad():
                    for i in range(new):
                        model(steps[:, i : i + 1], kv_cache=cache)
            return run

        times, rounds = compare_times({k: decode(k) for k in prepared}, repeats=opts.repeats, warmup=opts.warmup,
                                      budget=opts.budget, min_repeats=opts.min_repeats, clock=opts.clock)
        table = []
        for key, prep in [(PLAIN, prepared[PLAIN])] + [(p.name, prepared[p.name]) for p in parsed]:
            policy = Dense("fp32") if key == PLAIN else parse_policy(key)
            cache = prep.cache
            measured = cache.bytes_per_token()  # held bytes per cached token: one meaning on every cache
            theory = float(theory_bytes_per_token(policy, n_layers=cfg.n_layers, n_kv_heads=cfg.kv_heads,
                                                  d_head=cfg.head_dim, length=context, dtype_bytes=dtype_bytes))
            table.append([key, held[key], times[key] / new * 1e3, times[key] / times["full"], measured, theory,
                          measured / theory, rounds])
        out[context] = table
        del prepared, full
    return name, out


def section(opts: Options) -> Section:
    contexts, new, policies = ((64, 128), 4, QUICK_POLICIES) if opts.quick else ((2048, 4096), 16, POLICIES)
    name, tables = rows(opts, contexts, new, policies)
    headers = ["policy", "keys held / head", "ms / token", "vs full", "measured B/token", "theoretical B/token",
               "measured / theory", "rounds"]
    s = Section("kv_policies", f"Per-head KV-cache policies ({name}, {' and '.join(map(str, contexts))} tokens of "
                f"context)", intro=__doc__.split("\n\n", 2)[2].strip(),
                tables=[Table(f"Decoding {new} tokens after {c} tokens of context, every KV head under the policy",
                              headers, t) for c, t in tables.items()])
    s.notes = ["keys held / head: entries a KV head of layer 0 holds with the context in the cache (each decode "
               "step reads those plus its own); `KVCache (plain)` is the model's ordinary cache, `full` the policy "
               "cache holding every token in fp32 (bit for bit the same model)."]
    last = max(tables)
    s.headline = [f"KV policies, decode time vs the full cache at {last} tokens: "
                  + ", ".join(f"{r[0]} {r[3]:.2f}" for r in tables[last] if r[0] not in (PLAIN, "full"))]
    return s


def main(argv=None) -> int:
    return section_main("kv_policies", section, __doc__, argv)


if __name__ == "__main__":
    raise SystemExit(main())
