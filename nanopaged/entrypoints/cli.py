"""The `nanopaged` command: subcommands over the offline engine."""

from __future__ import annotations

import argparse

from nanopaged.entrypoints import run_batch


def main(argv: list[str] | None = None) -> int:
    """Parse argv (default: sys.argv[1:]) and run the chosen subcommand; returns the exit code."""
    parser = argparse.ArgumentParser(prog="nanopaged", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    run_batch.add_parser(sub)
    args = parser.parse_args(argv)
    return args.func(args)
