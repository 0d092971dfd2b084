"""The ``epmoe`` command: argument parsing only; each subcommand calls one library function."""

from __future__ import annotations

import argparse
import sys
from typing import Callable, Sequence

# Each subcommand module-level ``_add_<name>(subparsers)`` adds its parser and sets ``func``,
# a callable taking the parsed namespace and returning the process exit code.
_SUBCOMMANDS: list[Callable[[argparse._SubParsersAction], None]] = []


def _subcommand(fn: Callable[[argparse._SubParsersAction], None]) -> Callable[[argparse._SubParsersAction], None]:
    _SUBCOMMANDS.append(fn)
    return fn


def build_parser() -> argparse.ArgumentParser:
    """The full ``epmoe`` argument parser."""
    parser = argparse.ArgumentParser(prog="epmoe", description="Expert-parallel MoE inference for PyTorch.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in _SUBCOMMANDS:
        add(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``epmoe`` console script."""
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (ValueError, KeyError, FileNotFoundError, TypeError) as exc:
        print(f"epmoe {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
