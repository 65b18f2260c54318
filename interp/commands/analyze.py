"""`interp analyze MODEL --out DIR`: every analysis of one model, and its report (a sweep of one checkpoint)."""

from __future__ import annotations

HELP = "run the head analyses on one model and write its report (a sweep of a single checkpoint)"
EPILOG = """examples:
  interp analyze attn-only-2l --out out/one
  interp analyze path/to/checkpoint --out out/ckpt --analyses induction,sinks,ablation
  interp analyze path/to/hf-checkpoint --out out/hf --data repeated_random --seq-len 128

Same options, outputs and resumption as `interp sweep`; MODEL is a checkpoint folder (ours or
Hugging Face), or a zoo name or run folder (its last checkpoint).
"""


def add_arguments(p) -> None:
    from .sweep import add_sweep_options

    p.add_argument("model", help="a checkpoint folder (ours or Hugging Face), or a zoo name or run folder (its last checkpoint)")
    add_sweep_options(p)


def run(args) -> int:
    from .sweep import run_sweep

    return run_sweep(args, [args.model], last_only=True)
