"""Every command's --help renders (a stray % in a help string crashed `dynaspec bench --help`)."""

from __future__ import annotations

import argparse

from dynaspec.cli.main import build_parser


def _parsers(p: argparse.ArgumentParser, path=()):
    yield path, p
    for action in p._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _parsers(sub, path + (name,))


def test_every_help_renders():
    seen = []
    for path, parser in _parsers(build_parser()):
        assert parser.format_help(), path
        seen.append(" ".join(path))
    assert {"bench", "bench compare", "bench decode", "serve", "generate", "tune"} <= set(seen)
