"""`dynaspec serve`'s engine threads (one core left to the HTTP side unless told otherwise) and
its token budget per step."""

import argparse
import logging

import pytest

import dynaspec.cli.serve_cmd as serve_cmd
from dynaspec import config
from dynaspec.engine_flags import add_engine_args


@pytest.mark.parametrize("cores, threads", [(1, 1), (2, 1), (16, 15)])
def test_a_server_leaves_one_core_to_its_front_end(monkeypatch, cores, threads):
    monkeypatch.setattr(config, "default_num_threads", lambda: cores)
    assert config.server_num_threads() == threads


def _args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--max-body-bytes", type=int, default=1)
    add_engine_args(p)
    return p.parse_args(argv)


class _Stop(Exception):
    pass


def _engine_threads(monkeypatch, argv: list[str]) -> int | None:
    """num_threads as `serve` hands it to the engine (the build is stopped right there)."""
    seen = {}

    def build(name, metrics_prefix, **kw):
        seen.update(kw)
        raise _Stop

    monkeypatch.setattr("dynaspec.server.api_server.build_async_engine", build)
    monkeypatch.setattr(config, "default_num_threads", lambda: 4)
    args = _args(argv)
    args.metrics_prefix = "dynaspec"
    with pytest.raises(_Stop):
        serve_cmd.run(args)
    return seen["num_threads"]


def test_serve_defaults_to_the_server_threads_and_says_so(monkeypatch, caplog):
    with caplog.at_level(logging.INFO, logger="dynaspec"):
        assert _engine_threads(monkeypatch, ["--model", "default"]) == 3
    assert "3 torch thread(s) on 4 core(s)" in caplog.text


def test_an_explicit_thread_count_or_data_parallel_is_left_alone(monkeypatch):
    assert _engine_threads(monkeypatch, ["--model", "default", "--num-threads", "2"]) == 2
    assert _engine_threads(monkeypatch, ["--model", "default", "--data-parallel-size", "2"]) is None


@pytest.mark.parametrize("argv, ui", [([], True), (["--no-ui"], False)])
def test_no_ui_reaches_the_app(monkeypatch, argv, ui):
    """`serve --no-ui` builds the app without the page (tests/server/test_ui_routes.py checks
    what such an app serves)."""
    from dynaspec.cli.main import build_parser

    seen = {}

    class _Engine:
        engine = None

    def build_app(engine, name, **kw):
        seen.update(kw)
        raise _Stop

    monkeypatch.setattr("dynaspec.server.api_server.build_async_engine",
                        lambda *a, **kw: _Engine())
    monkeypatch.setattr("dynaspec.server.api_server.build_app", build_app)
    args = build_parser().parse_args(["serve", "--model", "default", *argv])
    with pytest.raises(_Stop):
        serve_cmd.run(args)
    assert seen["ui"] is ui


@pytest.mark.parametrize("argv, budget", [
    ([], serve_cmd.SERVE_TOKEN_BUDGET),  # no speculator: short prefill chunks beside decodes
    (["--speculator", "ngram"], 2048),  # drafts count in the budget: the engine's default
    (["--max-num-batched-tokens", "1024"], 1024),  # given: kept
    (["--speculator", "ngram", "--max-num-batched-tokens", "256"], 256)])
def test_serve_token_budget(monkeypatch, argv, budget):
    from dynaspec.cli.main import build_parser

    seen = {}

    def build(name, metrics_prefix, **kw):
        seen.update(kw)
        raise _Stop

    monkeypatch.setattr("dynaspec.server.api_server.build_async_engine", build)
    args = build_parser().parse_args(["serve", "--model", "default", *argv])
    with pytest.raises(_Stop):
        serve_cmd.run(args)
    assert seen["max_num_batched_tokens"] == budget
