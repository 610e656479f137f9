"""Bad input gets a clear error naming the problem, and the engine keeps serving."""

from __future__ import annotations

import json

import pytest

from dynaspec import LLM, EngineConfig, SamplingParams
from dynaspec.cli.main import main as cli_main


@pytest.mark.parametrize("kwargs, match", [
    ({"max_tokens": 0}, "max_tokens must be a positive integer"),
    ({"max_tokens": -3}, "max_tokens must be a positive integer"),
    ({"temperature": -0.5}, "temperature must be >= 0"),
    ({"top_p": 0.0}, r"top_p must be in \(0, 1\]"),
    ({"top_p": 1.5}, r"top_p must be in \(0, 1\]"),
    ({"top_k": -2}, "top_k must be"),
    ({"top_k": 2**63}, "top_k must be"),  # found by the fuzzer: it used to fail the whole step
    ({"seed": 2**64}, "seed must be a 64-bit integer"),
    ({"seed": -(2**63) - 1}, "seed must be a 64-bit integer"),
    ({"min_p": 2.0}, "min_p must be in"),
])
def test_bad_sampling_params(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("kwargs, match", [
    ({"dtype": "int3"}, "unknown dtype 'int3'"),
    ({"device": "tpu"}, "unknown device 'tpu'"),
    ({"speculator": "magic"}, "unknown speculator 'magic'"),
    ({"speculator": "draft", "num_spec_tokens": 2}, "needs --draft-model"),
    ({"speculator": "draft", "draft_model": "d.gguf"}, "needs --num-spec-tokens"),
    ({"speculator": "eagle", "eagle_lookup": "trie"}, "eagle_lookup must be none, ngram or suffix"),
    ({"speculator": "ngram", "num_spec_tokens": 2, "eagle_lookup": "ngram"},
     "--eagle-lookup applies to --speculator eagle or hybrid only"),
    ({"prompt_lookup_min": 4, "prompt_lookup_max": 2}, "prompt_lookup_min <= prompt_lookup_max"),
    ({"max_num_seqs": 0}, "max_num_seqs must be >= 1"),
    ({"bogus_flag": 1}, "unknown engine argument 'bogus_flag'"),
])
def test_bad_engine_config(kwargs, match):
    with pytest.raises((ValueError, TypeError), match=match):
        EngineConfig.from_kwargs(**kwargs)


def test_unknown_architecture_is_named(tiny_llama_dir, tmp_path):
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(tiny_llama_dir, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["architectures"] = ["MambaForCausalLM"]
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="MambaForCausalLM"):
        LLM(model=str(bad))


def test_missing_model_path_is_named(tmp_path):
    with pytest.raises(ValueError, match="does not exist|not found|no such"):
        LLM(model=str(tmp_path / "nowhere"))


def test_engine_keeps_serving_after_bad_requests(tiny_llama_dir):
    llm = LLM(model=tiny_llama_dir, dtype="float32", max_model_len=64, num_kv_blocks=64)
    eng = llm.engine
    with pytest.raises(ValueError, match="prompt has 80 tokens.*max_model_len 64"):
        eng.add_request(list(range(3, 83)), SamplingParams(max_tokens=4))
    with pytest.raises(ValueError, match="prompt is empty"):
        eng.add_request([], SamplingParams(max_tokens=4))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        eng.add_request([5, 10**6], SamplingParams(max_tokens=4))
    out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))[0]
    assert len(out.token_ids) == 5
    eng.check_integrity()


def test_generation_stops_at_max_model_len(tiny_llama_dir):
    llm = LLM(model=tiny_llama_dir, dtype="float32", max_model_len=20, num_kv_blocks=64)
    out = llm.generate([list(range(3, 15))], SamplingParams(temperature=0, max_tokens=100,
                                                             ignore_eos=True))[0]
    assert len(out.prompt_token_ids) + len(out.token_ids) == 20
    assert out.finish_reason == "length"


def test_cli_reports_bad_input_with_status_2(capsys, tmp_path):
    code = cli_main(["generate", "--model", str(tmp_path / "missing"), "--prompt", "hi"])
    assert code == 2
    assert "missing" in capsys.readouterr().err


def test_abort_frees_blocks(tiny_llama_dir):
    llm = LLM(model=tiny_llama_dir, dtype="float32", num_kv_blocks=64)
    eng = llm.engine
    rid = eng.add_request(list(range(3, 40)), SamplingParams(max_tokens=50, ignore_eos=True))
    eng.step()
    eng.step()
    assert eng.kv.num_free_blocks() < 64
    assert eng.abort_request(rid)
    assert not eng.has_unfinished_requests()
    eng.check_integrity()
    assert eng.kv.num_free_blocks() == 64
