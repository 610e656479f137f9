"""A base install (no extras) fails clearly: each CLI subcommand's import path runs in a fresh
interpreter with the optional packages hidden, and either works or exits 2 naming the extra."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from dynaspec.extras import EXTRAS

OPTIONAL = sorted({m for mods in EXTRAS.values() for m in mods} | {"scipy", "llama_cpp"})


def _run(code: str, hidden: list[str] = OPTIONAL) -> subprocess.CompletedProcess:
    """Run `code` with `hidden` packages unimportable (as if never installed)."""
    prelude = textwrap.dedent(f"""
        import importlib.abc, sys
        HIDDEN = {sorted(hidden)!r}
        class _NotInstalled(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path, target=None):
                if name.split(".")[0] in HIDDEN:
                    raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
                return None
        sys.meta_path.insert(0, _NotInstalled())
        from dynaspec.cli.main import main
    """)
    return subprocess.run([sys.executable, "-c", prelude + textwrap.dedent(code)],
                          capture_output=True, text=True, timeout=120)


def _cli(*argv: str, hidden: list[str] = OPTIONAL) -> subprocess.CompletedProcess:
    return _run(f"sys.exit(main({list(argv)!r}))", hidden)


@pytest.mark.parametrize("argv, hidden, extra", [
    (["serve", "--model", "default"], ["fastapi"], "server"),
    (["serve", "--model", "default"], ["uvicorn"], "server"),
    (["serve", "--model", "default"], ["prometheus_client"], "server"),
    (["serve", "--model", "default"], OPTIONAL, "server"),
    (["bench", "reliability", "--scenario", "fuzz"], ["schemathesis"], "bench"),
    (["bench", "reliability", "--scenario", "abort"], ["httpx"], "bench"),
    (["bench", "reliability", "--scenario", "soak"], ["pydantic"], "server"),
])
def test_missing_extra_exits_2_naming_it(argv, hidden, extra):
    proc = _cli(*argv, hidden=hidden)
    assert proc.returncode == 2, proc.stderr
    assert f"pip install 'dynaspec[{extra}]'" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("argv", [["--help"], ["generate", "--help"], ["serve", "--help"],
                                  ["bench", "compare", "--help"], ["tune", "--help"],
                                  ["bench", "reliability", "--help"],
                                  ["schedule", "explain", "--help"]])
def test_help_of_every_subcommand_needs_no_extra(argv):
    proc = _cli(*argv)
    assert proc.returncode == 0, proc.stderr
    assert "usage:" in proc.stdout


def test_schedule_explain_runs_on_a_base_install():
    proc = _cli("schedule", "explain", "--speculator", "ngram", "--num-spec-tokens", "3",
                "--k-policy", "table")  # goodput would add width 1: variable
    assert proc.returncode == 0, proc.stderr
    assert "constant" in proc.stdout


def test_bench_statistics_and_compare_path_need_no_extra():
    proc = _run("""
        import dynaspec.bench.compare_cmd, dynaspec.bench.compare, dynaspec.bench.tune
        from dynaspec.bench.stats import paired_ratio
        est = paired_ratio([1.0, 2.0, 4.0], [1.1, 2.3, 4.2])
        assert est.lo < est.ratio < est.hi
        from dynaspec.extras import MissingExtraError
        from dynaspec.bench.plots import plot_compare
        try:
            plot_compare({}, [], "/tmp")
        except MissingExtraError as exc:
            print(exc)
        assert "scipy" not in sys.modules
    """)
    assert proc.returncode == 0, proc.stderr
    assert "plots needs the package 'matplotlib'" in proc.stdout
    assert "pip install 'dynaspec[bench]'" in proc.stdout
