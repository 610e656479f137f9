"""Every docs section and file that a comment or docstring cites exists.

A reader follows "docs/design.md §4c" or "see scripts/cpu_kernel_check.sh" from the code to the
page; a citation that points nowhere sends them away empty. Read from the text (nothing is
imported or run): the comments and docstrings of dynaspec/, tests/ and scripts/ (Python, shell
and C++), and the section headings of the pages they cite.

A bare section ("(§7d)") is a section of docs/design.md; one written after a page ("design.md
§4c", "DESIGN §4b") is that page's. A file path that starts with
docs/, scripts/, csrc/ (the package's csrc) or dynaspec/ must exist; a templated one (followed by
`{`, `<` or `*`) names a family, not a file, and is left alone.
"""

from __future__ import annotations

import ast
import functools
import io
import re
import sys
import tokenize
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCANNED = ("dynaspec", "tests", "scripts")
SUFFIXES = {".py", ".sh", ".cpp", ".h"}
# Files that a command writes: a docstring may name them before the command has run here.
WRITTEN = {"docs/results/support-matrix.md": "dynaspec bench matrix"}

_SECTION = re.compile(r"(?:(?P<page>[\w./-]+\.md|DESIGN)\s*)?§\s?(?P<key>\d+(?:\.\d+)*[a-z]?)")
_PATH = re.compile(r"(?<![\w./-])(?P<path>(?:docs|scripts|csrc|dynaspec)/[\w./-]*[\w/])"
                   r"(?P<next>.?)")


def comment_text(path: Path) -> list[tuple[int, str]]:
    """(line, text) of each comment and docstring in a file; code and other strings are left out."""
    text = path.read_text(encoding="utf-8", errors="replace")
    if path.suffix == ".py":
        return _python_comments(text)
    if path.suffix == ".sh":
        return [(i, line[line.index("#"):]) for i, line in enumerate(text.splitlines(), 1)
                if re.match(r"\s*#|.*\s#\s", line)]
    return _c_comments(text)


def _python_comments(text: str) -> list[tuple[int, str]]:
    out: list[tuple[int, str]] = []
    try:
        tokens = list(tokenize.generate_tokens(io.StringIO(text).readline))
    except (tokenize.TokenError, SyntaxError):
        return out
    out += [(t.start[0], t.string) for t in tokens if t.type == tokenize.COMMENT]
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return out
    for node in ast.walk(tree):
        doc = _docstring(node)
        if doc is not None:
            out += [(doc.lineno + i, line) for i, line in enumerate(str(doc.value).splitlines())]
    return out


def _docstring(node: ast.AST) -> ast.Constant | None:
    if not isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
        return None
    first = node.body[0] if node.body else None
    if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) \
            and isinstance(first.value.value, str):
        return first.value
    return None


def _c_comments(text: str) -> list[tuple[int, str]]:
    out: list[tuple[int, str]] = []
    for m in re.finditer(r"//[^\n]*|/\*.*?\*/", text, re.S):
        line = text.count("\n", 0, m.start()) + 1
        out += [(line + i, part) for i, part in enumerate(m.group().splitlines())]
    return out


@functools.cache
def section_keys(page: Path) -> frozenset[str]:
    """The section numbers of a Markdown page's headings: "## 4c. Token trees" gives "4c"."""
    keys = set()
    for line in page.read_text(encoding="utf-8").splitlines():
        m = re.match(r"#+\s+(\d+(?:\.\d+)*[a-z]?)[.:\s]", line)
        if m:
            keys.add(m.group(1))
    return frozenset(keys)


def resolve_page(name: str | None) -> Path | None:
    """The page a section citation names: none or DESIGN is docs/design.md; a bare file name is
    looked up under docs/ as well as at the repository root."""
    if name is None or name == "DESIGN":
        return REPO / "docs" / "design.md"
    for candidate in (REPO / name, REPO / "docs" / name):
        if candidate.is_file():
            return candidate
    return None


def broken_citations(path: Path) -> list[str]:
    rel = path.relative_to(REPO)
    found = []
    for line, text in comment_text(path):
        for m in _SECTION.finditer(text):
            page = resolve_page(m.group("page"))
            if page is None:
                found.append(f"{rel}:{line}: cites {m.group('page')}, which does not exist")
            elif m.group("key") not in section_keys(page):
                found.append(f"{rel}:{line}: cites §{m.group('key')}, which "
                             f"{page.relative_to(REPO)} does not have")
        for m in _PATH.finditer(text):
            cited, after = m.group("path").rstrip("."), m.group("next")
            if after in ("{", "<", "*") or cited in WRITTEN:
                continue
            on_disk = REPO / ("dynaspec/" + cited if cited.startswith("csrc/") else cited)
            if not on_disk.exists():
                found.append(f"{rel}:{line}: cites {cited}, which does not exist")
    return found


def scanned_files() -> list[Path]:
    return sorted(p for top in SCANNED for p in (REPO / top).rglob("*")
                  if p.suffix in SUFFIXES and p.is_file() and "build" not in p.parts)


def test_the_scanner_reads_comments_and_docstrings_only(tmp_path):
    f = tmp_path / "x.py"
    f.write_text('"""Module doc: design.md §1."""\n'
                 'KEY = "docs/not-a-citation.md"  # a comment: §7d\n'
                 'def f():\n    """Docs: docs/design.md §99."""\n')
    texts = [text for _, text in comment_text(f)]
    assert any("§1" in t for t in texts) and any("§7d" in t for t in texts)
    assert not any("not-a-citation" in t for t in texts)
    assert any("§99" in t for t in texts)


def test_a_missing_section_and_a_missing_file_are_found(tmp_path, monkeypatch):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "design.md").write_text("# t\n\n## 4c. Trees\n\n## 7. DP\n")
    (tmp_path / "scripts").mkdir()
    (tmp_path / "scripts" / "real.sh").write_text("")
    src = tmp_path / "dynaspec" / "m.py"
    src.parent.mkdir()
    src.write_text("# trees (§4c), DP (docs/design.md §7), gone (§4z); scripts/real.sh\n"
                   "# scripts/gone.sh; dynaspec/group/<epoch>/ is a key; csrc/*.cpp a family\n")
    monkeypatch.setattr(sys.modules[__name__], "REPO", tmp_path)
    assert broken_citations(src) == [
        "dynaspec/m.py:1: cites §4z, which docs/design.md does not have",
        "dynaspec/m.py:2: cites scripts/gone.sh, which does not exist",
    ]


def test_design_page_has_the_sections_the_code_leans_on():
    keys = section_keys(REPO / "docs" / "design.md")
    assert {"4c", "4d", "6f", "8", "9"} <= keys


@pytest.mark.parametrize("top", SCANNED)
def test_no_comment_or_docstring_cites_what_does_not_exist(top):
    files = [p for p in scanned_files() if p.relative_to(REPO).parts[0] == top]
    assert files, f"nothing read under {top}/"
    broken = [b for p in files for b in broken_citations(p)]
    assert not broken, "broken citations:\n" + "\n".join(broken)
