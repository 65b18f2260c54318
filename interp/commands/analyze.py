"""`interp analyze MODEL --out DIR`: every analysis of one model, and its report (a sweep of one checkpoint)."""

from __future__ import annotations
from .choices import ATLAS_ANALYSES

HELP = "the head atlas of one model: head scores, sinks, StreamingLLM, composition, pruning, and its report"
EPILOG = """examples:
  interp analyze smollm2-135m --out out/smollm2        # real text: the Python Language Reference
  interp analyze smollm2-135m --out out/s --text-file my.txt
  interp analyze attn-only-2l --out out/one
  interp analyze path/to/checkpoint --out out/ckpt --analyses induction,sinks,ablation
  interp analyze path/to/hf-checkpoint --out out/hf --data repeated_random --seq-len 128
  interp analyze gemma3-270m --out out/g32k --seq-len 32768 --n-seqs 1 --analyses previous_token,induction,sinks

Same options, outputs and resumption as `interp sweep` (a sweep of a single checkpoint); MODEL is a
real-model name, a .gguf file, a Hugging Face repo id or checkpoint folder, or a zoo name or run
folder (its last checkpoint). Add ablation,importance to --analyses for exact per-head ablation (a
forward per head: minutes on a 270-head model).

Long context: every head score streams (no n x n pattern at any length), sliding-window layers run
in bands, and a length is checked before loading: past the model's trained context only with
--extrapolate (the default --seq-len of 256 is fitted to a shorter context, said in one line), and
one the memory cannot hold is refused with the longest that fits. Scores at several lengths:
`interp lengths MODEL --lengths 1024,4096,8192`.
"""


def add_arguments(p) -> None:
    from .sweep import add_sweep_options  # start-up time: --help and argument errors never import torch

    p.add_argument("model", help="a checkpoint folder (ours or Hugging Face), or a zoo name or run folder (its last checkpoint)")

    add_sweep_options(p, ATLAS_ANALYSES)


def run(args) -> int:
    from .sweep import run_sweep  # start-up time: --help and argument errors never import torch

    return run_sweep(args, [args.model], last_only=True)
