"""Engine flags generated from the config dataclasses.

Every engine flag is a config field declared with `config.opt` (its default, help text and
choices live there once); this module turns them into argparse options and back into the flat
keyword arguments `EngineConfig.from_kwargs` takes. Used by every command that starts an engine
and by the benches that read engine flags from a string (`bench compare --a "..."`).
"""

from __future__ import annotations

import argparse
from dataclasses import MISSING, Field, fields

from dynaspec.config import EngineConfig


def _engine_fields() -> list[Field]:
    return [f for cls in EngineConfig.parts().values() for f in fields(cls)
            if f.metadata.get("help") and f.metadata.get("cli", True)]


def _flag(f: Field) -> str:
    return f.metadata.get("flag") or "--" + f.name.replace("_", "-")


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("engine")
    for f in _engine_fields():
        md, default = f.metadata, f.default
        if default is MISSING:
            raise TypeError(f"engine flag field {f.name} has no default")
        if default is None and md.get("type") is bool:
            # Three states: --x, --no-x, or neither (None: the engine's default, which may
            # differ by model: dynaspec/engine/tree_setting.py).
            group.add_argument(_flag(f), dest=f.name, default=None, help=md["help"],
                               action=argparse.BooleanOptionalAction)
            continue
        if isinstance(default, bool):
            # A --no-x switch: say what its field is when absent, not a bare "default: True".
            help_ = md["help"] + (" (without the flag: %(dest)s=%(default)s)" if default else "")
            group.add_argument(_flag(f), dest=f.name, default=default, help=help_,
                               action="store_false" if default else "store_true")
            continue
        choices = md.get("choices")
        help_ = md["help"] + (f" ({choices.help()})" if choices is not None else "")
        group.add_argument(_flag(f), dest=f.name, default=default, help=help_,
                           type=md.get("type") or type(default),
                           choices=choices.names if choices is not None else None)


def engine_kwargs(args: argparse.Namespace) -> dict:
    """The flat engine kwargs of parsed flags (every engine flag, defaults included)."""
    return {f.name: getattr(args, f.name) for f in _engine_fields()}


def parse_engine_args(argv: list[str]) -> dict:
    """Engine kwargs from a flag string's tokens (used by `bench compare --a "..."`)."""
    p = argparse.ArgumentParser(prog="engine-args", add_help=False)
    add_engine_args(p)
    return engine_kwargs(p.parse_args(argv))
