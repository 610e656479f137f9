"""A request that a failing step ends is reported as failed, with what it produced kept: the
offline API's output carries the message and the text of its tokens, `dynaspec generate` prints
them and exits 1 (docs/design.md §4c)."""

from __future__ import annotations

import json

import pytest

from dynaspec import LLM
from dynaspec.cli.main import main as cli_main
from dynaspec.worker.model_runner import ModelRunner

from .conftest import greedy

FAIL_AT = 4  # the 4th forward raises: the prefill and two decodes gave 3 tokens before it


def _failing_run(calls: list[int]):
    run = ModelRunner.run

    def flaky(self, prepared):  # type: ignore[no-untyped-def]
        calls.append(1)
        if len(calls) == FAIL_AT:
            raise RuntimeError("injected forward failure")
        return run(self, prepared)

    return flaky


def test_llm_generate_reports_the_error_with_the_text_produced(tiny_llama_dir, monkeypatch):
    llm = LLM(model=tiny_llama_dir, dtype="float32", num_kv_blocks=64)
    monkeypatch.setattr(ModelRunner, "run", _failing_run([]))
    out = llm.generate("hello world", greedy(12, ignore_eos=True))[0]
    assert out.finish_reason == "error" and out.finished
    assert out.error == "RuntimeError: injected forward failure"
    assert len(out.token_ids) == FAIL_AT - 1
    assert out.text and out.text == llm.tokenizer.decode(out.token_ids)
    # The engine keeps serving.
    monkeypatch.undo()
    again = llm.generate("hello world", greedy(5, ignore_eos=True))[0]
    assert again.finish_reason == "length" and again.token_ids[:3] == out.token_ids
    llm.engine.check_integrity()


def test_llm_generate_keeps_the_cut_at_a_stop_string_on_error(tiny_llama_dir, monkeypatch):
    llm = LLM(model=tiny_llama_dir, dtype="float32", num_kv_blocks=64)
    monkeypatch.setattr(ModelRunner, "run", _failing_run([]))
    stop = "\x00never"  # a stop string that never matches: its text goes through check_stop
    out = llm.generate("hello world", greedy(12, ignore_eos=True, stop=[stop]))[0]
    assert out.finish_reason == "error" and len(out.token_ids) == FAIL_AT - 1
    assert out.text and out.text == llm.tokenizer.decode(out.token_ids)


@pytest.mark.parametrize("as_json", [True, False])
def test_cli_generate_exits_nonzero_and_prints_the_error(tiny_llama_dir, monkeypatch, capsys,
                                                         as_json):
    monkeypatch.setattr(ModelRunner, "run", _failing_run([]))
    argv = ["generate", "--model", tiny_llama_dir, "--prompt", "hello world", "--max-tokens",
            "12", "--dtype", "float32", "--num-kv-blocks", "64"]
    code = cli_main(argv + (["--json"] if as_json else []))
    out, err = capsys.readouterr()
    assert code == 1
    assert "generation failed after 3 tokens: RuntimeError: injected forward failure" in err
    if as_json:
        obj = json.loads(out)
        assert obj["finish_reason"] == "error"
        assert obj["error"] == "RuntimeError: injected forward failure"
        assert len(obj["token_ids"]) == obj["num_output_tokens"] == FAIL_AT - 1
        assert obj["text"], "the text of the tokens it produced"
    else:
        assert out.strip(), "the text of the tokens it produced"
