"""The engine client protocol: what the server and the async wrapper may ask of an engine."""

from __future__ import annotations

import inspect

from dynaspec import LLM, SamplingParams
from dynaspec.engine.client import EngineClient, EngineState, ModelCard, PoolReport


def _protocol_methods() -> set[str]:
    return {
        n for n, v in vars(EngineClient).items() if inspect.isfunction(v) and not n.startswith("_")
    }


def test_both_engines_implement_every_method():
    from dynaspec.dp.front_end import DPEngine
    from dynaspec.engine.llm_engine import LLMEngine

    for cls in (LLMEngine, DPEngine):
        missing = [m for m in _protocol_methods() if not callable(getattr(cls, m, None))]
        assert not missing, f"{cls.__name__} lacks {missing}"


def test_llm_engine_answers_the_protocol(tiny_llama_dir):
    eng = LLM(model=tiny_llama_dir, dtype="float32", num_kv_blocks=64, speculator="ngram",
              num_spec_tokens=2).engine
    assert isinstance(eng, EngineClient)
    card = eng.model_card()
    assert isinstance(card, ModelCard) and card.max_model_len == eng.max_model_len
    assert card.block_size == 16 and card.prefix_caching and card.lossless
    assert card.to_json()["spec_plan"]["max_k"] == 2 and card.to_json()["k_policy"] is not None
    assert eng.state() == EngineState(
        num_running=0, num_waiting=0, kv_num_blocks=64, kv_free_blocks=64, kv_usage=0.0
    )
    eng.add_request([1, 2, 3, 4], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    before = eng.progress()
    eng.step()
    assert eng.progress() != before and eng.state().kv_free_blocks < 64
    step = eng.take_step()
    assert step is not None and eng.take_step() is None  # each step handed out once
    while eng.has_unfinished_requests():
        eng.step()
    times = eng.take_finished_times()
    assert (
        len(times) == 1 and times[0].num_generation_tokens == 3 and times[0].num_prompt_tokens == 4
    )
    assert eng.take_finished_times() == []
    pool = eng.pool_report()
    assert (
        isinstance(pool, PoolReport) and pool.num_tokens == 64 * 16 and pool.drafter_cache is None
    )
    assert eng.failure() is None and eng.snapshot().kv_pool_tokens_target == 64 * 16
