"""The packages of dynaspec import each other without a cycle (read from the AST, nothing is
imported): a cycle between packages is how a "one concept per package" layout decays."""

from __future__ import annotations

import ast
from pathlib import Path

import dynaspec

ROOT = Path(dynaspec.__file__).parent


def _package_of(module: str) -> str:
    """dynaspec.spec_decode.drafters.ngram -> spec_decode; dynaspec.config -> config (a top module
    is its own unit)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "dynaspec"


def _is_module(name: str) -> bool:
    return (ROOT / f"{name}.py").exists() or (ROOT / name / "__init__.py").exists()


def _imports(path: Path, module: str) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    package = module.rsplit(".", 1)[0] if path.name != "__init__.py" else module
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("dynaspec."))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target == "dynaspec":  # `from dynaspec import x`: x may be a module or a name
                found.update(f"dynaspec.{a.name}" for a in node.names if _is_module(a.name))
            elif target.startswith("dynaspec."):
                found.add(target)
    return found


def package_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for path in ROOT.rglob("*.py"):
        rel = path.relative_to(ROOT.parent).with_suffix("")
        module = ".".join(rel.parts).removesuffix(".__init__")
        src = _package_of(module)
        for target in _imports(path, module):
            dst = _package_of(target)
            if dst != src:
                graph.setdefault(src, set()).add(dst)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1 = on the stack, 2 = done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_the_cycle_finder_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}}) is None


def test_relative_imports_resolve_to_their_package(tmp_path):
    f = tmp_path / "x.py"
    f.write_text("from ..kv import pool\nfrom . import sibling\nimport dynaspec.sample.greedy\n")
    assert _imports(f, "dynaspec.engine.x") == {"dynaspec.kv", "dynaspec.engine",
                                                "dynaspec.sample.greedy"}


def test_no_import_cycle_between_packages():
    graph = package_graph()
    assert "engine" in graph and "spec_decode" in graph  # the graph was read
    assert find_cycle(graph) is None, f"package import cycle: {' -> '.join(find_cycle(graph))}"


def module_graph() -> dict[str, set[str]]:
    """Module -> the dynaspec modules it imports (lazy imports inside functions included: a
    circle closed only at call time is still a circle to a reader). `from pkg import name`
    counts as importing pkg, and a package's own __init__ is left out of its modules' edges."""
    paths = {".".join(p.relative_to(ROOT.parent).with_suffix("").parts).removesuffix(".__init__"): p
             for p in ROOT.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for module, path in paths.items():
        for target in _imports(path, module):
            while target not in paths and "." in target:
                target = target.rsplit(".", 1)[0]
            if target != module and not module.startswith(target + "."):
                graph.setdefault(module, set()).add(target)
    return graph


def test_no_import_cycle_between_modules():
    graph = module_graph()
    assert "dynaspec.models.load_types" in graph["dynaspec.models.hf_loader"]  # the graph was read
    cycle = find_cycle(graph)
    assert cycle is None, f"module import cycle: {' -> '.join(cycle or [])}"
