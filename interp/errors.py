"""What a user got wrong, said once: the error types and the checks of numbers that every layer shares
(the CLI, `interp.load`, the analyses, the models, the drawing of views). The lowest layer: it imports
nothing of interp, so anything may raise these. The models layer imports them from here too.

`UserError` carries a message that says what was wrong and how to fix it, in words that hold for the
library and the command line alike (parameter names, not flags). `interp.cli` prints one as a single
line and exits 2; a library caller can catch it, or the built-in type each subclass also is
(`BadValue` is a ValueError, so code written against ValueError keeps working).
"""

from __future__ import annotations

import contextlib
import math
import os


class UserError(Exception):
    """Bad input from the user: a name, a file, a setting. The message is the whole story."""


class CheckpointError(UserError, RuntimeError):
    """A checkpoint that cannot be read: missing, truncated or corrupt file, missing or mismatched tensor."""


class OwnCodeRefused(CheckpointError):
    """A checkpoint folder that needs its own Python code to load (an `auto_map`): never run, refused.
    Unlike a corrupt checkpoint, a sweep refuses it up front instead of skipping it."""


class Note(UserWarning):
    """Something a user should know that is no error: a setting that did less than it says (`device_map="auto"`
    on a machine without GPUs). A library caller gets a warning; `interp.cli` prints it as one `note: ...` line."""


class BadValue(UserError, ValueError):
    """A setting outside what can work (a negative count, a NaN, more threads than the machine has)."""


def check_int(name: str, value, *, minimum: int | None = None, maximum: int | None = None, hint: str = "") -> int:
    """`value` as an int within [minimum, maximum] (either bound optional), else BadValue naming it."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise BadValue(f"{name} must be an integer, got {value!r}")
    if (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
        span = (f">= {minimum}" if maximum is None else f"<= {maximum}" if minimum is None
                else f"between {minimum} and {maximum}")
        raise BadValue(f"{name} must be {span}, got {value}{'; ' + hint if hint else ''}")
    return value


def check_real(name: str, value, *, minimum: float | None = None, strict: bool = False) -> float:
    """`value` as a finite float, >= minimum (> with strict), else BadValue naming it."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise BadValue(f"{name} must be a finite number, got {value!r}")
    if minimum is not None and (value <= minimum if strict else value < minimum):
        raise BadValue(f"{name} must be {'>' if strict else '>='} {minimum}, got {value}")
    return float(value)


def check_threads(threads: int | None) -> int | None:
    """A torch thread count this machine can run: 1 .. its CPU count (None: torch's own choice).
    0 makes torch raise mid-run, and 100000 crashes OpenMP (a segmentation fault)."""
    if threads is None:
        return None
    cpus = os.cpu_count() or 1
    return check_int("threads", threads, minimum=1, maximum=cpus, hint=f"this machine has {cpus} CPU(s)")


@contextlib.contextmanager
def as_user_errors(*types: type[BaseException]):
    """Inside the block, an exception of `types` becomes a `UserError` with the same message: for a
    caller that knows those come from what the user gave (a command's settings), so that the CLI
    reports them as every other user error, in one line, in one place (`interp.cli.main`)."""
    try:
        yield
    except UserError:
        raise
    except types as e:
        raise UserError(str(e)) from e
