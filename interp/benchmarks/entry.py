"""What every `python -m interp.benchmarks.<name>` entry point shares: the parser with `--threads`
(checked against the machine), and the whole `main` of a benchmark that is one `interp bench` section."""

from __future__ import annotations

import argparse
from typing import Callable

import torch

from interp.errors import check_threads


def parser(name: str, description: str) -> argparse.ArgumentParser:
    """An argument parser for `python -m interp.benchmarks.<name>`, with `--threads`."""
    p = argparse.ArgumentParser(prog=f"python -m interp.benchmarks.{name}", description=description,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=None,
                   help="torch.set_num_threads, 1 .. this machine's CPUs (default: torch's own choice)")
    return p


def apply_threads(threads: int | None) -> None:
    """Set torch's intra-op threads (None: leave torch's choice), after checking the count can run."""
    if check_threads(threads):
        torch.set_num_threads(threads)


def section_main(name: str, section: Callable, doc: str, argv=None) -> int:
    """The `main` of a benchmark that is one section of `interp bench`: --threads, --quick, then the
    section's Markdown and the machine it ran on."""
    from .report import Options  # imported when the section runs: a section loads only what it measures
    # imported when the section runs: a section loads only what it measures
    from .timing import default_clock, machine_summary

    p = parser(name, doc.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="a tiny configuration (seconds)")
    args = p.parse_args(argv)
    apply_threads(args.threads)
    opts = Options.quick_config() if args.quick else Options()
    opts = opts.replace(clock=default_clock(opts.device, torch.get_num_threads()))
    print(section(opts).markdown())
    print(f"\n{machine_summary()}")
    return 0
