"""CLI as a new user meets it: every flag of serve and generate says what it does and its default,
a mistyped flag gets the subcommand's own usage and the closest flag, an over-long context is
refused unless asked for; /metrics without `*_created` series and with a vLLM prefix on demand."""

from __future__ import annotations

import argparse
import re

import pytest

from dynaspec.cli.main import build_parser, main


def _sub(name: str) -> argparse.ArgumentParser:
    parser = build_parser()
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return action.choices[name]


@pytest.mark.parametrize("name", ["serve", "generate"])
def test_every_flag_has_help_and_default(name):
    p = _sub(name)
    missing = [a.option_strings for a in p._actions if a.option_strings and not a.help]
    assert not missing, f"{name}: flags without help: {missing}"
    text = p.format_help()
    for flag in ("--port", "--speculator", "--num-spec-tokens") if name == "serve" else \
            ("--max-tokens", "--temperature", "--top-p", "--top-k", "--seed", "--speculator"):
        entry = text[text.index("\n  " + flag + " ") + 1:]  # its help entry, not the usage
        line = entry[:entry.find("\n  -")]
        assert "(default:" in line, f"{flag}: {line}"


def test_mistyped_flag_prints_the_subcommands_usage_and_a_suggestion(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["serve", "--spec-tokens", "4"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: dynaspec serve") and "--num-spec-tokens" in err
    assert "did you mean --num-spec-tokens" in err


def test_bench_compare_prefix_caching_modes_parse_and_a_wrong_one_names_the_choices(capsys):
    parse = lambda *a: build_parser().parse_args(["bench", "compare", "--a", "", "--b", "", *a])  # noqa: E731
    assert parse().prefix_caching == "off"
    assert parse("--prefix-caching").prefix_caching == "warm"  # the flag alone, as before
    assert parse("--prefix-caching", "cold").prefix_caching == "cold"
    with pytest.raises(SystemExit) as exc:
        parse("--prefix-caching", "lukewarm")
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--prefix-caching" in err and "'lukewarm'" in err and "'cold'" in err


def test_max_model_len_above_trained_context_is_refused(tiny_llama_dir):
    from dynaspec import LLM

    with pytest.raises(ValueError, match="above the model's trained context .256."):
        LLM(model=tiny_llama_dir, dtype="float32", max_model_len=100000, num_kv_blocks=32)
    llm = LLM(model=tiny_llama_dir, dtype="float32", max_model_len=300, num_kv_blocks=32,
              allow_long_max_model_len=True)
    assert llm.engine.max_model_len == 300


def test_metrics_have_no_created_series_and_take_a_prefix():
    from dynaspec.metrics.prometheus import PrometheusMetrics

    text = PrometheusMetrics(labels={"model_name": "m"}).render().decode()
    assert "_created" not in text and "dynaspec:generation_tokens_total" in text
    vllm = PrometheusMetrics(labels={"model_name": "m"}, prefix="vllm").render().decode()
    assert "vllm:num_requests_running" in vllm and "dynaspec:" not in vllm
def _parsers(p: argparse.ArgumentParser, path=()):
    yield path, p
    for action in p._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _parsers(sub, path + (name,))


def test_every_commands_help_renders():
    seen = []
    for path, parser in _parsers(build_parser()):
        assert parser.format_help(), path
        seen.append(" ".join(path))
    assert {"bench", "bench compare", "bench decode", "serve", "generate", "tune"} <= set(seen)


def test_metrics_prefix_reaches_data_parallel_metrics(monkeypatch):
    """`serve --metrics-prefix vllm --data-parallel-size 2`: the per-rank and the summed series
    both take the prefix (the DP engine builds its own registries)."""
    import dynaspec.dp.front_end as front_end
    from dynaspec.dp.metrics import DPMetrics
    from dynaspec.metrics.records import EngineSnapshot
    from dynaspec.server.api_server import build_async_engine

    dp = DPMetrics(2, {"model_name": "m"}, "vllm")
    for rank in (0, 1):
        dp.rank_snapshot(
            rank,
            EngineSnapshot(
                num_running=1,
                num_waiting=0,
                kv_usage=0.5,
                kv_pool_tokens_target=64,
                kv_pool_tokens_drafter=0,
                prefix_cache_queries=10,
                prefix_cache_hits=4,
                num_preemptions_total=0,
            ),
        )
    text = dp.render().decode()
    for rank in ("0", "1", "all"):
        assert re.search(rf'^vllm:num_requests_running\{{[^}}]*rank="{rank}"', text, re.M), rank
    assert "dynaspec:" not in text
    assert "dynaspec:num_requests_running" in DPMetrics(1, {}).render().decode()

    seen = {}

    class FakeDP:  # records what the server hands the DP engine; starts no rank processes
        def __init__(self, config, metrics_labels=None, metrics_prefix=None):
            seen.update(prefix=metrics_prefix)
            self.metrics = DPMetrics(config.parallel.data_parallel_size, metrics_labels,
                                     metrics_prefix)

    monkeypatch.setattr(front_end, "DPEngine", FakeDP)
    monkeypatch.setattr("dynaspec.server.api_server.AsyncEngine", lambda build: build()[1])
    metrics = build_async_engine("m", metrics_prefix="vllm", model="default",
                                 data_parallel_size=2)
    assert seen == {"prefix": "vllm"}
    assert "vllm:num_requests_running" in metrics.render().decode()
