"""`dynaspec` command line: generate | serve | bench | tune | schedule | dp-worker."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

from dynaspec.extras import MissingExtraError

# Subcommand modules; each exposes register(subparsers) and sets args.func.
_COMMANDS = ["dynaspec.cli.generate", "dynaspec.cli.schedule_cmd", "dynaspec.cli.bench_cmd",
             "dynaspec.cli.serve_cmd", "dynaspec.cli.tune_cmd", "dynaspec.cli.dp_worker_cmd"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dynaspec", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for name in _COMMANDS:
        try:
            mod = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name == name:
                continue  # subcommand not built in this checkout
            raise
        mod.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (ValueError, FileNotFoundError, MissingExtraError) as exc:
        print(f"dynaspec: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
