"""The error types and number checks, here under the name every module of models has always imported:
they live in `interp.errors`, the lowest layer, so that the drawing of views (`interp.drawing`, below
models) raises the same `UserError` the CLI prints in one line."""

from interp.errors import (BadValue, CheckpointError, OwnCodeRefused, UserError, as_user_errors, check_int,
                           check_real, check_threads)

__all__ = ["BadValue", "CheckpointError", "OwnCodeRefused", "UserError", "as_user_errors", "check_int", "check_real",
           "check_threads"]
