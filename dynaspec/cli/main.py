"""`dynaspec` command line: generate | serve | bench | tune | schedule | dp-worker."""

from __future__ import annotations

import argparse
import difflib
import importlib
import logging
import sys

from dynaspec.extras import MissingExtraError

# Subcommand modules; each exposes register(subparsers) and sets args.func.
_COMMANDS = ["dynaspec.cli.generate", "dynaspec.cli.schedule_cmd", "dynaspec.cli.bench_cmd",
             "dynaspec.cli.serve_cmd", "dynaspec.cli.tune_cmd", "dynaspec.cli.dp_worker_cmd",
             "dynaspec.cli.train_cmd"]


class Parser(argparse.ArgumentParser):
    """Every help line shows its default; subcommand parsers are of this class too."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("formatter_class", argparse.ArgumentDefaultsHelpFormatter)
        super().__init__(*args, **kwargs)

    def unknown(self, extras: list[str]) -> None:
        """Refuse unknown flags with this parser's usage (not the top level's) and the closest
        flags it has."""
        flags = [o for a in self._actions for o in a.option_strings]
        hints = []
        for x in extras:
            close = difflib.get_close_matches(x.split("=")[0], flags, n=2, cutoff=0.6)
            if x.startswith("-") and close:
                hints.append(f"{x}: did you mean {' or '.join(close)}?")
        self.error(f"unrecognized arguments: {' '.join(extras)}" +
                   "".join(f"\n  {h}" for h in hints))


def build_parser() -> Parser:
    parser = Parser(prog="dynaspec", description=__doc__)
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
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["serve"]:
        from dynaspec.omp_threads import set_server_spin

        set_server_spin()  # before building the parser imports torch: libgomp reads it once
    parser = build_parser()
    args, extras = parser.parse_known_args(argv)
    if extras:  # argparse would report them against the top-level usage
        _subparser(parser, args.command).unknown(extras)
    try:
        return int(args.func(args) or 0)
    except (ValueError, FileNotFoundError, MissingExtraError) as exc:
        print(f"dynaspec: error: {exc}", file=sys.stderr)
        return 2


def _subparser(parser: Parser, command: str | None) -> Parser:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction) and command in action.choices:
            return action.choices[command]
    return parser


if __name__ == "__main__":
    sys.exit(main())
