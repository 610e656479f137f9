"""StructuredOutputParams validation, the compile cache and its errors, the missing-extra error,
and the engine staying up after a grammar that does not compile."""

from __future__ import annotations

import sys

import pytest
import torch

from dynaspec import LLM, SamplingParams
from dynaspec.structured import StructuredOutputParams
from dynaspec.structured.backend import (
    GrammarCompileError,
    StructuredOutputUnavailable,
    load_backend,
)
from dynaspec.structured.manager import StructuredOutputManager


def test_params_need_exactly_one_form():
    with pytest.raises(ValueError, match="exactly one of .*got none"):
        StructuredOutputParams()
    with pytest.raises(ValueError, match="got json, regex"):
        StructuredOutputParams(json="{}", regex="a")
    with pytest.raises(ValueError, match="choice must be a list of strings"):
        StructuredOutputParams(choice="yes")
    with pytest.raises(ValueError, match="non-empty"):
        StructuredOutputParams(choice=[])
    with pytest.raises(ValueError, match="regex must be a non-empty string"):
        StructuredOutputParams(regex=" ")
    with pytest.raises(ValueError, match="structured_output must be a StructuredOutputParams"):
        SamplingParams(structured_output={"regex": "a"})


def test_params_are_hashable_and_keyed_by_content():
    a = StructuredOutputParams(json={"type": "object", "properties": {"b": {}, "a": {}}})
    b = StructuredOutputParams(json='{"type": "object", "properties": {"b": {}, "a": {}}}')
    assert a == b and hash(a) == hash(b) and a.key == b.key == ("json", b.json)
    assert a.form == "json" and StructuredOutputParams(choice=["x"]).key == ("choice", '["x"]')
    assert hash(SamplingParams(structured_output=a)) == hash(SamplingParams(structured_output=b))


def test_missing_library_names_the_extra(monkeypatch):
    monkeypatch.delitem(sys.modules, "dynaspec.structured.xgrammar_backend", raising=False)
    monkeypatch.setitem(sys.modules, "xgrammar", None)  # import xgrammar -> ImportError
    with pytest.raises(StructuredOutputUnavailable, match=r"pip install 'dynaspec\[structured\]'"):
        load_backend("xgrammar", None, 10, (), False)


@pytest.fixture(scope="module")
def manager(tiny_llama_dir):
    pytest.importorskip("xgrammar")
    from dynaspec.models.loader import load_tokenizer
    tok = load_tokenizer(tiny_llama_dir)
    return StructuredOutputManager("xgrammar", tok, tok.vocab_size, (2,), False)


@pytest.mark.parametrize(
    "spec, words",
    [
        (
            StructuredOutputParams(json='{"type": "nosuch"}'),
            "JSON schema does not compile: Unsupported type",
        ),
        (StructuredOutputParams(json="{not json"), "JSON schema does not compile"),
        (StructuredOutputParams(regex="a["), "regex does not compile"),
        (StructuredOutputParams(grammar="root ::= "), "grammar does not compile"),
    ],
)
def test_compile_errors_name_the_problem(manager, spec, words):
    with pytest.raises(GrammarCompileError, match=words) as info:
        manager.compile(spec)
    assert "/project/cpp" not in str(info.value)  # the library's log prefix is stripped


def test_compile_is_cached_per_spec(manager):
    spec = StructuredOutputParams(regex=r"[0-9]{2}")
    n, hits = manager.num_compiles, manager.num_cache_hits
    first = manager.compile(spec)
    assert manager.compile(StructuredOutputParams(regex=r"[0-9]{2}")) is first
    assert (manager.num_compiles, manager.num_cache_hits) == (n + 1, hits + 1)
    assert manager.drain_compile_seconds()[-1] >= 0 and manager.drain_compile_seconds() == ()


def test_bad_grammar_is_refused_at_add_and_the_engine_keeps_serving(tiny_llama_dir):
    pytest.importorskip("xgrammar")
    llm = LLM(model=tiny_llama_dir, dtype="float32", num_kv_blocks=64)
    bad = SamplingParams(structured_output=StructuredOutputParams(regex="(a"))
    with pytest.raises(ValueError, match="regex does not compile"):
        llm.engine.add_request([5, 6, 7], bad)
    assert not llm.engine.has_unfinished_requests()
    out = llm.generate([[5, 6, 7]], SamplingParams(
        temperature=0, max_tokens=8, structured_output=StructuredOutputParams(regex="ab?c")))[0]
    assert out.text in ("ac", "abc") and out.finish_reason == "stop"
    llm.engine.check_integrity()


@pytest.mark.parametrize("rows", [None, [1, 3]])
def test_torch_masking_matches_the_library_kernel(manager, rows):
    from dynaspec.structured.backend import apply_bitmask_torch
    g = torch.Generator().manual_seed(0)
    vocab = manager.backend().vocab_size
    logits = torch.randn(4, vocab, generator=g)  # [4, vocab]
    bitmask = torch.randint(-2**31, 2**31 - 1, (4, (vocab + 31) // 32), generator=g,
                            dtype=torch.int64).to(torch.int32)  # every bit pattern, sign bit too
    a, b = logits.clone(), logits.clone()
    manager.backend().apply_bitmask(a, bitmask, rows)
    apply_bitmask_torch(b, bitmask, rows)
    assert torch.equal(a, b) and bool(torch.isinf(a).any())
    for r in range(4):
        for t in (0, 31, 32, vocab - 1):
            want = (rows is not None and r not in rows) or \
                (int(bitmask[r, t >> 5]) >> (t & 31)) & 1 == 1
            assert bool(torch.isfinite(a[r, t])) == want
