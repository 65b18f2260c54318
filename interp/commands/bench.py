"""`interp bench`: benchmarks side by side with TransformerLens and Hugging Face, written to BENCHMARKS.md."""

from __future__ import annotations

import shlex
from .choices import BENCH_SECTIONS as ALL

HELP = "benchmark against TransformerLens and Hugging Face on the same weights; write BENCHMARKS.md"
EPILOG = """sections (in page order):
  forward       our fused forward vs HF sdpa / eager vs TransformerLens bridge forward and run_with_cache
  cache         run_with_cache with patterns / residuals / nothing, ours vs TransformerLens: time, peak memory
  long_context  previous-token / induction / sink scores at long context: streaming vs cached patterns
  ablation      every-head mean-ablation sweep on rope-gqa-4l: ablate_heads vs a TransformerLens hook loop
  generation    tokens/s, our KV cache vs HF generate (greedy), batch 1 and 8
  patching      TransformerLens's patching sweep on our model vs on its bridge
  real_model    SmolLM2-135M from GGUF: load time and peak memory, forward vs transformers
  gemma3        Gemma 3 270M from GGUF: the same
  scale         a 1.2B bf16 checkpoint (Llama-3.2-1B shape): load time and memory, interp vs transformers, bf16 and fp32
  head_scan     head-type scores: the streaming kernel vs materialised patterns, by sequence length
  kv_cache      quantized KV caches (int8, fp8, int4): bytes per token vs theory, decode time vs fp32
  kv_policies   per-head cache policies (KIVI, streaming, H2O, SnapKV) at 2k / 4k: decode time vs full, bytes
  stats_kernel  head statistics of one layer (SmolLM2's, Gemma 3's local and global) vs its fused forward
  saes          one SAE spliced into SmolLM2 (hook_z, resid): run_with_saes vs the clean forward vs a hand-written hook
  gpu           the same on CUDA, plus the head statistics vs SDPA flash, the model, exactness (skipped without CUDA)

examples:
  interp bench --quick --out /tmp/bench.md                 # every section, tiny sizes, seconds
  interp bench --threads 1                                 # the full run behind BENCHMARKS.md
  interp bench --sections forward --seqs 128,512 --shapes llama-small --out -
  interp bench --sections long_context --long-seqs 1024,4096,16384,32768 --memory-limit-gib 16
"""


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.replace(" ", "").split(",") if x)


def _names(text: str) -> tuple[str, ...]:
    return tuple(x for x in text.replace(" ", "").split(",") if x)


# (flag, dest, type, help); defaults come from Options (or --quick's tiny configuration)
_SIZED = [
    ("--shapes", "shapes", _names, "forward / cache / generation models (gpt2-small, llama-small, gpt2-tiny, llama-tiny)"),
    ("--seqs", "seqs", _ints, "forward sequence lengths, comma-separated"),
    ("--long-seqs", "long_seqs", _ints, "long-context sequence lengths"),
    ("--cache-seq", "cache_seq", int, "sequence length of the cache-overhead table"),
    ("--gen-batches", "gen_batches", _ints, "generation batch sizes"),
    ("--gen-tokens", "gen_tokens", int, "new tokens per generation"),
    ("--repeats", "repeats", int, "timed rounds at most (median reported)"),
    ("--budget", "budget", float, "seconds of timed rounds per cell; big cells get fewer rounds (at least 2)"),
    ("--memory-limit-gib", "memory_limit_gib", float, "the 'fits in' memory of the long-context table"),
]


def add_arguments(p) -> None:

    p.add_argument("--sections", type=_names, default=ALL, help=f"comma-separated, from {','.join(ALL)} (default: all)")
    p.add_argument("--quick", action="store_true", help="a tiny configuration of every section (seconds; what the tests run)")
    for flag, dest, kind, text in _SIZED:
        p.add_argument(flag, dest=dest, type=kind, default=None, help=text)
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's own choice)")
    p.add_argument("--out", default="BENCHMARKS.md", help="Markdown file to write ('-': print only)")
    p.add_argument("--strict", action="store_true", help="stop at the first section that fails (default: report it and go on)")


def command_line(args) -> str:
    """The command, canonically spelled: `interp bench` and every option that was given."""
    parts = ["interp", "bench"]
    from interp.benchmarks.suite import ALL  # start-up time: --help and argument errors never import torch

    if tuple(args.sections) != tuple(ALL):
        parts += ["--sections", ",".join(args.sections)]
    if args.quick:
        parts.append("--quick")
    for flag, dest, _, _ in _SIZED:
        value = getattr(args, dest)
        if value is not None:
            parts += [flag, ",".join(map(str, value)) if isinstance(value, tuple) else str(value)]
    if args.threads:
        parts += ["--threads", str(args.threads)]
    if args.out != "BENCHMARKS.md":
        parts += ["--out", args.out]
    if args.strict:
        parts.append("--strict")
    return " ".join(shlex.quote(p) for p in parts)


def run(args) -> int:
    from interp.benchmarks.report import Options  # start-up time: --help and argument errors never import torch
    # start-up time: --help and argument errors never import torch
    from interp.benchmarks.suite import ALL, run as run_suite

    unknown = [s for s in args.sections if s not in ALL]
    if unknown:
        from interp.errors import BadValue

        raise BadValue(f"unknown sections {unknown}; choose from {','.join(ALL)}")
    given = {dest: getattr(args, dest) for _, dest, _, _ in _SIZED if getattr(args, dest) is not None}
    opts = Options.quick_config(**given) if args.quick else Options(**given)
    sections = run_suite(
        opts, args.sections, out=None if args.out == "-" else args.out, command=command_line(args),
        threads=args.threads, keep_going=not args.strict,
    )
    return 1 if any(s.skipped and s.skipped.startswith("failed") for s in sections) else 0
