"""The `actrace` command: the one place that knows the core, the adapters and the analyzer."""
from __future__ import annotations

import argparse
import json
import sys

from .reader import TraceError

EXAMPLES = """examples:
  actrace validate runs/*.parquet
  actrace inspect runs/a.parquet --json
"""


def cmd_validate(args) -> int:
    from .validate import validate

    n_bad = 0
    for path in args.paths:
        problems = validate(path)
        for p in problems:
            print(p)
        n_bad += bool(problems)
        if not problems and not args.quiet:
            print(f"{path}: valid")
    return 1 if n_bad else 0


def cmd_inspect(args) -> int:
    from .describe import describe, format_description
    from .reader import trace_sources

    out = [describe(s) for s in trace_sources(args.paths)]
    print(json.dumps(out if len(out) > 1 else out[0], indent=2) if args.json
          else "\n\n".join(format_description(d) for d in out))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="actrace", description=__doc__.split(":")[0] + ": per-layer "
                                     "activation and gradient health traces.", epilog=EXAMPLES,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    p = sub.add_parser("validate", help="check traces against the spec (exit 1 if any is invalid)")
    p.add_argument("paths", nargs="+", metavar="PATH", help="trace files, .parts dirs, globs or folders")
    p.add_argument("-q", "--quiet", action="store_true", help="print problems only")
    p.set_defaults(func=cmd_validate)
    p = sub.add_parser("inspect", help="run metadata, layers, steps, streams and size of traces")
    p.add_argument("paths", nargs="+", metavar="PATH")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_inspect)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (TraceError, FileExistsError, FileNotFoundError, ValueError) as exc:
        print(f"actrace {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
