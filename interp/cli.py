"""The `interp` command. Each subcommand is one module in `interp/commands/` exposing

    HELP: str                           one line for `interp --help`
    EPILOG: str                         copy-pasteable examples
    def add_arguments(parser) -> None
    def run(args) -> int | None

and is listed once in COMMANDS below (imported only when used, so `interp --help` is fast).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import sys
import warnings

COMMANDS: dict[str, str] = {
    "demo": "interp.commands.demo",
    "info": "interp.commands.info",
    "train": "interp.commands.train",
    "zoo": "interp.commands.zoo",
    "sweep": "interp.commands.sweep",
    "analyze": "interp.commands.analyze",
    "lengths": "interp.commands.lengths",
    "extrapolate": "interp.commands.extrapolate",
    "circuit": "interp.commands.circuit",
    "sinks": "interp.commands.sinks",
    "features": "interp.commands.features",
    "report": "interp.commands.report",
    "kv": "interp.commands.kv",
    "bench": "interp.commands.bench",
    "generate": "interp.commands.generate",
    "doctor": "interp.commands.doctor",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="interp",
        description="Mechanistic interpretability for PyTorch transformers.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, module_name in COMMANDS.items():
        module = importlib.import_module(module_name)
        p = sub.add_parser(
            name, help=module.HELP, description=module.HELP, epilog=getattr(module, "EPILOG", None),
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        module.add_arguments(p)
        p.set_defaults(_run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        parser = build_parser()
        args = parser.parse_args(argv)
        if not getattr(args, "_run", None):
            parser.print_help()
            return 0
        with _host_copy_guard(), _notes():
            return int(args._run(args) or 0)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except Exception as e:
        # Imported here, not at the top, for start-up time: `interp.models` imports torch.
        from interp.errors import UserError

        # A wrong name or setting, a missing or damaged file, an unsupported model: the message says
        # what and how to fix, in one line, without a traceback. Anything else is a bug: raised.
        if isinstance(e, (UserError, FileNotFoundError, NotImplementedError)):
            print(f"error: {e}", file=sys.stderr)
            return 2
        torch = sys.modules.get("torch")  # an out-of-memory error from torch means torch was imported already
        on_gpu = torch is not None and isinstance(e, torch.cuda.OutOfMemoryError)  # a RuntimeError, not a MemoryError
        if isinstance(e, MemoryError) or on_gpu:
            where = "the GPU" if on_gpu else "this machine"
            print(f"error: out of memory on {where} ({type(e).__name__}); nothing more was written: run it with less "
                  "(fewer prompts or sequences, shorter ones, a smaller --batch-size) or where there is more memory",
                  file=sys.stderr)
            return 2
        raise


@contextlib.contextmanager
def _notes():
    """interp's `Note` warnings (a library caller sees a warning) printed as one `note: ...` line each, once per
    message; other warnings as Python shows them."""
    from interp.errors import Note  # imports nothing

    with warnings.catch_warnings():
        warnings.simplefilter("always", Note)  # said once per message below, wherever it was raised from
        show, said = warnings.showwarning, set()

        def note_line(message, category, filename, lineno, file=None, line=None):
            if issubclass(category, Note):
                if str(message) not in said:
                    said.add(str(message))
                    print(f"note: {message}")
            else:
                show(message, category, filename, lineno, file, line)

        warnings.showwarning = note_line
        yield


def _host_copy_guard():
    """With INTERP_REFUSE_HOST_COPIES=1 (the test suite sets it), the command runs as if its tensors were on a
    GPU: a tensor taken to the host other than by `interp.models.placement.device.to_numpy` raises (`interp.testing`)."""
    import contextlib
    import os

    if os.environ.get("INTERP_REFUSE_HOST_COPIES") != "1":
        return contextlib.nullcontext()
    from interp.testing import refuse_host_copies  # start-up time: imports torch

    return refuse_host_copies()


if __name__ == "__main__":
    sys.exit(main())
