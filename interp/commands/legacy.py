"""The old spellings of the study commands, rewritten to today's for one release, each with one note
(on stdout, as every note; errors alone go to stderr):

    interp kv MODEL ...                        -> interp kv precision MODEL ...
    interp kv MODEL --task passkey|needle ...  -> interp kv passkey MODEL ... (--needle)
    interp kv MODEL --task passkey --select R  -> interp kv select MODEL --rankings R ...
    interp analyze MODEL --lengths L ...       -> interp lengths MODEL --lengths L ...

An old option the new command does not take (it was accepted and ignored before) is dropped, and the
note says so. This module goes in the next release, with `interp.cli`'s one call to `rewrite`.
"""

from __future__ import annotations

import argparse

from .choices import KV_TASKS

NEXT = "the old spelling goes in the next release"


def rewrite(argv: list[str]) -> tuple[list[str], str] | None:
    """(today's argv, the note) for an old spelling; None for anything else."""
    if len(argv) >= 2 and argv[0] == "kv" and argv[1] not in ("precision", "passkey", "select", "-h", "--help"):
        return _kv(argv[1:])
    if argv and argv[0] == "analyze" and any(a == "--lengths" or a.startswith("--lengths=") for a in argv[1:]):
        return _analyze_lengths(argv[1:])
    return None


# ---- interp kv MODEL --task ... ------------------------------------------------------------------------
# the old options: (flag, takes a value, or the values it takes)
_KV_OPTIONS = [("--out", True), ("--precisions", True), ("--text-file", True), ("--data-file", True),
               ("--seq-len", True), ("--n-seqs", True), ("--sensitivity-tokens", True), ("--seeds", True),
               ("--task", KV_TASKS), ("--policies", True), ("--lengths", True), ("--depths", True), ("--prompts", True),
               ("--seed", True), ("--new-tokens", True), ("--select", True), ("--fractions", True), ("--sinks", True),
               ("--window", True), ("--selection-seeds", True), ("--scoring-prompts", True), ("--gate-steps", True),
               ("--gate-seconds", True), ("--device", True), ("--no-progress", False)]
_KV_TAKES = {
    "precision": {"--out", "--precisions", "--text-file", "--data-file", "--seq-len", "--n-seqs", "--sensitivity-tokens",
                  "--seeds", "--device", "--no-progress"},
    "passkey": {"--out", "--policies", "--lengths", "--depths", "--prompts", "--seed", "--new-tokens", "--text-file",
                "--data-file", "--seq-len", "--device", "--no-progress"},
    "select": {"--out", "--lengths", "--depths", "--prompts", "--seed", "--new-tokens", "--fractions", "--sinks",
               "--window", "--selection-seeds", "--scoring-prompts", "--gate-steps", "--gate-seconds", "--text-file",
               "--data-file", "--seq-len", "--device", "--no-progress"},
}


def _parse(argv: list[str], prog: str, positional: str, options) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=prog, argument_default=argparse.SUPPRESS)  # only what was given
    p.add_argument(positional)
    for flag, value in options:
        p.add_argument(flag, **({"choices": value} if isinstance(value, tuple) else {} if value else
                                {"action": "store_true"}))
    return p.parse_args(argv)


def _kv(argv: list[str]) -> tuple[list[str], str]:
    given = vars(_parse(argv, "interp kv", "model", _KV_OPTIONS))
    task = given.pop("task", "precisions")
    select = given.pop("select", None)
    study = "precision" if task == "precisions" else "select" if select else "passkey"
    needle = " --needle" if task == "needle" else ""
    old, now = {"precision": ("interp kv MODEL", "interp kv precision MODEL"),
                "passkey": (f"interp kv MODEL --task {task}", f"interp kv passkey MODEL{needle}"),
                "select": (f"interp kv MODEL --task {task} --select R", f"interp kv select MODEL{needle} --rankings R")}[study]
    new = ["kv", study, given.pop("model"), *needle.split(), *(["--rankings", select] if study == "select" else [])]
    dropped = ["--select"] if select and study == "precision" else []
    for dest, value in given.items():
        flag = "--" + dest.replace("_", "-")
        if flag not in _KV_TAKES[study]:
            dropped.append(flag)
        elif value is True:
            new.append(flag)
        else:
            new += [flag, value]
    return new, _note(old, now, dropped)


def _note(old: str, now: str, dropped: list[str]) -> str:
    said = f"; {', '.join(dropped)} ignored, as before" if dropped else ""
    return f"note: `{old}` is now `{now}` ({NEXT}){said}"


# ---- interp analyze MODEL --lengths ... ------------------------------------------------------------------
_ANALYZE_OPTIONS = [("--out", True), ("--lengths", True), ("--analyses", True), ("--expensive-on", True),
                    ("--data", True), ("--data-file", True), ("--text-file", True), ("--n-seqs", True),
                    ("--seq-len", True), ("--seed", True), ("--extrapolate", False), ("--device", True),
                    ("--force", False), ("--no-report", False), ("--no-progress", False)]
_LENGTHS_TAKES = {"--out", "--lengths", "--data", "--text-file", "--n-seqs", "--seed", "--extrapolate", "--device",
                  "--force", "--no-progress"}


def _analyze_lengths(argv: list[str]) -> tuple[list[str], str]:
    from interp.errors import UserError

    from .choices import ATLAS_ANALYSES

    given = vars(_parse(argv, "interp analyze", "model", _ANALYZE_OPTIONS))
    if "seq_len" in given:
        raise UserError("--lengths sets the lengths (the longest is the sequences' length): drop --seq-len")
    if given.get("analyses", ",".join(ATLAS_ANALYSES)) != ",".join(ATLAS_ANALYSES):
        raise UserError("--lengths runs the scores-by-length study (sinks, previous-token, duplicate-token, induction, "
                        "distance, entropy at each length), not the atlas's analyses: drop --analyses")
    if "data_file" in given:
        raise UserError("--lengths reads text (--text-file, default the Python Language Reference) or the zoo "
                        "corpus, not --data-file")
    if given.get("data") not in (None, "auto", "text", "corpus"):
        raise UserError(f"--lengths needs text or the zoo corpus (scores on the same text at every length); "
                        f"--data {given['data']} is not that")
    new, dropped = ["lengths", given.pop("model")], []
    for dest, value in given.items():
        flag = "--" + dest.replace("_", "-")
        if flag not in _LENGTHS_TAKES:
            dropped.append(flag)
        elif value is True:
            new.append(flag)
        else:
            new += [flag, value]
    return new, _note("interp analyze MODEL --lengths L", "interp lengths MODEL --lengths L", dropped)
