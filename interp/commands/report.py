"""`interp report DIR`: the HTML and Markdown report of a sweep folder."""

from __future__ import annotations

HELP = "write DIR/report.html (self-contained) and DIR/report.md from a sweep's results"
EPILOG = """examples:
  interp report out/attn-only-2l
  interp report out/attn-only-2l --title "attn-only-2l, seed 0"

`interp sweep` and `interp analyze` write the report at the end already; run this after changing
the report code or to re-render a partial sweep (it reads DIR/results.parquet or the parts).
"""


def add_arguments(p) -> None:
    p.add_argument("out", metavar="DIR", help="a sweep folder (with settings.json)")
    p.add_argument("--title", default=None, help="report title (default: the runs' names)")
    p.add_argument("--log-steps", action="store_true",
                   help="training-step axes on a symmetric-log scale (default linear, which keeps a late phase change wide)")
    p.add_argument("--headline", action="store_true",
                   help="print the summary's headline sentences (best heads, ICL, phase change) instead")


def run(args) -> int:
    from interp.analyses.atlas.report import headline, write_report
    from interp.errors import UserError

    try:
        if args.headline:
            print(headline(args.out))
            return 0
        path = write_report(args.out, title=args.title, log_steps=args.log_steps)
    except PermissionError as e:  # printed by interp.cli, as every user error
        raise UserError(f"cannot write the report into {args.out}: {e.strerror} ({e.filename})") from None
    # not a sweep folder, a damaged file, in use, not ours: FileNotFoundError / OutputError, printed by interp.cli
    print(f"wrote {path} and {path.with_suffix('.md')}")
    return 0
