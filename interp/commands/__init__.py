"""Subcommands of the `interp` CLI, one module each (see interp/cli.py)."""
