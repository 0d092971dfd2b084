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


@_subcommand
def _add_run(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "run",
        help="generate with an expert-parallel model across ranks and check it against transformers",
        description="Start EP ranks (or join torchrun's), load each rank's experts from a Hugging Face "
        "checkpoint, generate greedily and compare with the unsharded transformers model. With no "
        "--model, a small checkpoint of the Kimi-K2.5 architecture is built once and cached.",
    )
    p.add_argument("--model", metavar="DIR", help="local Hugging Face MoE checkpoint (default: built-in small Kimi-K2.5)")
    p.add_argument("--ep", type=int, default=2, help="EP ranks to spawn (default 2; torchrun sets its own)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="cpu (gloo) or cuda (NCCL)")
    p.add_argument("--placement", metavar="FILE", help="expert placement file (JSON or safetensors)")
    p.add_argument("--redundant", type=int, default=0, help="redundant slots per layer for the default placement")
    p.add_argument("--layout", choices=("contiguous", "round_robin"), default="contiguous",
                   help="default placement layout")
    p.add_argument("--prompt", action="append", default=[], help="a prompt (repeatable; default: built-in prompts)")
    p.add_argument("--max-new-tokens", type=int, default=8, help="tokens to generate per prompt (default 8)")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32")
    p.add_argument("--dispatcher", default="all_to_all", help="dispatcher backend (default all_to_all)")
    p.add_argument("--expert-backend", default="reference", help="expert compute backend (default reference)")
    p.add_argument("--no-reference", action="store_true", help="skip the unsharded transformers comparison")
    p.add_argument("--json", metavar="FILE", nargs="?", const="-", help="write the report as JSON (to stdout with no FILE)")
    p.set_defaults(func=_cmd_run)


def _cmd_run(args: argparse.Namespace) -> int:
    from .runtime.run import RunConfig, run_job

    report = run_job(RunConfig(
        model=args.model, ep=args.ep, device=args.device, placement=args.placement, redundant=args.redundant,
        layout=args.layout, prompts=tuple(args.prompt), max_new_tokens=args.max_new_tokens, dtype=args.dtype,
        dispatcher=args.dispatcher, expert_backend=args.expert_backend, reference=not args.no_reference,
    ))
    if report is None:  # a non-zero torchrun rank: rank 0 prints
        return 0
    if args.json == "-":
        import json

        print(json.dumps(report.to_json(), indent=2))
    else:
        from .runtime.report import print_run_report

        print_run_report(report)
        if args.json:
            from .runtime.run import write_json

            write_json(report, args.json)
    return 0 if report.matches_reference in (True, None) else 1


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
