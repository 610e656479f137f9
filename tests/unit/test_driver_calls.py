"""The drivers (sync, pipelined, DP rank) and the phases call only public methods of the engine
and the runner: a driver is an order of the engine's phases, never a reach into its insides."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2] / "dynaspec"
DRIVERS = ["engine/sync_driver.py", "engine/async_loop.py", "engine/phases.py", "dp/rank.py"]


def private_reaches(source: str) -> list[str]:
    """`x._name` for any `x` but `self`/`cls` (a class's own members) or an imported module
    (`os._exit`): attribute reads and calls alike."""
    tree = ast.parse(source)
    modules = {a.asname or a.name.split(".")[0] for n in ast.walk(tree)
               if isinstance(n, ast.Import) for a in n.names}
    found = []
    for n in ast.walk(tree):
        if not (isinstance(n, ast.Attribute) and n.attr.startswith("_")
                and not n.attr.startswith("__")):
            continue
        if isinstance(n.value, ast.Name) and n.value.id in {"self", "cls", *modules}:
            continue
        found.append(f"line {n.lineno}: {ast.unparse(n)}")
    return sorted(found)


@pytest.mark.parametrize("path", DRIVERS)
def test_drivers_call_no_private_engine_or_runner_member(path: str) -> None:
    assert private_reaches((ROOT / path).read_text()) == []


def test_the_scan_finds_a_private_reach() -> None:
    src = ("import os\nclass D:\n    def step(self):\n        self._own()\n        os._exit(0)\n"
           "        self.engine._forget('r')\n        return self.engine.runner._graph_top\n")
    assert private_reaches(src) == ["line 6: self.engine._forget",
                                    "line 7: self.engine.runner._graph_top"]
